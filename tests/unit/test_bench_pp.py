"""boost-bench pp's ratios and report sections, and boost-bench calibrate, on tiny sizes.

What is checked is what the report and the scale model rely on: the ratios against
the named baseline, the calibration file's layout and its fits on synthetic
measurements; never a timing. The pp runs themselves (their processes) are in
tests/distributed/test_bench_parallel.py.
"""

from __future__ import annotations

import json

import pytest

from boost_compile.bench import calibrate, cli, pp
from boost_compile.costmodel import hardware, scale_model


def test_ratios_against_the_baseline():
    rows = {label: {"step_s": s, "times_s": [s]} for label, s in
            (("1 process", 4.0), ("TP2 btp", 2.5), ("PP2", 3.0), ("DP2", 2.0))}
    pp.ratios(rows, tokens=100, microbatches=4)
    assert rows["TP2 btp"]["speedup"] == 1.6 and rows["TP2 btp"]["x_of_perfect"] == 1.25
    assert rows["DP2"]["x_of_perfect"] == 1.0 and rows["PP2"]["micro_batches"] == 4
    assert rows["DP2"]["micro_batches"] == 1 and rows["PP2"]["tokens_per_s"] == pytest.approx(100 / 3)

@pytest.mark.slow
def test_calibrate_quick_writes_a_loadable_measured_file(tmp_path):
    path = tmp_path / "cpu.json"
    cli.main(["calibrate", "--quick", "--out", str(path)])
    raw = json.loads(path.read_text())
    hw = hardware.load_hardware(str(path))
    assert hw.name == "cpu" and hw.measured["command"] == f"boost-bench calibrate --quick --out {path}"
    assert hw.measured["threads"] == "1" and hw.measured["processes"] == "2"
    for key in (*hardware.HARDWARE_FIELDS, "p2p_latency", "queued_collective_latency"):
        entry = raw[key]
        if entry["measured"]:
            assert entry["command"] == hw.measured["command"] and entry["date"] and entry["machine"] and entry["source"]
        else:
            assert entry["why"] and key in ("gemm_tile", "attention_head_dim_multiple")
    assert hw.p2p_latency >= 0 and hw.gemm_tile == 1 and hw.allreduce_bus_bandwidth > 0
    assert hw.queued_collective_latency > 0 and raw["measurements"]["queued_broadcast"]["count"] == 64
    for key in ("gemm_max_efficiency", "attention_efficiency", "elementwise_efficiency"):
        assert 0 < getattr(hw, key) <= 1
    # the GEMMs measured are the configurations' (--quick: seq 64, batch 4, the 60m shapes): btp TP2's
    # grouped q/k/v down factor, the dense TP1 fused q/k/v, PP2's 1-sequence and DP2's 2-sequence micro-batches
    shapes = {(g["m"], g["k"], g["n"]) for g in raw["measurements"]["gemm"]}
    assert {(256, 256, 384), (256, 512, 1536), (64, 512, 384), (128, 512, 384)} <= shapes
    attention = {tuple(a["shape"]) for a in raw["measurements"]["attention"]}
    assert attention == {(4, 8, 64, 64), (4, 4, 64, 64), (2, 8, 64, 64), (1, 8, 64, 64)}

def test_a_collective_item_leaves_its_compute_segment_untimed():
    """calibrate times a collective after the compute a step puts before it, not with it."""
    import time

    slept = []
    item = calibrate.Item("x", lambda: None, calls=2, before=lambda: (time.sleep(0.05), slept.append(1)), typical=True)
    assert item.seconds() < 0.02 and slept == [1, 1]
    alone = calibrate.Item("y", lambda: time.sleep(0.05))
    assert alone.seconds() >= 0.05 and not alone.typical


def test_fit_line_recovers_intercept_and_slope():
    xs = [1.0, 10.0, 100.0, 1000.0]
    assert calibrate.fit_line(xs, [3.0 + 0.5 * x for x in xs]) == pytest.approx((3.0, 0.5))
    assert calibrate.fit_line(xs, [2.0] * 4) == pytest.approx((2.0, 0.0))  # no slope
    assert calibrate.fit_line(xs, [0.25 * x for x in xs]) == pytest.approx((0.0, 0.25), abs=1e-12)

