"""The layout planner on mixtures of experts: parameters, expert-parallel layouts, memory and time.

Cheap: no processes, no compile; the Hugging Face models are built on the meta device."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from boost_compile.costmodel.hardware import load_hardware
from boost_compile.plan.memory import PRECISIONS, memory
from boost_compile.plan.model import HF_SHAPES, from_hf_config, from_llama_config, from_preset
from boost_compile.plan.search import Job, Layout, PlanError, best, layouts, price, search

transformers = pytest.importorskip("transformers")

TINY = {
    "deepseek_v3": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 24,
                    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                    "n_group": 1, "topk_group": 1},
    "qwen3_moe": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
                  "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0]},
    "qwen2_moe": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2},
    "mixtral": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
}
H100 = load_hardware("h100")


def job(spec, devices: int, per_node: int = 8, batch: int = 64, seq: int = 4096, memory_gib: float | None = None) -> Job:
    cap = (memory_gib or 0.9 * H100.memory_gib) * 2**30
    return Job(spec, batch, seq, devices, per_node, H100, cap, "bf16-mixed")


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_a_mixture_of_experts_has_the_parameters_of_transformers_model(model_type):
    import torch

    config = transformers.AutoConfig.for_model(model_type, **TINY[model_type])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    spec = from_hf_config({"model_type": model_type, **TINY[model_type]})
    assert spec.moe and spec.num_params() == sum(p.numel() for p in model.parameters())


def test_parameters_follow_the_formula():
    # DeepSeek-V3 (671B without its multi-token-prediction layer)
    assert round(from_hf_config(HF_SHAPES["deepseek-v3"]).num_params() / 1e9) == 671
    # the reference model's MoE (read with getattr: the fields of LlamaConfig's MoE), CoLA experts
    base = from_preset("cola-60m")
    config = SimpleNamespace(**{f: getattr(base, f) for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                                               "vocab_size", "projection", "rank_attn", "rank_mlp",
                                                               "norm", "bias", "tie_embeddings")},
                             n_experts=8, experts_top_k=2, expert_ffn_dim=None)
    spec = from_llama_config("cola-60m-moe", config)
    d, f, r, e, layers = base.dim, base.ffn_dim, base.rank_mlp, 8, base.n_layers
    dense_mlp = 3 * r * (d + f)  # the MLP's three CoLA projections, each two factors
    moe_mlp = e * d + e * 3 * r * (d + f)  # the router and the stacked experts' factors
    assert spec.top_k == 2 and spec.expert_width == f
    assert spec.num_params() == base.num_params() + layers * (moe_mlp - dense_mlp)


def test_a_dense_model_gets_no_expert_parallel_rows():
    rows = list(layouts(job(from_preset("cola-60m"), 8, batch=64, seq=512)))
    assert rows and all(lo.ep == 1 for lo in rows)


def test_expert_parallel_rows_are_those_boost_train_runs():
    spec = from_hf_config({"model_type": "qwen3_moe", **TINY["qwen3_moe"], "num_experts": 4})
    every = list(layouts(job(spec, 8, per_node=4, batch=16, seq=256)))
    ep_rows = [lo for lo in every if lo.ep > 1 and lo.dp_shard == 1]  # DDP's (FSDP2's: the test below)
    # ep divides dp and the 4 experts: tp1 dp8 ep2/4, tp2 dp4 ep2/4; tp4 cannot split the 2 kv-heads
    assert {(lo.tp, lo.dp, lo.ep) for lo in ep_rows} == {(1, 8, 2), (1, 8, 4), (2, 4, 2), (2, 4, 4)}
    for lo in ep_rows:
        assert lo.dp % lo.ep == 0 and lo.pp == 1 and lo.dp_shard == 1 and lo.zero == 0 and spec.n_experts % lo.ep == 0
        assert f"parallel.ep={lo.ep}" in lo.overrides() and f"ep{lo.ep}" in lo.label()


def test_expert_parallel_rows_under_fsdp2_are_those_boost_train_runs():
    """EP x FSDP2 / HSDP: every dp x dp_shard of the FSDP2 rows, with TP (megatron) or without, ep
    dividing the data ranks and the experts; none without FSDP2."""
    spec = from_hf_config({"model_type": "qwen3_moe", **TINY["qwen3_moe"], "num_experts": 4})
    j = job(spec, 8, per_node=4, batch=16, seq=256)
    rows = [lo for lo in layouts(j) if lo.ep > 1 and lo.dp_shard > 1]
    # tp1: 8 data ranks (dp_shard 2, 4, 8); tp2: 4 (dp_shard 2, 4); ep 2 or 4 (the 4 experts)
    expected = {(tp, dp_shard, ep, reshard) for tp, shards in ((1, (2, 4, 8)), (2, (2, 4))) for dp_shard in shards
                for ep in (2, 4) for reshard in (True, False)}
    assert {(lo.tp, lo.dp_shard, lo.ep, lo.reshard_after_forward) for lo in rows} == expected
    for lo in rows:
        assert lo.pp == 1 and lo.zero == 0 and lo.data_ranks == 8 // lo.tp
        assert lo.data_ranks % lo.ep == 0 and spec.n_experts % lo.ep == 0
        assert {f"parallel.ep={lo.ep}", f"parallel.dp_shard={lo.dp_shard}"} <= set(lo.overrides())
        data = f"fsdp{lo.dp_shard}" if lo.dp == 1 else f"hsdp{lo.dp}x{lo.dp_shard}"
        assert lo.label().startswith(f"tp{lo.tp} {'megatron ' if lo.tp > 1 else ''}{data}") and f" ep{lo.ep} " in lo.label()
    assert Layout(1, 1, 2, dp_shard=4, ep=8).label() == "tp1 hsdp2x4 ep8 ckpt=none"
    assert not any(lo.ep > 1 and lo.dp_shard > 1 for lo in layouts(j, fsdp=False))


def test_expert_state_under_fsdp2_is_experts_over_ep_whatever_dp_shard():
    """FSDP2 under EP: a rank holds n_experts / ep of the experts, whole where ep is every data rank
    (FSDP2 ignores them) and else sliced over their replicas (params, grads, AdamW), and its
    1/dp_shard slice of every other tensor; its gathered blocks are the blocks less their experts,
    and so is what the time model gathers; the experts modules sharded over replicas are gathered too."""
    from boost_compile.plan.memory import fsdp_shard, start_memory
    from boost_compile.plan.search import moe_of

    spec = from_hf_config({"model_type": "mixtral", **TINY["mixtral"]})
    tensors = spec.tensors()
    experts = sum(t.numel for t in tensors if t.role == "expert")
    w, e = PRECISIONS["bf16-mixed"].weights, PRECISIONS["bf16-mixed"].gathered
    kw = {"tp": 1, "pp": 1, "zero": 0, "microbatches": 1, "schedule": "1f1b", "checkpoint": "none",
          "batch": 8, "seq": 64, "precision": "bf16-mixed", "reshard_after_forward": False}
    for dp, dp_shard, ep in ((2, 2, 4), (1, 4, 4), (1, 4, 2)):
        mem = memory(spec, "megatron", dp=dp, dp_shard=dp_shard, ep=ep, **kw)
        others = sum(fsdp_shard(t.numel, dp_shard) for t in tensors if t.role != "expert")
        replicas = dp * dp_shard // ep  # 1, 1, 2
        mine = sum(fsdp_shard(t.numel // ep, replicas) for t in tensors if t.role == "expert")
        assert mine == experts // ep // replicas  # tiny mixtral's experts split evenly
        assert mem.terms["params"] == mem.terms["grads"] == (mine + others) * w
        assert mem.terms["optimizer"] == 2 * (mine + others) * w
    # every block gathered (noreshard), each without its experts; with them without EP; with ep2 over 4
    # ranks the experts modules are sharded over their 2 replicas, and gathered too (all: noreshard)
    blocks = [sum(t.numel for t in tensors if t.block == b and t.role != "expert") for b in range(spec.n_layers)]
    ignored = memory(spec, "megatron", dp=1, dp_shard=4, ep=4, **kw).terms["fsdp_gathered"]
    sharded = memory(spec, "megatron", dp=1, dp_shard=4, ep=2, **kw).terms["fsdp_gathered"]
    without = memory(spec, "megatron", dp=1, dp_shard=4, ep=1, **kw).terms["fsdp_gathered"]
    assert ignored == sum(blocks) * e and without == (sum(blocks) + experts) * e
    assert sharded == (sum(blocks) + experts // 2) * e
    lo = Layout(1, 1, 1, checkpoint="none", plan="megatron", dp_shard=4, ep=2)
    assert moe_of(job(spec, 4, batch=8, seq=64), lo).block_units == tuple(blocks)
    # the start: each rank materialises its experts whole beside its FSDP2 slices
    start = {ep: start_memory(spec, "megatron", tp=1, pp=1, dp_shard=4, precision="bf16-mixed", ep=ep) for ep in (1, 2)}
    sliced = sum(fsdp_shard(t.numel, 4) for t in tensors if t.role == "expert")
    assert start[2] - start[1] == (experts // 2 - sliced) * w


def test_an_fsdp2_step_under_ep_pays_the_all_to_alls_and_the_replicas_all_reduce():
    """EP x HSDP: the all-to-alls on the step as under DDP, FSDP2's collectives without the experts'
    bytes, and the replicas' all-reduce (data ranks / ep > 1) dearer across nodes."""
    from dataclasses import replace

    from boost_compile.costmodel.scale_model import Workload
    from boost_compile.plan.search import moe_of
    from boost_compile.plan.timing import expert_replicas_time, fsdp_step_time

    spec = from_hf_config({"model_type": "qwen3_moe", **TINY["qwen3_moe"], "num_experts": 16, "hidden_size": 256})
    j = job(spec, 8, per_node=8, batch=16)
    plain = Layout(1, 1, 2, checkpoint="none", plan="megatron", dp_shard=4)
    ep4 = replace(plain, ep=4)
    assert price(j, ep4).a2a_s > 0 == price(j, plain).a2a_s
    assert price(j, ep4).fsdp_s < price(j, plain).fsdp_s  # the experts' bytes are not gathered nor reduce-scattered
    wl = Workload(seq=j.seq, batch=j.batch, dtype_bytes=2)
    inside = moe_of(j, ep4)
    across = replace(inside, replicas_across_nodes=True)
    assert expert_replicas_time(moe_of(j, replace(ep4, ep=8)), 8, H100, wl) == 0  # one group: no replicas
    kw = {"tp": 1, "dp": 2, "dp_shard": 4, "checkpoint": "none", "hw": H100, "wl": wl, "param_bytes": 4}
    shape = spec.scale_shape()
    a, b = fsdp_step_time(shape, "megatron", moe=inside, **kw), fsdp_step_time(shape, "megatron", moe=across, **kw)
    extra = expert_replicas_time(across, 8, H100, wl) - expert_replicas_time(inside, 8, H100, wl)
    assert extra > 0 and b.step_s - a.step_s == pytest.approx(extra)


