"""The layout planner's FSDP2 and HSDP layouts: their memory terms, their collectives, the search and boost-plan.

The sizes are counted here from the model's widths (a CoLA block: seven factor pairs and two
gains), not read from the planner, and compared with what it predicts.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from boost_compile.costmodel import scale_model as sm
from boost_compile.costmodel.hardware import load_hardware
from boost_compile.plan import cli
from boost_compile.plan.memory import memory
from boost_compile.plan.model import from_preset, preset_args
from boost_compile.plan.search import SCHEDULES, Job, Layout, best, layouts, price, search
from boost_compile.plan.timing import step_time

GIB = 2**30
BASE = {"pp": 1, "zero": 0, "microbatches": 1, "schedule": "1f1b", "checkpoint": "none", "batch": 16, "seq": 512}


def cola_block(d: int, ff: int, r: int) -> int:
    """Elements of one CoLA block: q, k, v, o ([r, d] and [d, r] each), gate and up ([r, d], [ff, r]),
    down ([r, ff], [d, r]) and the two norms' gains."""
    return 4 * 2 * r * d + 2 * r * (d + ff) + r * (ff + d) + 2 * d


def cola_7b() -> tuple[int, int, int]:
    """cola-7b's (block, outside the blocks, total) elements: d 4096, d_ff 11008, r 1024, 32 layers, vocab 32000."""
    d, ff, r, layers, vocab = 4096, 11008, 1024, 32, 32000
    block = cola_block(d, ff, r)
    outside = 2 * vocab * d + d  # the embedding, the head and the final norm
    return block, outside, layers * block + outside


def mem(spec, **kw):
    return memory(spec, "btp", **{**BASE, "precision": "bf16-mixed", **kw})


# ----------------------------------------------------------------------------- memory


def test_fsdp2_holds_one_dp_shard_of_the_weights_gradients_and_optimizer():
    spec = from_preset("cola-7b")
    block, _, total = cola_7b()
    assert spec.num_params() == total
    ddp = mem(spec, tp=1, dp=8)
    fsdp = mem(spec, tp=1, dp=1, dp_shard=8)
    # every width divides by 8: each rank holds exactly an eighth, fp32 weights and moments
    assert fsdp.terms["params"] == fsdp.terms["grads"] == total // 8 * 4
    assert fsdp.terms["optimizer"] == 2 * total // 8 * 4
    for term in ("params", "grads", "optimizer"):
        assert fsdp.terms[term] * 8 == ddp.terms[term]
    assert ddp.terms["dp_buckets"] == total * 4 and fsdp.terms["dp_buckets"] == 0
    assert fsdp.terms["activations"] == ddp.terms["activations"]  # 8 data ranks either way
    assert {"fsdp_gathered", "fsdp_kept"} <= set(fsdp.live) and fsdp.peak == sum(fsdp.terms[t] for t in fsdp.live)


def test_hsdp_shards_within_a_replica_and_reads_a_share_of_the_batch():
    spec = from_preset("cola-7b")
    _, _, total = cola_7b()
    hsdp = mem(spec, tp=1, dp=2, dp_shard=4)
    assert hsdp.terms["params"] == hsdp.terms["grads"] == total // 4 * 4 and hsdp.terms["optimizer"] == 2 * total
    assert hsdp.terms["dp_buckets"] == 0  # the replicas all-reduce the reduce-scattered slices in place
    assert hsdp.terms["activations"] == mem(spec, tp=1, dp=1, dp_shard=8).terms["activations"]
    # under TP, FSDP2 cuts each rank's TP shard
    tp2 = mem(spec, tp=2, dp=1)
    assert mem(spec, tp=2, dp=1, dp_shard=4).terms["params"] == pytest.approx(tp2.terms["params"] / 4, abs=4 * len(spec.tensors()))


