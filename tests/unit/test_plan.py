"""The layout planner: its model of the parameters, its memory terms, its search and its refusals.

The memory model's activation widths are checked against the partitioned graphs of
the reference model (what the compiled forward really saves); the states against
the models' own parameters. The figures at real layouts (TP, PP, DP, ZeRO on two
processes) are measured by ``boost-bench plan`` (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest
import torch

from boost_compile import _torch_compat as compat
from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig
from boost_compile.costmodel.hardware import load_hardware
from boost_compile.models import Llama, LlamaConfig
from boost_compile.passes.saved_tensors import activation_bytes
from boost_compile.plan import cli
from boost_compile.plan.memory import RNG_STATE_BYTES, block_saved_elements, in_flight, memory, zero_share
from boost_compile.plan.model import from_hf_config, from_llama_config, from_preset, local_numel, stage_blocks
from boost_compile.plan.search import Job, Layout, PlanError, best, layouts, price, search
from boost_compile.train.config import ModelConfig, ParallelConfig, PassesConfig, TrainConfig, TrainerConfig
from boost_compile.train.validate import validate

GIB = 2**30


def job(name: str = "cola-60m", devices: int = 4, batch: int = 8, seq: int = 256, memory_gib: float = 70.0, **kw) -> Job:
    spec = from_preset(name, vocab_size=kw.pop("vocab_size", 32000))
    return Job(spec, batch, seq, devices, kw.pop("per_node", 8), load_hardware(kw.pop("hardware", "a100-80gb-nvlink")),
               memory_gib * GIB, kw.pop("precision", "fp32"), (f"model.preset={name}",))


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("overrides", [
    {"preset": "tiny"}, {"preset": "tiny-dense"}, {"preset": "tiny-lowrank"}, {"preset": "tiny-lax"},
    {"preset": "tiny", "tie_embeddings": True}, {"preset": "tiny-dense", "bias": True, "norm": "layernorm"},
    {"preset": "cola-60m", "vocab_size": 256},
])
def test_the_spec_lists_the_models_parameters(overrides):
    """Every parameter tensor of the built model, by shape, and the same count."""
    cfg = LlamaConfig.preset(overrides.pop("preset"), **overrides)
    spec = from_llama_config("x", cfg)
    model = Llama(cfg)
    assert spec.num_params() == sum(p.numel() for p in model.parameters())
    assert sorted(t.shape for t in spec.tensors()) == sorted(tuple(p.shape) for p in model.parameters())


def test_a_hugging_face_config_gives_its_models_parameters():
    transformers = pytest.importorskip("transformers")
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 256, "tie_word_embeddings": False}
    spec = from_hf_config(config)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    assert spec.num_params() == model.num_parameters()
    assert spec.dense and spec.n_kv_heads == 2


def test_a_hugging_face_config_of_another_kind_is_refused():
    with pytest.raises(ValueError, match="model_type is 'gpt2'"):
        from_hf_config({"model_type": "gpt2", "n_embd": 64})


def test_sharding_splits_what_each_plan_splits():
    spec = from_preset("tiny")
    by_name = {t.name: t for t in spec.tensors()}
    gain, head = by_name["layers.0.attention_norm.weight"], by_name["head"]
    assert local_numel(gain, "btp", 2) == 32 and local_numel(gain, "vanilla", 2) == 64  # btp shards the stream
    assert local_numel(by_name["norm.weight"], "btp", 2) == 64  # after the all-gather: whole
    assert local_numel(head, "btp", 2) == 128 * 64 and local_numel(head, "btp", 2, vocab_parallel=False) == 256 * 64
    assert local_numel(by_name["embed"], "btp", 2) == 256 * 32 and local_numel(by_name["embed"], "megatron", 2) == 128 * 64


def test_stages_are_cut_as_the_pipeline_cuts_them():
    """A large vocabulary weighs on the first and last stage: fewer blocks there."""
    assert [len(r) for r in stage_blocks(from_preset("cola-60m", vocab_size=256), 2)] == [4, 4]
    assert [len(r) for r in stage_blocks(from_preset("cola-60m"), 4)] == [1, 3, 3, 1]


# ----------------------------------------------------------------------------- memory


def saved_per_token(preset: str, mode: str, inner: str) -> tuple[float, float]:
    """(measured, predicted) elements one block saves per token: the partitioned graph against the model."""
    torch._dynamo.reset()
    cfg = LlamaConfig.preset(preset)
    model, tokens = Llama(cfg), torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    rec = Recorder(keep_view=False)
    config = BoostConfig.from_options({"checkpoint": mode, "inner": inner})
    compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, recorder=rec), fullgraph=True)
    with compat.compile_settings(**compat.NO_COMPILE_CACHES):
        compiled(tokens)  # the joint graph is split when the forward compiles: no backward needed
    (graph,) = rec.graphs
    (report,) = graph.partition_reports
    per_block = activation_bytes(report)["layers.0"] - (RNG_STATE_BYTES if mode != "none" else 0)
    return per_block / (64 * 4), block_saved_elements(from_llama_config(preset, cfg), "btp", 1, mode)


@pytest.mark.parametrize(("preset", "mode", "inner"), [
    ("tiny", "lowrank", "aot_eager"), ("tiny", "full", "aot_eager"), ("tiny-dense", "lowrank", "aot_eager"),
    ("tiny-lowrank", "lowrank", "aot_eager"),
    # without checkpointing the inner compiler's partitioner decides: Inductor's min-cut
    pytest.param("tiny", "none", "inductor", marks=[pytest.mark.slow, pytest.mark.extended]),
])
def test_saved_activations_are_what_the_partitioned_graph_keeps(preset, mode, inner):
    measured, predicted = saved_per_token(preset, mode, inner)
    assert predicted == measured


def test_the_terms_live_at_the_peak_add_up_to_it():
    for kw in ({"tp": 1, "pp": 1, "dp": 1}, {"tp": 2, "pp": 1, "dp": 2, "zero": 1}, {"tp": 1, "pp": 2, "dp": 1, "microbatches": 4}):
        for ck in ("none", "lowrank", "full"):
            args = {"zero": 0, "microbatches": 1, "schedule": "1f1b", **kw}
            m = memory(from_preset("cola-60m"), "btp", checkpoint=ck, batch=8, seq=256, **args)
            assert m.peak == sum(m.terms[t] for t in m.live)
            assert {"params", "optimizer"} <= set(m.live)
            assert ("activations" in m.live) == (m.peak_at == "backward")


def test_memory_follows_the_layout():
    spec = from_preset("cola-60m")
    base = {"pp": 1, "zero": 0, "microbatches": 1, "schedule": "1f1b", "checkpoint": "none", "batch": 8, "seq": 256}
    one = memory(spec, "btp", tp=1, dp=1, **base)
    tp2 = memory(spec, "btp", tp=2, dp=1, **base)
    dp2 = memory(spec, "btp", tp=1, dp=2, **base)
    zero = memory(spec, "btp", tp=1, dp=2, **{**base, "zero": 1})
    assert tp2.terms["params"] < 0.55 * one.terms["params"]  # all but the final norm halved
    assert dp2.terms["params"] == one.terms["params"] and dp2.terms["dp_buckets"] == one.terms["grads"]
    assert dp2.terms["activations"] == pytest.approx(one.terms["activations"] / 2, rel=1e-6)  # half the batch each
    assert 0.5 <= zero.terms["optimizer"] / dp2.terms["optimizer"] < 0.6
    ckpt = {m: memory(spec, "btp", tp=1, dp=1, **{**base, "checkpoint": m}).terms["activations"] for m in ("none", "lowrank", "full")}
    assert ckpt["none"] > ckpt["lowrank"] > ckpt["full"]


def test_the_schedule_sets_the_micro_batches_in_flight():
    assert in_flight("gpipe", 4, 8) == 8
    assert [in_flight("1f1b", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 2) == 2
    assert in_flight("1f1b", 1, 8) == 1  # no pipeline: the rank's batch is one micro-batch
    assert in_flight("interleaved_1f1b", 2, 4, 0, 2) == 2.5  # 5 warm-up chunks of half a rank's blocks


def test_zero_gives_whole_tensors_to_the_emptiest_rank():
    assert zero_share([10, 4, 4, 2], 2) == 10
    assert zero_share([5, 5, 5, 5], 2) == 10
    assert zero_share([7], 4) == 7


# ----------------------------------------------------------------------------- the search


@pytest.mark.parametrize(("name", "devices", "per_node"), [("cola-60m", 4, 8), ("cola-60m", 8, 4), ("tiny", 4, 4), ("tiny-dense", 2, 2)])
def test_every_layout_is_one_boost_train_accepts(name, devices, per_node):
    j = replace(job(name, devices, batch=8, per_node=per_node), spec=from_preset(name))
    found = list(layouts(j))
    assert found
    spec = j.spec
    for lo in found:
        assert lo.tp * lo.pp * lo.dp * lo.dp_shard == devices and lo.tp <= per_node
        assert all(w % lo.tp == 0 for w in (spec.n_heads, spec.n_kv_heads, spec.dim, spec.ffn_dim))
        assert (j.batch // lo.data_ranks) % lo.microbatches == 0
        assert lo.plan in (("megatron",) if spec.dense else ("btp", "vanilla"))
        tc = TrainConfig(
            model=ModelConfig(preset=name), trainer=TrainerConfig(batch=j.batch, seq=64),
            parallel=ParallelConfig(tp=lo.tp, pp=lo.pp, dp=lo.dp, dp_shard=lo.dp_shard, zero=lo.zero, plan=lo.plan,
                                    reshard_after_forward=lo.reshard_after_forward,
                                    microbatches=lo.microbatches if lo.pp > 1 else None, pp_schedule=lo.schedule,
                                    stages_per_rank=lo.stages_per_rank),
            passes=PassesConfig(options={"inner": "inductor", "checkpoint": lo.checkpoint}),
        )
        validate(tc, world_size=devices)  # raises ConfigError for a layout boost-train refuses


def test_rows_are_ranked_fastest_first_among_those_that_fit():
    rows = search(job())
    fits = [r for r in rows if r.fits]
    assert fits and [r.step_s for r in fits] == sorted(r.step_s for r in fits)
    assert all(r.fits for r in rows[: len(fits)])


def test_lowrank_checkpointing_costs_its_recompute():
    rows = {r.layout: r for r in search(job(devices=1))}
    none, lowrank, full = (next(r for lo, r in rows.items() if lo.checkpoint == m) for m in ("none", "lowrank", "full"))
    assert none.step_s < lowrank.step_s < full.step_s
    assert none.memory_gib > lowrank.memory_gib > full.memory_gib


def test_a_memory_cap_moves_the_choice_to_a_layout_that_fits():
    free = search(job())
    fastest = best(free, job())
    cap = fastest.memory_gib * 0.7
    capped_job = replace(job(), memory_bytes=cap * GIB)
    chosen = best(search(capped_job), capped_job)
    assert chosen.layout != fastest.layout and chosen.memory_gib <= cap
    assert chosen.step_s >= fastest.step_s


def test_accumulation_prices_one_micro_steps_memory_and_the_optimizer_once():
    j = job(devices=1, batch=8)
    whole = price(j, Layout(1, 1, 1))
    quarter = price(j, Layout(1, 1, 1, local_batch=2))  # 4 micro-steps of 2
    assert quarter.terms_gib["activations"] == pytest.approx(whole.terms_gib["activations"] / 4, rel=1e-6)
    assert quarter.terms_gib["params"] == whole.terms_gib["params"]
    assert quarter.memory_gib < whole.memory_gib
    # the step: 4 steps of a batch of 2 less 3 optimizer updates: more than one of them, less than 4
    small = price(replace(j, batch=2), Layout(1, 1, 1))
    assert small.step_s < quarter.step_s < 4 * small.step_s and quarter.command.endswith("trainer.local_batch=2")


def test_a_memory_cap_is_met_by_gradient_accumulation_when_nothing_else_fits():
    """Below the memory of every layout that runs the whole batch at once (one device: the three
    checkpoint modes), the planner accumulates: the least accumulation (the largest local batch)
    that fits, one boost-train accepts."""
    j = job(devices=1, batch=16, seq=1024)
    plain = [price(j, lo) for lo in layouts(j)]
    cap = min(r.memory_gib for r in plain) * 0.9
    capped = replace(j, memory_bytes=cap * GIB)
    chosen = best(search(capped), capped)
    lo = chosen.layout
    assert lo.local_batch is not None and chosen.memory_gib <= cap
    share = 16
    assert share % lo.local_batch == 0 and lo.local_batch < share
    larger = [b for b in range(lo.local_batch + 1, share) if share % b == 0]
    assert all(not price(capped, replace(lo, local_batch=b)).fits for b in larger)
    tc = validate(auto_config("model=cola-60m", "trainer.batch=16", "trainer.seq=1024", "parallel.layout=manual",
                              *(o for o in lo.overrides() if not o.startswith("++"))), world_size=1)[0]
    assert tc.trainer.micro_steps(1) == share // lo.local_batch


def test_nothing_fits_is_refused_with_what_would():
    j = replace(job(), memory_bytes=0.001 * GIB)
    with pytest.raises(PlanError, match=r"no layout of cola-60m fits in 0.00 GiB per device .* needs [0-9.]+ GiB"):
        best(search(j), j)


# ----------------------------------------------------------------------------- boost-plan


def test_boost_plan_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = cli.main(["--model", "cola-60m", "--devices", "2", "--batch", "8", "--seq", "128", "--hardware", "cpu",
                     "--vocab-size", "256", "--json", str(out), "--top", "3"])
    assert code == 0
    text = capsys.readouterr().out
    assert text.count("\n| ") == 4  # the header and three rows
    rows = json.loads(out.read_text())
    keys = {"tp", "pp", "dp", "zero", "microbatches", "schedule", "checkpoint", "plan", "step_s", "memory_gib", "fits", "command"}
    assert keys <= set(rows[0]) and rows[0]["fits"]
    assert rows[0]["command"] in text
    assert rows[0]["command"].startswith("torchrun --nproc-per-node 2 -m boost_compile.train model=cola-60m")
    # under 1 GiB per device the table is in MiB: the cap and every row's memory stay readable
    assert cli.main(["--model", "cola-60m", "--devices", "2", "--batch", "8", "--seq", "128", "--hardware", "cpu",
                     "--vocab-size", "256", "--memory-gib", "0.5", "--json", str(out), "--top", "1"]) == 0
    text, row = capsys.readouterr().out, json.loads(out.read_text())[0]
    assert "512.0 MiB usable each" in text and "| memory (MiB) |" in text
    assert f"| {row['memory_gib'] * 1024:.2f} |" in text


def test_boost_plan_reads_a_model_config_and_a_hugging_face_config(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "intermediate_size": 176, "vocab_size": 256}))
    out = tmp_path / "rows.json"
    assert cli.main(["--model", str(config), "--devices", "2", "--batch", "4", "--seq", "64", "--hardware", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["plan"] for r in rows if r["tp"] == 2} == {"megatron"}  # a dense model
    assert all(f"model.hf_path={config}" in r["command"] for r in rows)
    group = tmp_path / "deep.yaml"  # a boost-train model group: a preset and its overrides
    group.write_text("preset: tiny-lax\noverrides:\n  n_layers: 4\n")
    assert cli.main(["--model", str(group), "--devices", "2", "--batch", "4", "--seq", "64", "--hardware", "cpu", "--json", str(out)]) == 0
    assert "x 4 layers" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert rows and all(r["pp"] == 1 for r in rows)  # LaX latents cannot cross pipeline stages
    assert all("model.preset=tiny-lax +model.overrides.n_layers=4 " in r["command"] for r in rows)


def test_boost_plan_refuses_when_nothing_fits(capsys):
    code = cli.main(["--model", "cola-60m", "--devices", "1", "--batch", "8", "--seq", "128", "--hardware", "cpu", "--memory-gib", "0.01"])
    assert code == 1
    assert "would fit with" in capsys.readouterr().err


# ----------------------------------------------------------------------------- boost-train parallel=auto


def auto_config(*overrides: str) -> TrainConfig:
    from conftest import FAST, cfg_of

    from boost_compile.train.validate import to_train_config

    return to_train_config(cfg_of(*FAST, "passes=boost_aot_eager", "parallel=auto", *overrides))


def test_auto_chooses_a_layout_boost_train_accepts(caplog):
    from boost_compile.train.auto_layout import choose_layout

    tc = auto_config("model=cola-60m", "trainer.batch=8", "trainer.seq=128")
    with caplog.at_level("INFO", logger="boost_compile.train"):
        chosen, rows = choose_layout(tc, world=2, per_node=2, device_type="cpu")
    par = chosen.parallel
    assert par.layout == "manual" and par.tp * par.pp * par.dp == 2
    first = next(r for r in rows if r.fits).layout
    assert (par.tp, par.pp, par.dp, par.zero) == (first.tp, first.pp, first.dp, first.zero)
    assert chosen.passes.options["checkpoint"] == first.checkpoint
    assert f"parallel=auto: chose {first.label()}" in caplog.text and "| 1 |" in caplog.text
    validate(chosen, world_size=2)


def test_auto_under_a_memory_cap_and_with_a_checkpoint_mode_given():
    from boost_compile.train.auto_layout import choose_layout

    base = ("model=cola-60m", "trainer.batch=8", "trainer.seq=128")
    free, rows = choose_layout(auto_config(*base), world=1, device_type="cpu")
    assert free.passes.options["checkpoint"] == "none"
    none_gib = next(r.memory_gib for r in rows if r.layout.checkpoint == "none")
    cap = f"parallel.memory_gib={none_gib * 0.8}"
    # with the local batch fixed at the whole batch (no accumulation), a checkpoint mode makes it fit
    capped, _ = choose_layout(auto_config(*base, cap, "trainer.local_batch=8"), world=1, device_type="cpu")
    assert capped.passes.options["checkpoint"] in ("lowrank", "full") and capped.trainer.local_batch == 8
    # free to accumulate, the planner takes whichever it predicts faster; either fits
    capped, rows = choose_layout(auto_config(*base, cap), world=1, device_type="cpu")
    assert capped.passes.options["checkpoint"] in ("lowrank", "full") or capped.trainer.local_batch < 8
    assert next(r for r in rows if r.fits).memory_gib <= none_gib * 0.8
    given, rows = choose_layout(auto_config(*base, "++passes.options.checkpoint=full"), world=1, device_type="cpu")
    assert given.passes.options["checkpoint"] == "full" and {r.layout.checkpoint for r in rows} == {"full"}


def test_auto_that_fits_nothing_stops_with_the_reason():
    from boost_compile.config import ConfigError
    from boost_compile.train.auto_layout import choose_layout

    with pytest.raises(ConfigError, match="parallel=auto: no layout of cola-60m fits in 0.01 GiB"):
        choose_layout(auto_config("model=cola-60m", "parallel.memory_gib=0.01"), world=2, device_type="cpu")


def test_auto_plans_with_the_tokenizers_vocabulary():
    from boost_compile.train.auto_layout import model_spec

    assert model_spec(auto_config("model=cola-60m")).vocab_size == 256  # bytes
    assert model_spec(auto_config("model=cola-60m", "data.tokenizer=bpe:1000")).vocab_size == 1024
    assert model_spec(auto_config("model=cola-60m", "+model.overrides.vocab_size=512")).vocab_size == 512


def test_boost_train_runs_with_parallel_auto(tmp_path, caplog):
    from conftest import FAST, cfg_of

    from boost_compile.train import run

    with caplog.at_level("INFO", logger="boost_compile.train"):
        result = run(cfg_of(*FAST, "parallel=auto", "passes=boost_aot_eager", "trainer.steps=2"), tmp_path)
    assert result["status"] == "completed" and result["steps"] == 2
    assert "parallel=auto: chose tp1 dp1 ckpt=" in caplog.text


# ----------------------------------------------------------------------------- published settings and clusters


def test_the_planner_on_the_published_settings():
    from boost_compile.plan.published import cluster_choice, published_choices

    choices = {c.model: c for c in published_choices()}
    assert set(choices) == {"cola-1B", "cola-3B", "cola-7B", "cola-13B"}
    assert choices["cola-1B"].chosen.layout == choices["cola-1B"].published_layout  # one GPU: one layout
    for c in choices.values():
        assert c.chosen.fits and c.chosen.step_s <= c.published_row.step_s
        assert c.chosen.layout.tp * c.chosen.layout.pp * c.chosen.layout.data_ranks == c.devices
    big = cluster_choice()
    assert big.chosen.fits and big.chosen.layout.tp <= 8 and big.layouts > 100


def test_a_data_parallel_ring_across_nodes_runs_at_the_network_rate():
    def step(devices: int, layout: tuple[int, int, int], network: float) -> float:
        j = job("cola-60m", devices=devices, batch=16, per_node=8)
        j = replace(j, hardware=replace(j.hardware, internode_bus_bandwidth=network))
        rows = search(j, checkpoints=("none",))
        return next(r.step_s for r in rows if (r.layout.tp, r.layout.pp, r.layout.dp, r.layout.zero) == (*layout, 0))

    slow, fast = 20e9, 200e9
    assert step(16, (1, 1, 16), slow) > step(16, (1, 1, 16), fast)  # the ring spans both nodes
    assert step(8, (1, 1, 8), slow) == step(8, (1, 1, 8), fast)  # one node: the network is not used


def test_zero1_pays_the_first_broadcast_in_step_and_the_others_queued():
    # ZeroRedundancyOptimizer issues one broadcast per parameter tensor, all asynchronously, and
    # waits for them together: the first meets the other rank, the rest queue behind it
    j = job("cola-60m", devices=2, batch=4, seq=1024)
    tensors = len(j.spec.tensors())

    def zero_cost(**hw) -> float:
        jj = replace(j, hardware=replace(j.hardware, **hw))
        return price(jj, Layout(1, 1, 2, zero=1)).step_s - price(jj, Layout(1, 1, 2)).step_s

    base = zero_cost(collective_latency=1e-3, queued_collective_latency=1e-4)
    assert zero_cost(collective_latency=2e-3, queued_collective_latency=1e-4) - base == pytest.approx(1e-3)
    assert zero_cost(collective_latency=1e-3, queued_collective_latency=2e-4) - base == pytest.approx((tensors - 1) * 1e-4)
    # a file without the queued latency (the GPU ones) prices every broadcast at collective_latency
    assert zero_cost(collective_latency=1e-3, queued_collective_latency=0.0) - base == pytest.approx((tensors - 1) * 9e-4)


def test_dp_overlap_hides_all_but_the_bottom_blocks_reduction():
    """Per block (pp1, with or without TP), the hardware's dp_overlap share of the all-reduce is
    hidden, never the bottom block's bucket; pipeline stages hide at most their last micro-batch's
    backward (one of m + pp - 1 slots); the CPU file none."""
    from boost_compile.plan.timing import step_time

    j = job(devices=2)
    shape, layers = j.spec.scale_shape(), j.spec.n_layers
    from boost_compile.costmodel import scale_model as sm

    def timed(hw, tp=1, pp=1, dp=2):
        wl = sm.Workload(seq=j.seq, batch=j.batch, dtype_bytes=4)
        return step_time(shape, "btp", tp=tp, pp=pp, dp=dp, microbatches=2 if pp > 1 else 1, schedule="1f1b",
                         stages_per_rank=1, checkpoint="none", zero=0, hw=hw, wl=wl, param_bytes=4)

    gpu = j.hardware
    assert gpu.dp_overlap == 1.0
    t = timed(gpu)
    assert t.overlap_s < 0
    assert -t.overlap_s <= t.prediction.dp_s * (layers - 1) / layers + 1e-12
    assert t.step_s == pytest.approx(t.base_s + t.overlap_s)
    half = timed(replace(gpu, dp_overlap=0.5))
    assert half.overlap_s == pytest.approx(t.overlap_s / 2)
    assert timed(gpu, tp=2, dp=1).overlap_s == 0.0  # nothing to reduce
    tp2 = timed(gpu, tp=2, dp=2)
    assert tp2.overlap_s < 0 and -tp2.overlap_s <= tp2.prediction.dp_s * (layers - 1) / layers + 1e-12
    pp2 = timed(gpu, pp=2)
    stage_layers = max(sm.stage_layers(layers, 2))
    compute = pp2.prediction.gemm_s + pp2.prediction.attention_s + pp2.prediction.elementwise_s
    slot = 2 / 3 * compute / (2 + 2 - 1) * (stage_layers - 1) / stage_layers  # m=2, pp=2: 3 slots
    assert pp2.overlap_s == pytest.approx(-min(slot, pp2.prediction.dp_s * (stage_layers - 1) / stage_layers))
    assert 0 < -pp2.overlap_s < -t.overlap_s
    assert timed(load_hardware("cpu")).overlap_s == 0.0


def test_cold_compile_per_rank():
    from boost_compile.plan.timing import cold_compile

    cpu = load_hardware("cpu")
    # per block (boost-train's default, tp and pp included): flat in depth
    assert cold_compile(2, 1, 1, cpu) == cold_compile(32, 1, 1, cpu) == cold_compile(32, 2, 2, cpu) == cpu.cold_compile_s
    # the whole model: each layer of a stage beyond two adds its share
    assert cold_compile(32, 2, 1, cpu, "model") == pytest.approx(cpu.cold_compile_s + 30 * cpu.cold_compile_per_layer_s)
    assert cold_compile(32, 2, 2, cpu, "model") == pytest.approx(cpu.cold_compile_s + 14 * cpu.cold_compile_per_layer_s)
    assert cold_compile(32, 1, 1, load_hardware("h200")) is None


def test_boost_plan_prints_the_startup_line(capsys):
    assert cli.main(["--model", "cola-60m", "--devices", "2", "--batch", "8", "--seq", "128", "--hardware", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "Startup of the first choice, the cold compile (empty Inductor cache): about 22 s per rank" in text
    assert cli.main(["--model", "cola-1b", "--devices", "2", "--batch", "4", "--seq", "4096",
                     "--hardware", "a100-80gb-nvlink", "--no-fsdp"]) == 0  # DDP's line: FSDP2 ties it here
    text = capsys.readouterr().out
    assert "| 1 | tp1 dp2 ckpt=none |" in text and "not measured for a100-80gb-nvlink" in text
    assert "Its data-parallel all-reduce hidden behind the backward: 0.0" in text


# ----------------------------------------------------------------------------- boost-bench plan's arithmetic


def test_kendall_tau():
    from boost_compile.bench.plan import kendall_tau

    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)  # one of three pairs swapped


def test_term_errors_take_the_worst_pipeline_rank():
    from boost_compile.bench.plan import _errors

    zero = {"grads": 0, "optimizer": 0, "dp_buckets": 0, "saved_activations": 0}
    pred = {"ranks": [{**zero, "params": 100, "peak": 200}, {**zero, "params": 100, "peak": 300}]}
    meas = {"ranks": [{**zero, "params": 100, "peak": 250}, {**zero, "params": 80, "peak": 300}]}
    errors = _errors(pred, meas)
    assert errors["params"] == pytest.approx(0.25) and errors["peak"] == pytest.approx(0.2)
    assert errors["dp_buckets"] == 0.0  # 0 bytes predicted and measured


def test_a_checkpointed_ddp_step_compiles_one_graph():
    """Dynamo's bucket cuts would hide blocks from the checkpoint pass (boost-bench plan measured
    a DDP lowrank step saving 1.5x what one graph saves); none keeps the cuts and their overlap."""
    from boost_compile.train.parallel import ddp_compile_settings

    def tc(checkpoint: str | None, backend: str = "boost") -> TrainConfig:
        options = {"checkpoint": checkpoint} if checkpoint else {}
        return TrainConfig(passes=PassesConfig(backend=backend, options=options))

    assert ddp_compile_settings(tc("lowrank"), 2) == {"optimize_ddp": False}
    assert ddp_compile_settings(tc("full"), 4) == {"optimize_ddp": False}
    assert ddp_compile_settings(tc("lowrank"), 1) == {}
    assert ddp_compile_settings(tc("none"), 2) == {} and ddp_compile_settings(tc(None), 2) == {}


def test_auto_on_a_hugging_face_model_and_a_refusal_for_one_it_cannot_price():
    from boost_compile.config import ConfigError
    from boost_compile.train.auto_layout import choose_layout

    chosen, rows = choose_layout(auto_config("model=hf-tiny"), world=2, device_type="cpu")
    assert {r.layout.plan for r in rows if r.layout.tp == 2} == {"megatron"}  # a dense Llama
    validate(chosen, world_size=2)
    tc = auto_config("model=hf-tiny")
    gpt2 = replace(tc, model=replace(tc.model, hf_config={"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "vocab_size": 256}))
    with pytest.raises(ConfigError, match="parallel=auto: the planner models Llama-like blocks .* model_type is 'gpt2'; give the layout"):
        choose_layout(gpt2, world=2, device_type="cpu")