def test_expert_state_per_rank_falls_as_one_over_ep():
    spec = from_hf_config({"model_type": "mixtral", **TINY["mixtral"]})
    kw = {"tp": 1, "pp": 1, "dp": 4, "zero": 0, "microbatches": 1, "schedule": "1f1b", "checkpoint": "none",
          "batch": 8, "seq": 64, "precision": "bf16-mixed"}
    one, four = memory(spec, "megatron", ep=1, **kw), memory(spec, "megatron", ep=4, **kw)
    d, f, e, layers = 64, 96, 4, 2
    experts = layers * e * 3 * d * f  # gate, up, down of every expert of every block
    w = PRECISIONS["bf16-mixed"].weights
    assert one.terms["params"] - four.terms["params"] == experts * (1 - 1 / 4) * w
    assert one.terms["grads"] - four.terms["grads"] == experts * (1 - 1 / 4) * w
    assert one.terms["optimizer"] - four.terms["optimizer"] == 2 * experts * (1 - 1 / 4) * w
    assert one.terms["dp_buckets"] - four.terms["dp_buckets"] == experts * w  # DDP leaves the experts' out


def test_the_all_to_all_is_free_without_ep_and_dearer_across_nodes():
    spec = from_hf_config({"model_type": "qwen3_moe", **TINY["qwen3_moe"], "num_experts": 16, "hidden_size": 256})
    plain = Layout(1, 1, 8, checkpoint="none", plan="megatron")
    ep8 = Layout(1, 1, 8, checkpoint="none", plan="megatron", ep=8)
    one_node, two_nodes = job(spec, 8, per_node=8, batch=16), job(spec, 8, per_node=4, batch=16)
    assert price(one_node, plain).a2a_s == 0
    inside, across = price(one_node, ep8).a2a_s, price(two_nodes, ep8).a2a_s
    assert 0 < inside < across