def test_the_gathered_blocks_are_the_largest_times_those_alive():
    spec = from_preset("cola-7b")
    block, _, _ = cola_7b()
    d, vocab, bf16 = 4096, 32000, 2  # bf16-mixed gathers bf16
    resharded = mem(spec, tp=1, dp=1, dp_shard=8)
    kept = mem(spec, tp=1, dp=1, dp_shard=8, reshard_after_forward=False)
    assert resharded.terms["fsdp_gathered"] == 2 * block * bf16  # the block computing and the one prefetched
    assert kept.terms["fsdp_gathered"] == 32 * block * bf16  # every block, from its forward to its backward
    assert resharded.terms["fsdp_kept"] == (vocab * d + d) * bf16  # the final norm and head stay gathered
    assert kept.terms["fsdp_kept"] == (2 * vocab * d + d) * bf16  # and the embedding
    fp32 = memory(spec, "btp", **{**BASE, "tp": 1, "dp": 1, "dp_shard": 8}, precision="fp32")
    assert fp32.terms["fsdp_gathered"] == 2 * block * 4
    tied = memory(from_preset("tiny", tie_embeddings=True), "btp", **{**BASE, "tp": 1, "dp": 1, "dp_shard": 2})
    assert tied.terms["fsdp_kept"] == (256 * 64 + 64) * 4  # the root: the tied embedding and the final norm


def test_accumulation_keeps_the_unsharded_gradients():
    spec = from_preset("cola-7b")
    _, _, total = cola_7b()
    acc = mem(spec, tp=1, dp=1, dp_shard=8, accumulating=True)
    assert acc.terms["fsdp_accum"] == total * 4  # fp32, reduce-scattered at the last micro-step only
    assert mem(spec, tp=1, dp=1, dp_shard=8).terms["fsdp_accum"] == 0


def test_the_reduce_scatter_input_is_not_live_with_the_block_being_recomputed():
    """A unit's gradients are reduce-scattered after its backward, when what it recomputed is freed:
    the backward's transient holds the larger of the two (the logits' gradient beside it either way)."""
    spec = from_preset("cola-60m")
    lowrank = mem(spec, tp=1, dp=1, dp_shard=2, checkpoint="lowrank")
    ddp_lowrank = mem(spec, tp=1, dp=2, checkpoint="lowrank")  # the logits' gradient and the recompute
    none = mem(spec, tp=1, dp=1, dp_shard=2)  # the logits' gradient and the largest unit's reduce-scatter input
    assert {lowrank.peak_at, ddp_lowrank.peak_at, none.peak_at} == {"backward"}
    assert lowrank.terms["temporary"] == max(ddp_lowrank.terms["temporary"], none.terms["temporary"])
    assert lowrank.terms["temporary"] < ddp_lowrank.terms["temporary"] + none.terms["temporary"]


PIPED = {"tp": 1, "dp": 1, "dp_shard": 4, "pp": 2, "microbatches": 2, "reshard_after_forward": False}


