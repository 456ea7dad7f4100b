"""The analytic scale model (boost-bench scale): each formula against hand-computed cases."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import json

import pytest

from boost_compile.bench import scale
from boost_compile.costmodel import hardware, scale_model
from boost_compile.costmodel.formulas import PAPER_SHAPES, bytes_per_layer
from boost_compile.costmodel.scale_model import Gemm, Shape, Workload

#: made-up hardware with round numbers
TOY_HW = hardware.Hardware(
    name="toy",
    peak_flops=1e12,
    hbm_bandwidth=1e11,
    nvlink_bandwidth=2e10,
    allreduce_bus_bandwidth=1e10,
    p2p_bandwidth=5e9,
    collective_latency=1e-5,
    gemm_max_efficiency=0.8,
    gemm_half_intensity=10.0,
    gemm_tile=16,
    attention_efficiency=0.5,
    attention_head_dim_multiple=32,
    elementwise_efficiency=0.5,
)
#: d 64, d_ff 128, 4 layers, 4 heads of 16, vocab 100; CoLA rank 16
TOY = Shape("toy", d=64, d_ff=128, layers=4, heads=4, vocab=100)


# ----------------------------------------------------------------------------- FLOPs and efficiency


def test_flops_by_hand():
    assert scale_model.linear_flops(10, 64, 32) == 2 * 10 * 64 * 32 == 40960
    # 4 b s^2 w, half of it under the causal mask
    assert scale_model.attention_flops(2, 8, 16, 0.5) == 4 * 2 * 8 * 8 * 16 / 2 == 4096
    assert scale_model.attention_flops(2, 8, 16, 1.0) == 8192


def test_gemm_efficiency_by_hand():
    # [64, 32] x [32, 16], bf16: 2*64*32*16 FLOPs over 2*(64*32 + 32*16 + 64*16) bytes
    intensity = (2 * 64 * 32 * 16) / (2 * (64 * 32 + 32 * 16 + 64 * 16))
    assert intensity == pytest.approx(32768 / 3584)
    assert scale_model.gemm_intensity(64, 32, 16) == pytest.approx(intensity)
    assert scale_model.gemm_efficiency(64, 32, 16, TOY_HW) == pytest.approx(
        0.8 * intensity / (intensity + 10)
    )
    # n = 24 fills one and a half 16-tiles: 24 of 32 columns are useful
    intensity = (64 * 32 * 24) / (64 * 32 + 32 * 24 + 64 * 24)
    assert scale_model.gemm_efficiency(64, 32, 24, TOY_HW) == pytest.approx(
        0.8 * intensity / (intensity + 10) * 24 / 32
    )
    # time = FLOPs / (peak * efficiency)
    eff = scale_model.gemm_efficiency(64, 32, 16, TOY_HW)
    assert scale_model.gemm_time(64, 32, 16, TOY_HW) == pytest.approx(2 * 64 * 32 * 16 / (1e12 * eff))


def test_tile_fill():
    assert scale_model.tile_fill(128, 64) == 1.0
    assert scale_model.tile_fill(800, 64) == 800 / 832
    assert scale_model.tile_fill(400, 128) == 400 / 512


def test_gemm_efficiency_monotone_and_capped():
    sizes = [16 * 2**i for i in range(12)]  # whole tiles, 16 .. 32768
    for fixed in (16, 256, 4096):
        for vary in range(3):
            effs = []
            for size in sizes:
                dims = [fixed, fixed, fixed]
                dims[vary] = size
                effs.append(scale_model.gemm_efficiency(*dims, TOY_HW))
            assert all(a < b for a, b in zip(effs[:-1], effs[1:], strict=True)), (fixed, vary)
            assert all(0 < e < TOY_HW.gemm_max_efficiency for e in effs)
    big = 2**20
    assert scale_model.gemm_efficiency(big, big, big, TOY_HW) == pytest.approx(0.8, rel=1e-3)


def test_attention_time_pads_the_head_dim():
    # 1e12 FLOPs at half of 1e12 FLOP/s: 2 s; head dim 100 runs the 128 kernel: x 128/100
    assert scale_model.attention_time(1e12, 64, TOY_HW) == pytest.approx(2.0)
    assert scale_model.attention_time(1e12, 100, TOY_HW) == pytest.approx(2.0 * 128 / 100)


def test_elementwise_time():
    # 1 GB through 1e11 B/s at half efficiency
    assert scale_model.elementwise_time(1e9, TOY_HW) == pytest.approx(1e9 / (1e11 * 0.5)) == 0.02


# ----------------------------------------------------------------------------- collectives


def test_allreduce_alpha_beta_by_hand():
    # 3 collectives, 1 GB in all, ring of 4 at 10 GB/s: 3 * 10 us + 2 * 3/4 * 1e9 / 1e10
    assert scale_model.allreduce_time(3, 1e9, 4, TOY_HW) == pytest.approx(3e-5 + 0.15)
    assert scale_model.allreduce_time(1, 1e9, 2, TOY_HW) == pytest.approx(1e-5 + 0.1)
    assert scale_model.allgather_time(1, 1e9, 4, TOY_HW) == pytest.approx(1e-5 + 0.075)
    assert scale_model.allreduce_time(3, 1e9, 1, TOY_HW) == 0.0
    assert scale_model.allgather_time(3, 1e9, 1, TOY_HW) == 0.0


@pytest.mark.parametrize("tokens", [10, 16384])
def test_forward_payload_equals_formulas_bytes_per_layer(tokens):
    for name, d, d_ff, layers, heads in [*PAPER_SHAPES, ("toy", 64, 128, 4, 4)]:
        shape = Shape(name, d, d_ff, layers, heads)
        ref = bytes_per_layer(tokens, d, d_ff, d // 4)
        got = {s: scale_model.layer_collectives(s, shape, tokens) for s in scale_model.SYSTEMS}
        assert got["full-rank"].fwd_bytes == ref.full_rank
        assert got["vanilla"].fwd_bytes == ref.vanilla
        assert got["btp"].fwd_bytes == ref.btp
        assert got["full-rank"].bwd_bytes == ref.full_rank
        assert got["btp"].bwd_bytes == ref.btp
        assert (got["full-rank"].fwd_count, got["vanilla"].fwd_count, got["btp"].fwd_count) == (
            2,
            7,
            4,
        )


def test_vanilla_backward_payload_by_hand():
    c = scale_model.layer_collectives("vanilla", TOY, 10)
    assert (
        c.fwd_bytes == 10 * (5 * 64 + 2 * 128) * 2 == 11520
    )  # outputs: q k v o down [T, d], gate up [T, d_ff]
    assert (
        c.bwd_bytes == 10 * (6 * 64 + 128) * 2 == 10240
    )  # inputs: q k v o gate up [T, d], down [T, d_ff]


def test_no_communication_without_tp():
    for shape in (*scale_model.SHAPES, TOY):
        for system in scale_model.SYSTEMS:
            pred = scale_model.predict(shape, system, tp=1, hw=TOY_HW)
            assert pred.comm_s == pred.comm_gb == pred.ring_gb_per_rank == pred.collectives == 0
            layer = scale_model.layer_cost(system, shape, 1, 8, 1, TOY_HW, Workload())
            assert layer.comm_s == layer.comm_bytes == layer.collectives == 0


def test_layer_comm_time_by_hand():
    # btp, p = 2, 10 tokens: 4 all-reduces of 7 * 10 * 16 * 2 B in all, each direction
    cost = scale_model.layer_cost("btp", TOY, 1, 10, 2, TOY_HW, Workload())
    per_direction = 4 * 1e-5 + 2 * (1 / 2) * (7 * 10 * 16 * 2) / 1e10
    assert cost.comm_s == pytest.approx(2 * per_direction)
    assert cost.collectives == 8 and cost.comm_bytes == 2 * 2240


# ----------------------------------------------------------------------------- per-rank work


def test_layer_gemms_by_hand():
    # toy at p = 2: 2 local heads (32 wide), d_ff slice 64, rank 16 (vanilla: 8 per rank)
    assert scale_model.layer_gemms("full-rank", TOY, 10, 2) == [
        Gemm(10, 64, 96),  # fused q/k/v, local heads
        Gemm(10, 32, 64),  # o, row-parallel
        Gemm(10, 64, 128),  # fused gate/up, d_ff slice
        Gemm(10, 64, 64),  # down, row-parallel
    ]
    vanilla = scale_model.layer_gemms("vanilla", TOY, 10, 2)
    assert vanilla[:2] == [Gemm(10, 64, 8), Gemm(10, 8, 64)]  # q: A on r/p, B back to full d
    assert vanilla[-2:] == [Gemm(10, 128, 8), Gemm(10, 8, 64)]  # down: from d_ff
    assert len(vanilla) == 14
    btp = scale_model.layer_gemms("btp", TOY, 10, 2)
    assert btp[0] == Gemm(10, 32, 48)  # grouped q/k/v down factors: d/p in, 3r out
    assert btp[1:4] == [Gemm(10, 16, 32)] * 3  # q/k/v up factors: local heads
    assert btp[6] == Gemm(10, 32, 32)  # grouped gate/up down factors
    assert btp[9] == Gemm(10, 64, 16)  # down's down factor: d_ff slice in
    assert len(btp) == 11

    def total(gemms):
        return sum(scale_model.linear_flops(g.m, g.k, g.n) for g in gemms)

    # every system divides the GEMM work of its model by p
    assert (
        total(scale_model.layer_gemms("full-rank", TOY, 10, 2))
        == 2 * 10 * (4 * 64 * 64 + 3 * 64 * 128) / 2
    )
    lowrank = 2 * 10 * 16 * (4 * (64 + 64) + 3 * (64 + 128)) / 2
    assert total(vanilla) == total(btp) == lowrank == 174080


def test_attention_heads():
    assert scale_model.attention_heads("vanilla", TOY, 4) == 4  # duplicated on every rank
    assert scale_model.attention_heads("btp", TOY, 4) == scale_model.attention_heads("full-rank", TOY, 4) == 1
    assert scale_model.attention_heads("btp", Shape("30B", 6656, 17920, 60, 52), 8) == 7  # ceil(52 / 8)


def test_layer_elementwise_bytes_by_hand():
    # passes fwd+bwd: rmsnorm 5, residual 6, rope 4, swiglu 8, silu 5, rms_rescale 5, grad_sum 3, concat 2
    tokens, e = 10, 2
    full = (2 * 64 * 5 + 2 * 64 * 6 + 2 * 32 * 4 + 64 * 8) * tokens * e
    vanilla = (2 * 64 * 5 + 2 * 64 * 6 + 2 * 64 * 4 + 128 * 8 + 7 * 8 * 5 + 3 * 64 * 3) * tokens * e
    btp = (
        (2 * 32 * 5 + 2 * 32 * 6 + 2 * 32 * 4 + 64 * 8 + 7 * 16 * 5 + 5 * 16 * 5 + 5 * 16 * 2)
        * tokens
        * e
    )
    assert scale_model.layer_elementwise_bytes("full-rank", TOY, tokens, 2) == full == 43520
    assert scale_model.layer_elementwise_bytes("vanilla", TOY, tokens, 2) == vanilla == 76000
    assert scale_model.layer_elementwise_bytes("btp", TOY, tokens, 2) == btp == 51840
    # no TP: no online-RMSNorm rescale
    btp1 = (2 * 64 * 5 + 2 * 64 * 6 + 2 * 64 * 4 + 128 * 8 + 7 * 16 * 5 + 5 * 16 * 2) * tokens * e
    assert scale_model.layer_elementwise_bytes("btp", TOY, tokens, 1) == btp1


def test_layer_params_by_hand():
    assert (
        scale_model.layer_params("full-rank", TOY, 2)
        == (4 * 64 * 64 + 3 * 64 * 128) / 2 + 2 * 64
        == 20608
    )
    factors = 16 * (4 * (64 + 64) + 3 * (64 + 128)) / 2
    assert scale_model.layer_params("vanilla", TOY, 2) == factors + 2 * 64 == 8832  # norms replicated
    assert scale_model.layer_params("btp", TOY, 2) == factors + 2 * 64 / 2 == 8768  # norms d-sharded


# ----------------------------------------------------------------------------- assembly and pipeline


def test_iteration_is_the_sum_of_its_parts():
    wl = Workload(seq=8, batch=2)
    for system in scale_model.SYSTEMS:
        pred = scale_model.predict(TOY, system, 2, 1, TOY_HW, wl)
        parts = pred.gemm_s + pred.attention_s + pred.elementwise_s + pred.comm_s + pred.optimizer_s
        assert pred.iteration_s == pytest.approx(parts)
        layer = scale_model.layer_cost(system, TOY, 2, 8, 2, TOY_HW, wl)
        head = scale_model.head_cost(system, TOY, 16, 2, TOY_HW, wl)
        assert pred.comm_s == pytest.approx(4 * layer.comm_s + head.comm_s)
        assert pred.comm_gb == pytest.approx((4 * layer.comm_bytes + 2 * 16 * 64 * 2) / 1e9)


def test_pipeline_one_micro_batch_runs_the_stages_in_turn():
    wl = Workload(seq=8, batch=2)
    for system in scale_model.SYSTEMS:
        one = scale_model.predict(TOY, system, 2, 1, TOY_HW, wl)
        two = scale_model.predict(TOY, system, 2, 2, TOY_HW, wl)
        # one activation down, one gradient up: [16, 64] bf16, or at TP 2 btp's d-slice [16, 32]
        width = 32 if system == "btp" else 64
        p2p = 2 * 1 * (2 * 8 * width * 2) / 5e9
        assert two.p2p_s == pytest.approx(p2p)
        assert two.iteration_s - two.optimizer_s - p2p == pytest.approx(
            one.iteration_s - one.optimizer_s
        )


def test_pipeline_1f1b_with_micro_batches():
    wl = Workload(seq=8, batch=4, micro_batches=2)
    layer = scale_model.layer_cost("btp", TOY, 2, 8, 2, TOY_HW, wl)  # micro-batch of 2 sequences
    head = scale_model.head_cost("btp", TOY, 16, 2, TOY_HW, wl)
    stages = [2 * layer.total_s, 2 * layer.total_s + head.total_s]  # 4 layers over 2 stages
    p2p = 2 * 1 * 16 * 32 * 2 / 5e9  # btp at TP 2 sends [16, d/2]
    pred = scale_model.predict(TOY, "btp", 2, 2, TOY_HW, wl)
    # t = sum_i t_i + (m - 1) max_i t_i + 2 (pp - 1) t_p2p + t_opt
    assert pred.iteration_s == pytest.approx(sum(stages) + 1 * max(stages) + p2p + pred.optimizer_s)
    assert pred.bubble_s == pytest.approx(stages[0] + p2p)  # the last stage waits for the first
    assert pred.micro_batches == 2
    # without a pipeline the batch is one micro-batch
    assert scale_model.predict(TOY, "btp", 2, 1, TOY_HW, wl).micro_batches == 1


def test_stage_layers():
    assert scale_model.stage_layers(40, 2) == [20, 20]
    assert scale_model.stage_layers(26, 4) == [7, 7, 6, 6]


# ----------------------------------------------------------------------------- head modes


def _replicated_minus_vocab_parallel(system, shape, tokens, p, hw):
    """Iteration-time difference, replicated head minus vocab-parallel head, from the docstring's
    equations (PP 1, bf16): the lm_head GEMM on V instead of V/p (fwd + 2 x fwd bwd), the fp32
    cross-entropy (28 B per logit) on V instead of V/p, the [T, d] collectives the replicated head
    drops, and AdamW (28 B per parameter) over the extra head (and, for full and vanilla, embedding)
    rows of the vocabulary."""
    v, d = shape.vocab, shape.d
    vl = -(-v // p)
    gemm = 3 * (scale_model.gemm_time(tokens, d, v, hw) - scale_model.gemm_time(tokens, d, vl, hw))
    loss = scale_model.elementwise_time(28 * tokens * (v - vl), hw)
    payload = tokens * d * 2
    alpha, busbw = hw.collective_latency, hw.allreduce_bus_bandwidth
    # btp, vocab-parallel: all-gather + reduce-scatter; replicated: the all-gather only
    if system == "btp":
        comm = -(alpha + (p - 1) / p * payload / busbw)
        extra_params = (v - vl) * d  # the lm_head; the embedding stays column-sharded
    else:  # vocab-parallel: two all-reduces of [T, d]; replicated: none
        comm = -2 * (alpha + 2 * (p - 1) / p * payload / busbw)
        extra_params = 2 * (v - vl) * d  # the lm_head and the embedding, whole on every rank
    optimizer = scale_model.elementwise_time(28 * extra_params, hw)
    return gemm + loss + comm + optimizer


SEVEN_B = next(s for s in scale_model.SHAPES if s.name == "7B")


@pytest.mark.parametrize(
    ("shape", "hw", "wl"),
    [
        (TOY, TOY_HW, Workload(seq=8, batch=2)),
        (SEVEN_B, hardware.load_hardware("a100-80gb-nvlink"), Workload()),
    ],
    ids=["toy", "7B-a100"],
)
def test_head_modes(shape, hw, wl):
    tokens = wl.seq * wl.batch
    for system in scale_model.SYSTEMS:
        # without TP the two modes are one computation
        one = {h: scale_model.predict(shape, system, 1, 1, hw, wl, head=h) for h in scale_model.HEADS}
        assert one["replicated"] == one["vocab_parallel"]
        assert scale_model.head_cost(system, shape, tokens, 1, hw, wl, "replicated") == scale_model.head_cost(
            system, shape, tokens, 1, hw, wl, "vocab_parallel"
        )
        for p in (2, 4, 8):
            vp = scale_model.predict(shape, system, p, 1, hw, wl, head="vocab_parallel")
            rep = scale_model.predict(shape, system, p, 1, hw, wl, head="replicated")
            # the default is the vocab-parallel head
            assert scale_model.predict(shape, system, p, 1, hw, wl) == vp
            expected = _replicated_minus_vocab_parallel(system, shape, tokens, p, hw)
            assert rep.iteration_s - vp.iteration_s == pytest.approx(expected, rel=1e-9, abs=1e-15)
            # collectives the replicated head drops: btp's reduce-scatter, full's and vanilla's two all-reduces
            dropped = 1 if system == "btp" else 2
            assert vp.collectives - rep.collectives == dropped
            assert (vp.comm_gb - rep.comm_gb) * 1e9 == pytest.approx(dropped * tokens * shape.d * 2)
            # on real hardware the whole [T, V] head costs more than the collectives it saves
            if shape is SEVEN_B:
                assert rep.iteration_s > vp.iteration_s


def test_replicated_head_stage_params_by_hand():
    # toy, TP 2, PP 2: two layers per stage, vocab 100, d 64
    for system in scale_model.SYSTEMS:
        layers = 2 * scale_model.layer_params(system, TOY, 2)
        vp = scale_model.stage_params(system, TOY, 2, 2)
        rep = scale_model.stage_params(system, TOY, 2, 2, "replicated")
        assert vp[-1] == layers + 50 * 64 + 64  # lm_head V/p x d, final-norm gain
        assert rep[-1] == layers + 100 * 64 + 64  # the whole V x d lm_head on every rank
        if system == "btp":  # embedding columns sharded under either head: V x d/p
            assert vp[0] == rep[0] == layers + 100 * 32
        else:  # vocab-parallel embedding V/p x d; replicated with the replicated head
            assert vp[0] == layers + 50 * 64
            assert rep[0] == layers + 100 * 64
        # the optimizer runs over the larger stage
        wl = Workload(seq=8, batch=2)
        pred = scale_model.predict(TOY, system, 2, 2, TOY_HW, wl, head="replicated")
        assert pred.optimizer_s == pytest.approx(scale_model.elementwise_time(28 * max(rep), TOY_HW))


def test_unknown_head_is_refused():
    with pytest.raises(ValueError, match="unknown head"):
        scale_model.predict(TOY, "btp", 2, hw=TOY_HW, head="sharded")
    with pytest.raises(ValueError, match="unknown head"):
        scale_model.head_cost("btp", TOY, 16, 2, TOY_HW, Workload(), "sharded")


# ----------------------------------------------------------------------------- hardware files


@pytest.mark.parametrize(
    ("name", "peak", "hbm", "nvlink"),
    [("a100-80gb-nvlink", 312e12, 2.0e12, 300e9), ("h100", 989e12, 3.35e12, 450e9), ("h200", 989e12, 4.8e12, 450e9)],
)
def test_bundled_hardware_files(name, peak, hbm, nvlink):
    hw = hardware.load_hardware(name)
    assert (hw.peak_flops, hw.hbm_bandwidth, hw.nvlink_bandwidth) == (peak, hbm, nvlink)
    assert hw.allreduce_bus_bandwidth < hw.nvlink_bandwidth
    assert set(hardware.HARDWARE_FIELDS) <= set(hw.notes) <= {*hardware.HARDWARE_FIELDS, *hardware.OPTIONAL_HARDWARE_FIELDS}
    assert all(hw.notes.values())
    assert hw.memory_gib > 70 and hw.internode_bus_bandwidth < hw.allreduce_bus_bandwidth  # the planner's two fields
    raw = json.loads(
        (importlib.resources.files("boost_compile") / "hardware" / f"{name}.json").read_text()
    )
    calibrated = [k for k, v in raw.items() if isinstance(v, dict) and v.get("calibrated")]
    assert calibrated, "a hardware file without calibrated constants"
    for key in calibrated:
        assert raw[key].get("why"), key
        assert f"| {key} |" in hardware.__doc__, f"{key} missing from the module docstring table"


def test_hardware_from_a_path(tmp_path):
    raw = json.loads(
        (importlib.resources.files("boost_compile") / "hardware" / "h200.json").read_text()
    )
    raw["name"] = "my-gpu"
    raw["peak_flops"]["value"] = 1e15
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(raw))
    hw = hardware.load_hardware(str(path))
    assert hw.name == "my-gpu" and hw.peak_flops == 1e15
    del raw["collective_latency"]["why"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="collective_latency"):
        hardware.load_hardware(str(path))
    with pytest.raises(ValueError, match="unknown hardware"):
        hardware.load_hardware("no-such-gpu")


# ----------------------------------------------------------------------------- the published rows


@pytest.fixture(scope="module")
def published_rows():
    rows = scale.published_comparison(hardware.load_hardware("a100-80gb-nvlink"), Workload())
    return {r["model"]: r for r in rows}


@pytest.mark.parametrize(
    ("model", "key"),
    [
        ("3B", "vs_full"),
        ("3B", "vs_vanilla"),
        ("7B", "vs_full"),
        ("7B", "vs_vanilla"),
        ("13B", "vs_full"),
        pytest.param(
            "13B",
            "vs_vanilla",
            marks=pytest.mark.xfail(
                strict=True,
                reason="known miss: published vanilla grows 1.48x from 7B TP4 to 13B TP4 PP2 while every "
                "term of its work grows 1.56-1.96x; the model predicts 2.37x against the published 1.86x",
            ),
        ),
    ],
)
def test_published_speedups_within_15_percent(published_rows, model, key):
    """The acceptance check: one set of A100 constants for every row, no per-row fitting."""
    err = published_rows[model]["speedup_error"][key]
    assert abs(err) <= scale.TARGET_ERROR, f"{model} btp {key}: {err:+.1%}"


def test_published_rows_regression_guard(published_rows):
    # the known miss stays where it is documented, and the TP1 row stays close
    assert abs(published_rows["13B"]["speedup_error"]["vs_vanilla"]) < 0.30
    assert all(abs(e) < 0.10 for e in published_rows["1B"]["speedup_error"].values())
    assert all(abs(e) < 0.30 for r in published_rows.values() for e in r["time_error"].values())


# ----------------------------------------------------------------------------- the report


def test_run_prints_every_row_and_serialises():
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.hardware, args.seq, args.batch, args.dtype_bytes, args.micro_batches) == (
        "a100-80gb-nvlink",
        4096,
        4,
        2,
        1,
    )
    text, data = scale.run(args)
    for name in ("1B", "3B", "7B", "13B", "30B"):
        for tp in (1, 2, 4, 8):
            star = " *" if name == "30B" and tp == 8 else ""  # 52 heads over 8 ranks
            assert f"| {name}{star} | {tp} |" in text
    assert "| 13B | 8 | 4 | 2 |" in text and "2.07 / 2.42 / 1.30" in text
    assert len(data["grid"]) == 20 and len(data["published"]) == 4
    json.dumps(data)
    text, data = scale.run(parser.parse_args(["--hardware", "h200"]))
    assert data["hardware"]["name"] == "h200"


def test_report_head_table():
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    assert parser.parse_args([]).head == "vocab_parallel"
    text, data = scale.run(parser.parse_args([]))
    assert data["head"] == "vocab_parallel"
    title = "head and loss at 7b, vocabulary 32,000"
    assert title in text.lower()
    table = text[text.lower().index(title) :].splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("| system | TP |"))
    columns = [c.strip() for c in table[header].strip("|").split("|")]
    assert columns[2:5] == ["replicated s", "vocab-parallel s", "replicated / vocab-parallel"]
    body = [line for line in table[header + 2 :] if line.startswith("| ")][:12]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in body]
    assert [(c[0], int(c[1])) for c in cells] == [
        (s, tp) for s in scale_model.SYSTEMS for tp in scale_model.TP_DEGREES
    ]
    for c in cells:
        ratio = float(c[4].rstrip("x"))
        assert (ratio == 1.0) if c[1] == "1" else (ratio > 1.0), c
        assert float(c[2]) >= float(c[3])
    # the 7B of SHAPES (vocab 32,000): the vocab-parallel times are the grid's
    grid = {(g["model"], g["tp"]): g["predicted"] for g in data["grid"]}
    for row in data["head_comparison"]:
        assert (row["model"], row["vocab"]) == ("7B", 32000)
        assert (
            row["vocab_parallel"]["iteration_s"]
            == grid["7B", row["tp"]][row["system"]]["iteration_s"]
        )
        assert 0 < row["vocab_parallel"]["head_share"] <= row["replicated"]["head_share"] < 1
        assert (row["ratio"] > 1) == (row["tp"] > 1)
    # --head replicated changes the grid, never the comparison with BOOST.md
    text_r, data_r = scale.run(parser.parse_args(["--head", "replicated"]))
    assert data_r["published"] == data["published"]
    assert data_r["head_comparison"] == data["head_comparison"]
    grid_r = {(g["model"], g["tp"]): g["predicted"] for g in data_r["grid"]}
    for row in data["head_comparison"]:
        assert (
            row["replicated"]["iteration_s"]
            == grid_r["7B", row["tp"]][row["system"]]["iteration_s"]
        )
    assert "Every shape at TP 1-8 (PP 1), replicated head:" in text_r


def test_btp_moves_less_than_full_rank_and_vanilla():
    hw = hardware.load_hardware()
    for shape in scale_model.SHAPES:
        preds = scale_model.predict_all(shape, 4, 1, hw, Workload())
        gb = {s: p.comm_gb for s, p in preds.items()}
        assert gb["btp"] < gb["full-rank"] < gb["vanilla"]


def test_workload_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Workload().seq = 1  # type: ignore[misc]


# ----------------------------------------------------------------------------- pipeline boundary, data parallelism


def test_btp_stages_send_their_d_slice():
    # TOY: d 64; 16 tokens, bf16: full and vanilla stages send [T, d], btp its d/p slice
    assert scale_model.p2p_bytes(16, TOY, 2, "full-rank", 2) == scale_model.p2p_bytes(16, TOY, 2, "vanilla", 2) == 16 * 64 * 2
    assert scale_model.p2p_bytes(16, TOY, 2, "btp", 2) == 16 * 32 * 2
    assert scale_model.p2p_bytes(16, TOY, 2, "btp", 4) == 16 * 16 * 2
    assert scale_model.p2p_bytes(16, TOY, 2, "btp", 1) == 16 * 64 * 2
    wl = Workload(seq=8, batch=4, micro_batches=2)
    for system, width in (("full-rank", 64), ("vanilla", 64), ("btp", 32)):
        pred = scale_model.predict(TOY, system, 2, 2, TOY_HW, wl)
        # 2 micro-batches of 2 x 8 tokens, each an activation down and a gradient up, one boundary
        assert pred.p2p_bytes == 2 * 2 * 16 * width * 2
        assert pred.p2p_s == pytest.approx(2 * 16 * width * 2 / 5e9)
    # a send/recv latency counts once per transfer on the critical path
    slow = dataclasses.replace(TOY_HW, p2p_latency=1e-3)
    assert scale_model.predict(TOY, "btp", 2, 2, slow, wl).p2p_s == pytest.approx(2 * (1e-3 + 16 * 32 * 2 / 5e9))


def test_data_parallel_gradient_all_reduce_by_hand():
    two = scale_model.predict(TOY, "btp", 1, 1, TOY_HW, Workload(seq=8, batch=4), dp=2)
    half = scale_model.predict(TOY, "btp", 1, 1, TOY_HW, Workload(seq=8, batch=2))
    # btp at TP 1: 4 layers of 16 x (4 (64 + 64) + 3 (64 + 128)) factor weights and 2 x 64 norm gains,
    # the embedding and lm_head 100 x 64, the final norm 64; fp32 gradients
    grads = 4 * (4 * (16 * (4 * 128 + 3 * 192) + 128) + 2 * 100 * 64 + 64)
    allreduce = 1e-5 + grads / 1e10  # one all-reduce over 2 ranks: 2 (p-1)/p = 1 payload
    copies = 6 * grads / (1e11 * 0.5)  # flatten, scale, copy back
    assert two.dp == 2 and two.dp_s == pytest.approx(allreduce + copies)
    assert two.iteration_s == pytest.approx(half.iteration_s + allreduce + copies)
    assert two.comm_s == pytest.approx(half.comm_s + allreduce)
    assert two.comm_gb == pytest.approx(half.comm_gb + grads / 1e9)
    assert two.collectives == half.collectives + 1
    assert scale_model.predict(TOY, "btp", 1, 1, TOY_HW, Workload(seq=8, batch=4)).dp_s == 0.0
    with pytest.raises(ValueError, match="dp must divide"):
        scale_model.predict(TOY, "btp", 1, 1, TOY_HW, Workload(seq=8, batch=3), dp=2)
    # a pipeline per replica: its micro-batches cut the replica's batch
    with pytest.raises(ValueError, match="micro_batches"):
        scale_model.predict(TOY, "btp", 1, 2, TOY_HW, Workload(seq=8, batch=4, micro_batches=4), dp=2)


def test_hardware_latency_zero_half_intensity_and_provenance():
    raw = json.loads((importlib.resources.files("boost_compile") / "hardware" / "h200.json").read_text())
    hw = hardware.hardware_from_dict(raw)
    assert hw.p2p_latency == 0.0 and hw.measured == {}
    raw["p2p_latency"] = {"value": 3e-5, "source": "ping-pong"}
    raw["gemm_half_intensity"]["value"] = 0
    raw["measured"] = {"command": "boost-bench calibrate", "date": "today"}
    hw = hardware.hardware_from_dict(raw)
    assert hw.p2p_latency == 3e-5 and hw.measured["command"] == "boost-bench calibrate"
    # no half intensity: every whole-tile GEMM at the ceiling
    assert scale_model.gemm_efficiency(64, 64, 64, hw, 4) == pytest.approx(hw.gemm_max_efficiency)
    for key, value in (("p2p_latency", -1.0), ("peak_flops", 0.0)):
        bad = json.loads(json.dumps(raw))
        bad[key]["value"] = value
        with pytest.raises(ValueError, match=key):
            hardware.hardware_from_dict(bad)


def test_bundled_cpu_file_is_measured():
    raw = json.loads((importlib.resources.files("boost_compile") / "hardware" / "cpu.json").read_text())
    hw = hardware.load_hardware("cpu")
    assert hw.measured["command"].startswith("boost-bench calibrate") and hw.measured["quick"] == "false"
    assert hw.measured["machine"] and hw.measured["date"]
    for key in (*hardware.HARDWARE_FIELDS, "p2p_latency", "queued_collective_latency"):
        if key in ("gemm_tile", "attention_head_dim_multiple"):
            assert raw[key]["measured"] is False and raw[key]["why"]
        else:
            assert raw[key]["measured"] is True and raw[key]["command"] == hw.measured["command"], key
    assert hw.p2p_latency > 0
    for key in ("gemm_max_efficiency", "attention_efficiency", "elementwise_efficiency"):
        assert 0 < getattr(hw, key) <= 1


# ----------------------------------------------------------------------------- the cpu comparison

#: the benches' rows as scale-model configurations, written out by hand: (bench, row) -> (system, TP, PP, DP)
MEASURED_ROWS = {
    ("tp", "dense, megatron"): ("full-rank", 2, 1, 1),
    ("tp", "CoLA, vanilla (DTensor)"): ("vanilla", 2, 1, 1),
    ("tp", "CoLA, btp"): ("btp", 2, 1, 1),
    ("tp", "dense, 1 process"): ("full-rank", 1, 1, 1),
    ("tp", "CoLA, 1 process"): ("btp", 1, 1, 1),
    ("pp", "1 process"): ("btp", 1, 1, 1),
    ("pp", "TP2 btp"): ("btp", 2, 1, 1),
    ("pp", "PP2"): ("btp", 1, 2, 1),
    ("pp", "DP2"): ("btp", 1, 1, 2),
}
#: the 60m presets (d 512, 8 layers, 8 heads, d_ff 1376, r 128) at the benches' vocabulary of 256
SIXTY_M = Shape("60m", d=512, d_ff=1376, layers=8, heads=8, vocab=256)


def _measured_hardware(path):
    """TOY_HW as a file that says it was measured: the comparison is then the default."""
    raw = {k: {"value": getattr(TOY_HW, k), "source": "synthetic"} for k in hardware.HARDWARE_FIELDS}
    raw["p2p_latency"] = {"value": 2e-5, "source": "synthetic"}
    raw.update(name="synthetic-cpu", measured={"command": "boost-bench calibrate", "date": "d", "machine": "m"})
    path.write_text(json.dumps(raw))
    return hardware.load_hardware(str(path))


def _save_runs(folder, hw, benches=("tp", "pp")):
    """tp.json and pp.json at seq 128, batch 4, fp32, forward + backward only: every step 10% above the
    model's, except PP2 (twice the model's); returns the steps."""
    from boost_compile.bench.results import Result, save

    wl = Workload(seq=128, batch=4, dtype_bytes=4, micro_batches=2, optimizer_bytes_per_param=0.0)
    step = {}
    for (bench, label), (system, t, p, d) in MEASURED_ROWS.items():
        step[bench, label] = scale_model.predict(SIXTY_M, system, t, p, hw, wl, dp=d).iteration_s * (2.0 if label == "PP2" else 1.1)
    params = {"size": "60m", "seq": 128, "batch": 4, "vocab": 256}
    data = {
        "tp": {"params": params, "vocab": 256,
               "variants": {k: {"step_s": step["tp", k]} for k in ("dense, megatron", "CoLA, vanilla (DTensor)", "CoLA, btp")},
               "single": {k: {"step_s": step["tp", k]} for k in ("dense, 1 process", "CoLA, 1 process")}},
        "pp": {"params": {**params, "microbatches": 2}, "vocab": 256, "preset": "cola-60m",
               "rows": {k: {"step_s": step["pp", k], "comm": {"bytes": 12345}} for k in ("1 process", "TP2 btp", "PP2", "DP2")},
               "boundary": {"btp": {"preset": "cola-60m", "step_bytes": 111}, "megatron": {"preset": "llama-60m", "step_bytes": 222}}},
    }
    for bench in benches:
        r = Result(bench, bench, "", data[bench])
        r.command = f"boost-bench {bench} --seq 128"
        save(r, str(folder), None)
    return step


def test_cpu_comparison_on_synthetic_runs(tmp_path):
    from boost_compile.bench import cli
    from boost_compile.bench.results import load

    hw = _measured_hardware(tmp_path / "hw.json")
    step = _save_runs(tmp_path / "runs", hw)
    out = tmp_path / "out"
    cli.main(["scale", "--hardware", str(tmp_path / "hw.json"), "--results", str(tmp_path / "runs"), "--out", str(out)])
    assert load(str(out), "scale") is None and (out / "scale-cpu.png").exists()
    r = load(str(out), "scale-cpu")
    rows = {(x["bench"], x["label"]): x for x in r.data["rows"]}
    assert list(rows) == list(MEASURED_ROWS)
    for key, x in rows.items():
        assert (x["system"], x["tp"], x["pp"], x["dp"]) == MEASURED_ROWS[key]
        assert x["measured_s"] == step[key]
        assert x["error"] == pytest.approx(-0.5 if key[1] == "PP2" else 1 / 1.1 - 1)
        assert x["within"] == (key[1] != "PP2")
    assert [t.met for t in r.targets] == [label != "PP2" for _, label in MEASURED_ROWS]
    assert all(t.bound == 0.2 and not t.at_least for t in r.targets)
    # the stage boundaries: pp's measured bytes beside the model's, per rank and step (2 micro-batches
    # of 2 x 128 tokens, fp32, an activation and its gradient each): PP2 sends d, btp stages d/2
    boundary = {x["boundary"].split(" (")[0]: x for x in r.data["boundary"]}
    assert boundary["PP2"] == {"boundary": "PP2 (cola-60m)", "measured": 12345, "model": 2 * 2 * 256 * 512 * 4}
    assert boundary["PP2 x TP2, btp stages"]["model"] == 2 * 2 * 256 * 256 * 4
    assert boundary["PP2 x TP2, megatron stages"]["model"] == 2 * 2 * 256 * 512 * 4
    assert boundary["PP2 x TP2, btp stages"]["measured"] == 111
    md = r.markdown()
    assert "8 of 9 within 20%" in md and "`boost-bench pp --seq 128`" in md
    assert "| pp | PP2 | btp | 1 | 2 (m=2) | 1 |" in md and "none is fitted to a measured step time" in md


def test_cpu_comparison_needs_runs_and_keeps_the_published_mode(tmp_path):
    from boost_compile.bench import cli
    from boost_compile.bench.results import load

    hw = _measured_hardware(tmp_path / "hw.json")
    argv = ["scale", "--hardware", str(tmp_path / "hw.json"), "--results", str(tmp_path / "runs")]
    with pytest.raises(SystemExit, match="no tp.json or pp.json"):
        cli.main([*argv, "--out", str(tmp_path / "a")])
    _save_runs(tmp_path / "runs", hw, benches=("tp",))
    cli.main([*argv, "--out", str(tmp_path / "b")])
    r = load(str(tmp_path / "b"), "scale-cpu")
    assert {x["bench"] for x in r.data["rows"]} == {"tp"} and r.data["boundary"] == []
    # --compare published: the BOOST.md tables, whatever the file
    cli.main([*argv, "--compare", "published", "--out", str(tmp_path / "c")])
    assert load(str(tmp_path / "c"), "scale").data["published"]


# ----------------------------------------------------------------------------- architectures: plain low-rank, CoLA, LaX


def test_architectures_differ_only_in_the_latents_elementwise_work():
    """LaX = CoLA + one [T, r] add per projection (3 passes forward, 3 backward), whole under btp,
    r/p-sharded under vanilla; plain low-rank = CoLA without the SiLU (2 + 3 passes)."""
    tokens, e = 10, 2
    lax, plain = dataclasses.replace(TOY, arch="lax"), dataclasses.replace(TOY, arch="lowrank")
    for system, width in (("btp", 7 * 16), ("vanilla", 7 * 8)):
        cola_bytes = scale_model.layer_elementwise_bytes(system, TOY, tokens, 2)
        assert scale_model.layer_elementwise_bytes(system, lax, tokens, 2) - cola_bytes == width * 6 * tokens * e
        assert cola_bytes - scale_model.layer_elementwise_bytes(system, plain, tokens, 2) == width * 5 * tokens * e
        for shape in (lax, plain):
            assert scale_model.layer_collectives(system, shape, tokens, e, 2) == scale_model.layer_collectives(system, TOY, tokens, e, 2)
            assert scale_model.layer_gemms(system, shape, tokens, 2) == scale_model.layer_gemms(system, TOY, tokens, 2)
            assert scale_model.layer_params(system, shape, 2) == scale_model.layer_params(system, TOY, 2)
    # the dense model has no latents: the same whatever arch says
    dense = scale_model.layer_elementwise_bytes("full-rank", TOY, tokens, 2)
    assert scale_model.layer_elementwise_bytes("full-rank", lax, tokens, 2) == dense
    with pytest.raises(ValueError, match="unknown arch 'svd'; one of lowrank, cola, lax"):
        Shape("x", 64, 128, 1, 4, arch="svd")


def test_lax_iteration_is_colas_plus_the_adds():
    from boost_compile.bench import architectures

    wl = Workload(seq=8, batch=2)
    lax = dataclasses.replace(TOY, arch="lax")
    cola_pred, lax_pred = (scale_model.predict(s, "btp", 2, 1, TOY_HW, wl) for s in (TOY, lax))
    adds = 4 * scale_model.elementwise_time(7 * 16 * 6 * 16 * 2, TOY_HW)  # 4 layers, 16 tokens, bf16
    assert lax_pred.iteration_s - cola_pred.iteration_s == pytest.approx(adds)
    assert (lax_pred.comm_gb, lax_pred.collectives, lax_pred.gemm_s) == (cola_pred.comm_gb, cola_pred.collectives, cola_pred.gemm_s)
    # saved per layer under low-rank checkpointing: 7 [T, r] + [T, d/p], LaX too (its latents are
    # recomputed from the saved down outputs, as test_activation_checkpoint counts)
    assert architectures.saved_bytes_per_layer(TOY, 16, 2) == (7 * 16 * 16 + 16 * 32) * 2
    assert architectures.saved_bytes_per_layer(lax, 16, 2) == architectures.saved_bytes_per_layer(TOY, 16, 2)


def test_architecture_table_beside_boost_md():
    """7B TP4 (A100): plain low-rank < CoLA < LaX < full-rank, as published (0.70 / 0.72 / 0.75 / 1.06);
    each low-rank time relative to CoLA's within 2% of the published ratio."""
    from boost_compile.bench import architectures

    rows = architectures.architecture_comparison(hardware.load_hardware("a100-80gb-nvlink"), Workload())
    by = {r["arch"]: r for r in rows}
    assert list(by) == ["full-rank", "lowrank", "cola", "lax"]
    assert [by[a]["published_s"] for a in by] == [1.06, 0.70, 0.72, 0.75]
    assert by["lowrank"]["predicted_s"] < by["cola"]["predicted_s"] < by["lax"]["predicted_s"] < by["full-rank"]["predicted_s"]
    for arch in ("lowrank", "lax"):
        assert by[arch]["x_cola"] == pytest.approx(by[arch]["published_x_cola"], rel=0.02)
        assert by[arch]["comm_gb"] == by["cola"]["comm_gb"]
    assert by["full-rank"]["saved_bytes_per_layer"] is None
    assert by["lax"]["saved_bytes_per_layer"] == by["cola"]["saved_bytes_per_layer"] == by["lowrank"]["saved_bytes_per_layer"]
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    text, data = scale.run(parser.parse_args([]))
    assert data["architectures"] == rows
    assert "The architectures at 7B TP4 (PP 1)" in text and "| LaX | " in text and "| plain low-rank | " in text


def test_cpu_comparison_prices_a_lax_run(tmp_path):
    """``boost-bench tp --lax`` saves two LaX rows: the comparison prices them with the LaX shape."""
    from boost_compile.bench import compare, tp

    params = {"tp": {"size": "60m", "seq": 128, "batch": 4, "vocab": 256, "lax": True}}
    configs = {c.label: (c, shape) for c, shape, _wl in compare.configurations(params)}
    assert list(configs)[-2:] == [tp.LAX_BTP, tp.SINGLE["lax"]]
    assert configs[tp.LAX_BTP][0].tp == 2 and configs[tp.SINGLE["lax"]][0].tp == 1
    assert {label: shape.arch for label, (_c, shape) in configs.items()} == {
        **{label: "cola" for label in configs if "LaX" not in label}, tp.LAX_BTP: "lax", tp.SINGLE["lax"]: "lax"}
    assert [c.label for c, _s, _w in compare.configurations({"tp": {**params["tp"], "lax": False}})] == [
        c.label for c in compare.TP_CONFIGS]