def test_a_deepseek_v3_shape_on_64_h100_ranks_expert_parallelism():
    spec = from_hf_config(HF_SHAPES["deepseek-v3-lite"], "deepseek-v3-lite")
    j = job(spec, 64, batch=256)
    rows = search(j, checkpoints=("none", "full"))
    first = best(rows, j)
    ep_rows = [r for r in rows if r.layout.ep > 1 and r.fits]
    assert ep_rows and {r.layout.ep for r in ep_rows} >= {64, 32}
    # the first choice shards the experts with their blocks (FSDP2 / HSDP, no EP)
    assert first.layout.dp_shard > 1 and first.layout.ep == 1
    # the fastest EP layout: HSDP 8 x 8 with EP groups of one node (ep8), whose all-to-alls stay on the
    # node, and each experts module sharded over its 8 replicas (a rank holds less than without EP);
    # it loses to the first by the experts' traffic across the nodes, its all-to-alls and small
    # micro-steps (its EP activations fit no more)
    from boost_compile.costmodel.scale_model import Workload
    from boost_compile.plan.search import moe_of
    from boost_compile.plan.timing import expert_replicas_time

    fastest_ep = ep_rows[0]
    assert (fastest_ep.layout.dp, fastest_ep.layout.dp_shard, fastest_ep.layout.ep) == (8, 8, 8)
    assert fastest_ep.layout.local_batch in (1, 2) and first.step_s < fastest_ep.step_s < 1.3 * first.step_s
    assert fastest_ep.terms_gib["params"] < first.terms_gib["params"] / 4
    replicas = expert_replicas_time(moe_of(j, fastest_ep.layout), 64, j.hardware, Workload(seq=j.seq, batch=j.batch))
    assert replicas > fastest_ep.a2a_s > 0
    # DDP's fastest EP layout loses more, mostly by its all-to-alls, which cross the nodes' 45 GB/s links
    ddp_ep = next(r for r in ep_rows if r.layout.dp_shard == 1)
    assert ddp_ep.step_s > 1.5 * fastest_ep.step_s and ddp_ep.a2a_s > 0.4 * ddp_ep.step_s


