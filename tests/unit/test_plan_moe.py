"""The layout planner on mixtures of experts: parameters, expert-parallel layouts, memory and time.

Cheap: no processes, no compile; the Hugging Face models are built on the meta device."""

from __future__ import annotations

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
    ep_rows = [lo for lo in every if lo.ep > 1]
    # ep divides dp and the 4 experts: tp1 dp8 ep2/4, tp2 dp4 ep2/4; tp4 cannot split the 2 kv-heads
    assert {(lo.tp, lo.dp, lo.ep) for lo in ep_rows} == {(1, 8, 2), (1, 8, 4), (2, 4, 2), (2, 4, 4)}
    for lo in ep_rows:
        assert lo.dp % lo.ep == 0 and lo.pp == 1 and lo.dp_shard == 1 and lo.zero == 0 and spec.n_experts % lo.ep == 0
        assert f"parallel.ep={lo.ep}" in lo.overrides() and f"ep{lo.ep}" in lo.label()


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
    # the first choice shards the experts with their blocks (FSDP2 / HSDP); the fastest EP layout
    # loses to it mostly by its all-to-alls, which cross the nodes' 45 GB/s links
    assert first.layout.dp_shard > 1 and first.layout.ep == 1
    fastest_ep = ep_rows[0]
    assert fastest_ep.step_s > first.step_s and fastest_ep.a2a_s > 0.4 * fastest_ep.step_s


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