def test_a_pipeline_rank_under_fsdp2_holds_its_stages_units_gathered_with_their_gradients():
    """PipelineStage keeps each unit gathered and its gradients unsharded from its first backward on:
    at the backward a rank holds its stage's blocks, the embedding (first stage) or the norm and
    head (last), gathered in bf16, and their fp32 gradients; the sharded ones were freed at zero_grad."""
    spec = from_preset("cola-7b")
    block, _, _ = cola_7b()
    d, vocab, fp32, bf16 = 4096, 32000, 4, 2
    blocks = 16  # 32 blocks cut in two by parameters: the embedding weighs what the norm and head do
    stage = {0: blocks * block + vocab * d, 1: blocks * block + vocab * d + d}
    outside = {0: vocab * d, 1: vocab * d + d}
    for rank in (0, 1):
        m = mem(spec, **PIPED, pp_rank=rank)
        assert m.terms["params"] == m.terms["grads"] == stage[rank] // 4 * fp32  # every width divides by 4
        assert m.terms["optimizer"] == 2 * stage[rank] // 4 * fp32 and m.terms["dp_buckets"] == 0
        assert m.terms["fsdp_gathered"] == blocks * block * bf16
        assert m.terms["fsdp_kept"] == outside[rank] * bf16
        assert m.terms["fsdp_accum"] == stage[rank] * fp32
        assert m.peak_at == "backward" and "grads" not in m.live and {"fsdp_gathered", "fsdp_accum"} <= set(m.live)
        assert m.peak == sum(m.terms[t] for t in m.live)
        # the activations of the pipeline over 4 DDP replicas; the last stage's logits and their gradient
        # (fp32, 16 / 4 / 2 sequences of 512 tokens) the backward's only transient without checkpointing
        assert m.terms["activations"] == mem(spec, tp=1, dp=4, pp=2, microbatches=2, pp_rank=rank).terms["activations"]
        assert m.terms["temporary"] == (2 * 2 * 512 * vocab * fp32 if rank else 0)
        assert m.peak == (3 * stage[rank] // 4 * fp32 + m.terms["activations"] + m.terms["head"]
                          + m.terms["temporary"] + stage[rank] * (bf16 + fp32))
        # resharding after each forward: a backward starts with two blocks gathered (one micro-batch's
        # activations, 1024 tokens through 16 blocks, outweigh the 16 gathered blocks freed by its end)
        resharded = mem(spec, **{**PIPED, "reshard_after_forward": True}, pp_rank=rank)
        assert resharded.terms["fsdp_gathered"] == 2 * block * bf16
        assert m.peak - resharded.peak == (blocks - 2) * block * bf16


def test_resharded_stages_end_their_backward_with_every_block_gathered():
    """With few activations, the end of a backward (every block gathered again, one micro-batch freed)
    outweighs its start (two blocks gathered)."""
    spec = from_preset("cola-7b")
    block, _, _ = cola_7b()
    short = {**PIPED, "reshard_after_forward": True, "pp_rank": 0, "seq": 32, "checkpoint": "full"}
    m = mem(spec, **short)
    one_microbatch = m.terms["activations"] / m.in_flight  # in flight: the 2 micro-batches of 1F1B's first stage
    assert m.in_flight == 2 and one_microbatch < 14 * block * 2
    assert m.terms["fsdp_gathered"] == pytest.approx(16 * block * 2 - one_microbatch, abs=2)


def test_a_pipeline_stage_reduce_scatters_after_its_last_backward():
    """With next to no activations the step's end sets the peak: every unit still gathered, the
    sharded gradients being made and one unit's fp32 gradient copied for its reduce-scatter."""
    spec = from_preset("cola-7b")
    d, vocab = 4096, 32000
    m = mem(spec, **PIPED, pp_rank=0, batch=4, seq=8, checkpoint="full")
    assert m.peak_at == "reduce" and "activations" not in m.live and "grads" in m.live
    assert m.terms["temporary"] == vocab * d * 4  # the embedding, the rank's largest unit
    assert m.peak == sum(m.terms[t] for t in m.live)


# ----------------------------------------------------------------------------- time


def fsdp_time(hw, dp: int = 1, dp_shard: int = 2, **kw):
    spec = from_preset("cola-60m")
    wl = sm.Workload(seq=256, batch=8, dtype_bytes=2)
    return step_time(spec.scale_shape(), "btp", tp=1, pp=1, dp=dp, microbatches=1, schedule="1f1b", stages_per_rank=1,
                     checkpoint="none", zero=0, hw=hw, wl=wl, param_bytes=4, dp_shard=dp_shard, **kw)


def ring(payload: float, n: int, hw) -> float:
    """An all-gather or reduce-scatter of ``payload`` bytes over ``n`` ranks: each moves (n - 1) / n of it."""
    return hw.collective_latency + (n - 1) / n * payload / hw.allreduce_bus_bandwidth