def test_deepseek_v3_fits_nowhere_on_64_h100():
    spec = from_hf_config(HF_SHAPES["deepseek-v3"], "deepseek-v3")
    j = job(spec, 64, batch=64)
    rows = search(j, checkpoints=("full",))
    assert any(r.layout.ep > 1 for r in rows) and not any(r.fits for r in rows)
    with pytest.raises(PlanError, match="no layout of deepseek-v3 fits in 71.69 GiB per device on 64 device.* the smallest"):
        best(rows, j)


@pytest.mark.parametrize("config, named", [
    ({"model_type": "olmoe", "num_experts": 8, "hidden_size": 64}, "'olmoe'.*num_experts"),
    ({"model_type": "llama", "num_local_experts": 8, "hidden_size": 64}, "'llama'.*num_local_experts"),
    ({"model_type": "deepseek_v3", **TINY["deepseek_v3"], "attention_bias": True}, "attention_bias"),
])
def test_an_unmodelled_mixture_of_experts_is_refused_by_name(config, named):
    with pytest.raises(ValueError, match=named):
        from_hf_config(config)


def test_auto_can_choose_expert_parallelism():
    from conftest import FAST, cfg_of

    from boost_compile.train.auto_layout import choose_layout
    from boost_compile.train.validate import to_train_config

    moe = ("model=hf-tiny", "model.hf_config.model_type=qwen3_moe", "+model.hf_config.num_experts=64",
           "+model.hf_config.num_experts_per_tok=2", "+model.hf_config.moe_intermediate_size=128")
    # FSDP2 left out (passes.unit=model): the experts are sharded by EP or held whole on every rank
    tc = to_train_config(cfg_of(*FAST, "passes=boost_aot_eager", "parallel=auto", *moe, "trainer.batch=8",
                                "trainer.seq=64", "++passes.unit=model", "parallel.memory_gib=0.02"))
    chosen, rows = choose_layout(tc, world=4, per_node=4, device_type="cpu")
    assert any(r.layout.ep > 1 for r in rows)
    assert chosen.parallel.ep == chosen.parallel.dp == 4 and chosen.parallel.pp == 1 and chosen.parallel.dp_shard == 1
    assert not any(r.layout.dp_shard > 1 for r in rows)