def test_fit_link_alpha_and_bandwidth():
    # 4 ranks: an all-reduce moves 2 (p-1)/p = 1.5 payloads; 50 us + 1.5 S / 2 GB/s
    points = [{"bytes": s, "seconds": 50e-6 + 1.5 * s / 2e9} for s in (4096, 65536, 2**20, 2**26)]
    fit = calibrate.fit_link(points, 1.5)
    assert fit["latency"] == pytest.approx(50e-6) and fit["bandwidth"] == pytest.approx(2e9)
    assert fit["worst"] == pytest.approx(0, abs=1e-9)
    # one message 10% slow: the line misses it by about that
    points[2]["seconds"] *= 1.1
    assert 0.05 < calibrate.fit_link(points, 1.5)["worst"] < 0.1
    # no measurable latency: the fastest message's time, so the file's latency stays positive
    bare = calibrate.fit_link([{"bytes": s, "seconds": s / 2e9} for s in (4096, 65536)], 1.0)
    assert bare["latency"] == pytest.approx(4096 / 2e9) and bare["bandwidth"] == pytest.approx(2e9)

def test_fit_gemm_recovers_the_curve():
    hw = hardware.Hardware("synthetic", peak_flops=1e11, hbm_bandwidth=1, nvlink_bandwidth=1, allreduce_bus_bandwidth=1,
                        p2p_bandwidth=1, collective_latency=1, gemm_max_efficiency=0.9, gemm_half_intensity=5.0,
                        gemm_tile=1, attention_efficiency=0.5, attention_head_dim_multiple=1, elementwise_efficiency=1)
    shapes = [(4096, 128, 512), (4096, 512, 64), (1024, 64, 512), (256, 512, 1376), (64, 128, 128)]
    gemms = [{"m": m, "k": k, "n": n, "seconds": 3 * scale_model.gemm_time(m, k, n, hw, 4)} for m, k, n in shapes]
    # a square GEMM slower than the fitted ceiling: the peak becomes the ceiling
    fit = calibrate.fit_gemm(gemms, peak_seconds=1.0, peak_n=64)
    assert fit["peak_flops"] * fit["gemm_max_efficiency"] == pytest.approx(0.9e11)
    assert fit["gemm_half_intensity"] == pytest.approx(5.0)
    assert fit["worst_fit_error"] < 1e-9
    # a faster square GEMM is the peak, the ceiling a fraction of it
    fast = calibrate.fit_gemm(gemms, peak_seconds=3 * 2 * 64**3 / 1e11, peak_n=64)
    assert fast["peak_flops"] == pytest.approx(1e11) and fast["gemm_max_efficiency"] == pytest.approx(0.9)
    # times without a ceiling (proportional to 1 / intensity): one constant rate, no division by zero
    bound = [{**g, "seconds": 1e-9 * g["m"] * g["k"] * g["n"] / scale_model.gemm_intensity(g["m"], g["k"], g["n"], 4)} for g in gemms]
    flat = calibrate.fit_gemm(bound, peak_seconds=1.0, peak_n=64)
    assert flat["gemm_half_intensity"] == 0 and 0 < flat["gemm_max_efficiency"] <= 1

def test_fit_attention_and_memory():
    # 4 b s^2 w / 2 forward, x 3.5 with the backward, at 40% of a 1e11 peak
    rows = [{"shape": [b, h, 256, 64], "seconds": 4 * b * 256**2 * h * 64 / 2 * 3.5 / (0.4 * 1e11)} for b, h in ((4, 4), (1, 8))]
    assert calibrate.fit_attention(rows, 1e11, 0.5, 2.5)["attention_efficiency"] == pytest.approx(0.4)
    ops = [{"op": "a", "bytes": 3e6, "seconds": 1e-4}, {"op": "b", "bytes": 1e6, "seconds": 1e-4}]  # 20 GB/s together
    mem = calibrate.fit_memory(ops, {"bytes": 4e8, "seconds": 1e-2})  # a 40 GB/s copy
    assert mem["hbm_bandwidth"] == pytest.approx(4e10) and mem["elementwise_efficiency"] == pytest.approx(0.5)

def test_report_has_the_pp_and_cpu_comparison_sections(tmp_path):
    from boost_compile.bench import report
    from boost_compile.bench.results import Result, save

    for name in ("scale-cpu", "tp", "scale", "pp"):
        r = Result(name, f"Section {name}", f"table of {name}", {})
        r.command = f"boost-bench {name}"
        save(r, str(tmp_path / "results"), None)
    path = tmp_path / "RESULTS.md"
    report.write(str(tmp_path / "results"), str(path))
    text = path.read_text()
    order = [text.index(f"## Section {name}") for name in ("tp", "pp", "scale", "scale-cpu")]
    assert order == sorted(order)
    # `all` ends with the comparison, reading the folder it writes to
    assert cli.ALL[-1] == ["scale", "--hardware", "cpu", "--results", "{out}"]