def test_with_nothing_hidden_every_gather_and_reduce_scatter_is_paid():
    hw = replace(load_hardware("a100-80gb-nvlink"), dp_overlap=0.0)
    d, ff, r, layers, vocab = 512, 1376, 128, 8, 32000
    embed, block, head = vocab * d, cola_block(d, ff, r), vocab * d + d
    units = [embed] + [block] * layers + [head]
    copies = sm.elementwise_time(2 * 2 * (sum(units) + sum(units[:-1])) + (2 + 4) * sum(units), hw)
    gathers = sum(ring(2 * p, 2, hw) for p in units) + sum(ring(2 * p, 2, hw) for p in units[:-1])  # the head is kept
    reduces = sum(ring(4 * p, 2, hw) for p in units)
    t = fsdp_time(hw)
    assert t.fsdp_s == pytest.approx(gathers + reduces + copies)
    assert t.step_s == pytest.approx(t.base_s - t.prediction.dp_s - t.prediction.optimizer_s / 2 + t.fsdp_s)
    assert t.once_s == pytest.approx(t.prediction.optimizer_s / 2 + reduces + sm.elementwise_time(6 * sum(units), hw))
    kept = fsdp_time(hw, reshard_after_forward=False)
    assert t.fsdp_s - kept.fsdp_s == pytest.approx(sum(ring(2 * p, 2, hw) for p in units[:-1])
                                                   + sm.elementwise_time(4 * sum(units[:-1]), hw))
    # HSDP: each unit's reduce-scattered slice is all-reduced across the replicas
    hsdp = fsdp_time(hw, dp=2)
    slices = sum(hw.collective_latency + 2 * (2 - 1) / 2 * (4 * p / 2) / hw.allreduce_bus_bandwidth for p in units)
    assert hsdp.fsdp_s - t.fsdp_s == pytest.approx(slices)


def test_the_backward_hides_the_collectives_behind_the_blocks():
    gpu = load_hardware("a100-80gb-nvlink")
    hidden, exposed = fsdp_time(gpu), fsdp_time(replace(gpu, dp_overlap=0.0))
    assert 0 < hidden.fsdp_s < exposed.fsdp_s
    assert fsdp_time(gpu, shard_across_nodes=True).fsdp_s > hidden.fsdp_s  # the ring at the network's rate


def test_a_pipeline_stage_gathers_once_and_reduce_scatters_unhidden():
    """PP2 x FSDP2 2, 1F1B over 2 micro-batches: each unit of the busiest rank (its 4 blocks and the
    head, the larger of the embedding and the head) gathered once, reduce-scattered at the end."""
    hw = replace(load_hardware("a100-80gb-nvlink"), dp_overlap=0.0)
    d, ff, r, vocab = 512, 1376, 128, 32000
    units = [vocab * d + d] + [cola_block(d, ff, r)] * 4
    spec = from_preset("cola-60m")
    wl = sm.Workload(seq=256, batch=8, dtype_bytes=2)

    def piped(**kw):
        return step_time(spec.scale_shape(), "btp", tp=1, pp=2, microbatches=2, schedule="1f1b", stages_per_rank=1,
                         checkpoint="none", zero=0, hw=hw, wl=wl, param_bytes=4, **kw)

    gathers = sum(ring(2 * p, 2, hw) for p in units)
    reduces = sum(ring(4 * p, 2, hw) for p in units)
    copies = sm.elementwise_time(2 * 2 * sum(units), hw) + sm.elementwise_time(6 * sum(units), hw)
    t, ddp = piped(dp=1, dp_shard=2, reshard_after_forward=False), piped(dp=2)
    assert t.fsdp_s == pytest.approx(gathers + reduces + copies)
    assert t.step_s == pytest.approx(ddp.step_s - ddp.prediction.dp_s - ddp.overlap_s - ddp.prediction.optimizer_s / 2
                                     + t.fsdp_s)
    assert t.once_s == pytest.approx(ddp.prediction.optimizer_s / 2 + reduces + sm.elementwise_time(6 * sum(units), hw))
    # resharding after each forward: 2 m gathers (every forward, and the backward after it) instead of 1
    resharded = piped(dp=1, dp_shard=2, reshard_after_forward=True)
    assert resharded.fsdp_s - t.fsdp_s == pytest.approx(3 * (gathers + sm.elementwise_time(4 * sum(units), hw)))


# ----------------------------------------------------------------------------- the search