def test_auto_can_choose_expert_parallelism_under_fsdp2():
    """With FSDP2 allowed (blocks compiled one by one) and too little memory for anything else, auto
    chooses EP x FSDP2: the experts / ep whole, every other tensor sliced; check_ep accepts it."""
    from conftest import FAST, cfg_of

    from boost_compile.train.auto_layout import choose_layout
    from boost_compile.train.validate import check_ep, to_train_config

    moe = ("model=hf-tiny", "model.hf_config.model_type=qwen3_moe", "+model.hf_config.num_experts=64",
           "+model.hf_config.num_experts_per_tok=2", "+model.hf_config.moe_intermediate_size=128")
    tc = to_train_config(cfg_of(*FAST, "passes=boost_aot_eager", "parallel=auto", *moe, "trainer.batch=8",
                                "trainer.seq=64", "++passes.unit=block", "parallel.memory_gib=0.015"))
    chosen, rows = choose_layout(tc, world=4, per_node=4, device_type="cpu")
    assert [r.layout.ep > 1 and r.layout.dp_shard > 1 for r in rows if r.fits] == [True] * sum(r.fits for r in rows)
    par = chosen.parallel
    assert (par.tp, par.pp, par.zero, par.dp * par.dp_shard, par.ep) == (1, 1, 0, 4, 4) and par.dp_shard > 1
    check_ep(chosen)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-moe-dense"])
def test_the_reference_moe_presets_are_the_models_boost_train_builds(preset):
    """The planner's view of an MoE preset: the parameters of the model itself, and no TP above 1 for
    the low-rank one (boost-train refuses btp on its routers and experts)."""
    from boost_compile.models import Llama, LlamaConfig

    spec = from_preset(preset)
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset(preset))
    assert spec.moe and spec.num_params() == sum(p.numel() for p in model.parameters())
    tps = {lo.tp for lo in layouts(job(spec, 4, batch=16, seq=64))}
    assert tps == ({1} if preset == "tiny-moe" else {1, 2})  # tiny: 2 kv heads


def test_expert_replicas_are_averaged_when_ep_is_below_dp():
    """ep < dp: each rank's experts (n_experts / ep of them) all-reduced over the dp / ep groups that hold
    them, priced from the expert tensors; none when the groups span every data-parallel rank."""
    from boost_compile.plan.search import moe_of
    from boost_compile.plan.timing import expert_replicas_time

    spec = from_hf_config({"model_type": "qwen3_moe", **TINY["qwen3_moe"], "num_experts": 16, "hidden_size": 256})
    j = job(spec, 8, per_node=8, batch=16)
    ep8, ep2 = (moe_of(j, Layout(1, 1, 8, checkpoint="none", plan="megatron", ep=ep)) for ep in (8, 2))
    experts = sum(t.numel for t in spec.tensors() if t.role == "expert")
    assert ep2.expert_params == experts / 2 and ep8.expert_params == experts / 8
    from boost_compile.costmodel.scale_model import Workload

    hw, wl = j.hardware, Workload(seq=j.seq, batch=2)
    assert expert_replicas_time(ep8, 8, hw, wl) == 0
    inside = expert_replicas_time(ep2, 8, hw, wl)
    assert inside > 0 and price(j, Layout(1, 1, 8, checkpoint="none", plan="megatron", ep=2)).step_s > 0
    across = expert_replicas_time(moe_of(job(spec, 8, per_node=2, batch=16), Layout(1, 1, 8, checkpoint="none",
                                                                                 plan="megatron", ep=2)), 8, hw, wl)
    assert across > inside


def test_no_pipeline_layouts_for_what_boost_train_cannot_cut():
    """A Hugging Face model type the pipeline split does not know (every MoE type here), and the reference
    MoE with its balance loss, get no pp > 1 layout: boost-train would refuse the command printed."""
    from boost_compile.distributed.pipeline import HF_MODEL_TYPES

    moe = from_hf_config({"model_type": "qwen3_moe", **TINY["qwen3_moe"]})
    assert "qwen3_moe" not in HF_MODEL_TYPES and not moe.pipeline
    assert not [lo for lo in layouts(job(moe, 8, per_node=4, batch=16, seq=256)) if lo.pp > 1]
    balanced = from_preset("tiny-moe", router_aux_loss_coef=0.01)
    assert not balanced.pipeline and from_preset("tiny-moe").pipeline
    assert any(lo.pp > 1 for lo in layouts(job(from_preset("tiny-moe"), 4, batch=16, seq=64)))


def test_expert_parallel_pipeline_rows_under_ddp():
    """The reference MoE can be cut into stages: pp > 1 rows with ep dividing dp and the experts, ZeRO 0,
    no FSDP2; each stage's experts divided by ep (the stage's expert state falls as 1/ep)."""
    spec = from_preset("tiny-moe", n_experts=8)
    j = job(spec, 8, batch=16, seq=64)
    rows = [lo for lo in layouts(j) if lo.pp > 1 and lo.ep > 1]
    assert rows and {(lo.pp, lo.dp, lo.ep) for lo in rows} == {(2, 4, 2), (2, 4, 4)}  # pp <= its 2 blocks
    assert all(lo.zero == 0 and lo.dp_shard == 1 and lo.dp % lo.ep == 0 for lo in rows)
    base = Layout(1, 2, 4, 0, 4, "1f1b", "none", "btp")
    terms = [price(j, replace(base, ep=e)).terms_gib["params"] for e in (1, 2, 4)]
    # one stage holds one of tiny's 2 blocks: its experts are the stage's share the others lose
    experts = sum(t.numel for t in spec.tensors() if t.role == "expert") / 2 * 2**-30 * 4
    assert terms[0] - terms[1] == pytest.approx(experts / 2) and terms[0] - terms[2] == pytest.approx(experts * 3 / 4)