def job(name: str = "cola-60m", devices: int = 8, batch: int = 16, seq: int = 256, memory_gib: float = 70.0, **kw) -> Job:
    spec = from_preset(name, **kw.pop("overrides", {}))
    return Job(spec, batch, seq, devices, kw.pop("per_node", 8), load_hardware(kw.pop("hardware", "a100-80gb-nvlink")),
               memory_gib * GIB, kw.pop("precision", "fp32"), (f"model.preset={name}",))


def test_the_search_has_every_fsdp2_and_hsdp_factorization():
    j = job()
    found = list(layouts(j))
    sharded = [lo for lo in found if lo.dp_shard > 1 and lo.pp == 1]
    assert {(lo.tp, lo.dp, lo.dp_shard) for lo in sharded} == {
        (tp, 8 // tp // s, s) for tp in (1, 2, 4, 8) for s in (2, 4, 8) if 8 // tp % s == 0}
    assert all(lo.zero == 0 and lo.plan == "btp" for lo in sharded)  # vanilla: DTensor parameters
    assert {lo.reshard_after_forward for lo in sharded} == {True, False}
    piped = [lo for lo in found if lo.dp_shard > 1 and lo.pp > 1]
    assert {(lo.tp, lo.pp, lo.dp, lo.dp_shard) for lo in piped} == {
        (tp, pp, 8 // tp // pp // s, s) for tp in (1, 2, 4) for pp in (2, 4) for s in (2, 4) if 8 % (tp * pp * s) == 0}
    assert all(lo.zero == 0 and lo.plan == "btp" and not lo.reshard_after_forward for lo in piped)
    assert {lo.schedule for lo in piped} == set(SCHEDULES)
    assert [lo for lo in found if lo.dp_shard == 1] == list(layouts(j, fsdp=False))  # the others as before


def test_the_search_ranks_pipelines_under_fsdp2_with_commands_boost_train_accepts():
    from conftest import cfg_of

    from boost_compile.train.validate import validate

    j = job()
    rows = search(j)
    piped = [r for r in rows if r.layout.pp > 1 and r.layout.dp_shard > 1]
    assert piped and all(r.fits for r in piped)
    fitting = [r for r in rows if r.fits]
    assert fitting.index(piped[0]) < len(fitting) - len(piped)  # ranked among the others, not after them
    chosen = [next(r for r in piped if r.layout.schedule == schedule) for schedule in SCHEDULES]
    for row in [*chosen, next(r for r in piped if r.layout.dp > 1)]:  # each schedule, and HSDP
        args = row.command.split(" -m boost_compile.train ")[1].split()
        assert {f"parallel.pp={row.layout.pp}", f"parallel.dp={row.layout.dp}", f"parallel.dp_shard={row.layout.dp_shard}",
                "parallel.reshard_after_forward=false", f"parallel.pp_schedule={row.layout.schedule}"} <= set(args)
        validate(cfg_of(*args), world_size=8)


def test_a_cap_under_ddp_and_zero1_ranks_fsdp2_first():
    """One device per node (no TP) and a tied head (no pipeline): below what DDP and ZeRO-1 need at their
    smallest (one sequence per micro-step, full checkpointing), the first layout shards with FSDP2."""
    j = job(devices=4, batch=8, per_node=1, overrides={"tie_embeddings": True})

    def least(los: list[Layout]) -> float:  # the least memory of these layouts, with or without accumulation
        return min(price(j, replace(lo, local_batch=b)).memory_gib for lo in los for b in (None, 1))

    ddp = least(list(layouts(j, fsdp=False)))
    fsdp = least([lo for lo in layouts(j) if lo.dp_shard > 1])
    assert fsdp < ddp
    capped = replace(j, memory_bytes=(fsdp + ddp) / 2 * GIB)
    rows = search(capped)
    assert not any(r.fits for r in rows if r.layout.dp_shard == 1)
    first = best(rows, capped).layout
    assert first.dp_shard > 1 and "parallel.dp_shard=" in " ".join(first.overrides())


def test_a_layouts_label_and_overrides():
    lo = Layout(2, 1, 2, plan="btp", dp_shard=4, reshard_after_forward=False)
    assert lo.label() == "tp2 btp hsdp2x4 noreshard ckpt=none" and lo.data_ranks == 8
    assert Layout(1, 1, 1, dp_shard=8).label() == "tp1 fsdp8 ckpt=none"
    assert {"parallel.dp=2", "parallel.dp_shard=4", "parallel.zero=0", "parallel.reshard_after_forward=false"} <= set(lo.overrides())
    assert "parallel.dp_shard" not in " ".join(Layout(1, 1, 8).overrides())


def test_accumulation_under_fsdp2_reduces_once():
    j = job(devices=2, batch=8)
    whole, micro = price(j, Layout(1, 1, 1, dp_shard=2)), price(replace(j, batch=4), Layout(1, 1, 1, dp_shard=2))
    acc = price(j, Layout(1, 1, 1, dp_shard=2, local_batch=2))  # two micro-steps of 2 sequences per rank
    assert acc.command.endswith("trainer.local_batch=2") and acc.terms_gib["fsdp_accum"] > 0
    assert micro.step_s < acc.step_s < 2 * micro.step_s and acc.step_s > whole.step_s


# ----------------------------------------------------------------------------- boost-plan and the 13B preset


def test_boost_plan_shows_fsdp2_and_leaves_it_out_when_asked(tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = ["--model", "cola-1b", "--devices", "2", "--batch", "4", "--seq", "4096", "--hardware", "a100-80gb-nvlink"]
    assert cli.main([*args, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert any(r["dp_shard"] == 2 for r in rows) and " gathered | kept |" in text and "fsdp2" in text
    assert cli.main([*args, "--no-fsdp", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert all(r["dp_shard"] == 1 for r in json.loads(out.read_text())) and "gathered" not in text


def test_the_13b_preset_is_boosts_shape():
    spec = from_preset("cola-13b")
    d, ff, r, layers, vocab = 5120, 13824, 1280, 40, 32000
    assert (spec.dim, spec.n_layers, spec.n_heads, spec.ffn_dim, spec.rank_attn) == (d, layers, 40, ff, r)
    assert spec.num_params() == layers * cola_block(d, ff, r) + 2 * vocab * d + d
    args = preset_args("cola-13b")
    assert args[0] == "model.preset=cola-7b" and "+model.overrides.dim=5120" in args and "+model.overrides.rank_mlp=1280" in args
    assert from_preset("llama-13b").dense


# ----------------------------------------------------------------------------- parallel=auto


def test_auto_applies_an_fsdp2_layout_boost_train_accepts():
    from conftest import FAST, cfg_of

    from boost_compile.train.auto_layout import choose_layout, model_spec
    from boost_compile.train.validate import to_train_config, validate

    base = ("model=cola-60m", "+model.overrides.tie_embeddings=true", "trainer.batch=8", "trainer.seq=128")

    def config(*more: str):
        return to_train_config(cfg_of(*FAST, "passes=boost_aot_eager", "parallel=auto", *base, *more))

    tc = config()
    j = Job(model_spec(tc), 8, 128, 4, 1, load_hardware("cpu"), 1e12, tc.trainer.precision)
    ddp = min(price(j, replace(lo, local_batch=b)).memory_gib for lo in layouts(j, fsdp=False) for b in (None, 1))
    chosen, rows = choose_layout(config(f"parallel.memory_gib={ddp * 0.95}"), world=4, per_node=1, device_type="cpu")
    first = next(r for r in rows if r.fits).layout
    par = chosen.parallel
    assert first.dp_shard > 1 and (par.dp, par.dp_shard, par.zero) == (first.dp, first.dp_shard, 0)
    assert par.reshard_after_forward == first.reshard_after_forward
    validate(chosen, world_size=4)


def test_help_prints_the_options(capsys):
    """``boost-plan --help`` (a help string with a percent sign broke argparse's formatting once)."""
    from boost_compile.plan.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "--no-fsdp" in capsys.readouterr().out
