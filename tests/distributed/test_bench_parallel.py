"""boost-bench tp and pp on tiny sizes, each over its own gloo processes (the benchmarks spawn
them): the rows, their layouts, the ratios against the named baseline, the bytes each rank
sends and the profile's categories; never a timing."""

from __future__ import annotations

import pytest

from boost_compile.bench import cli, profile
from boost_compile.bench.results import load
from boost_compile.costmodel import scale_model
from boost_compile.costmodel.scale_model import layernorm_statistic_bytes
from boost_compile.models import Llama, LlamaConfig

pytestmark = pytest.mark.extended  # make test-extended (CI runs it after make test)

SEQ, BATCH, MICRO = 16, 4, 2


@pytest.fixture(scope="module")
def tp_tiny(tmp_path_factory):
    """One ``boost-bench tp --profile`` run at tiny size on LayerNorm models (btp: online LayerNorm;
    RMSNorm's online norm is covered by tests/distributed/test_tp.py), shared by the tests that read it."""
    out = tmp_path_factory.mktemp("tp")
    cli.main(["tp", "--size", "tiny", "--seq", "16", "--repeats", "1", "--warmup", "0", "--inner", "aot_eager",
              "--profile", "--norm", "layernorm", "--out", str(out)])
    return out, load(str(out), "tp")

@pytest.mark.slow
def test_tp_on_tiny(tp_tiny):
    tmp_path, r = tp_tiny
    v = r.data["variants"]
    btp, dense, vanilla = v["CoLA, btp"], v["dense, megatron"], v["CoLA, vanilla (DTensor)"]
    n = btp["layers"]
    # btp: one all-reduce per norm+group and per o/down, both ways, plus the gather before the final
    # norm; the vocabulary-parallel loss's two [T]-row all-reduces forward, the head's input
    # gradient backward
    assert btp["collectives"] == {"forward": 4 * n + 1 + 2, "backward": 4 * n + 1}
    # megatron: after attention and after the MLP, both ways, plus the same head and loss
    assert dense["collectives"] == {"forward": 2 * n + 2, "backward": 2 * n + 1}
    total = {k: x["bytes"]["forward"] + x["bytes"]["backward"] for k, x in v.items()}
    assert dense["btp_bytes_ratio"] == pytest.approx(total["CoLA, btp"] / total["dense, megatron"])
    assert vanilla["btp_speedup"] == pytest.approx(vanilla["step_s"] / btp["step_s"])
    assert (tmp_path / "tp.png").exists()

@pytest.mark.slow
def test_tp_block_bytes_are_btps_bound(tp_tiny):
    """What btp's blocks send forward is T (4 r_attn + 3 r_mlp) e per layer (e = 4: fp32 on CPU) plus
    online LayerNorm's fp32 statistics in the q/k/v and gate/up groups' all-reduces, to the byte."""
    _, r = tp_tiny
    btp = r.data["variants"]["CoLA, btp"]
    config = LlamaConfig.preset("tiny")
    tokens, ra, rm = BATCH * SEQ, config.rank_attn, config.rank_mlp
    per_layer = tokens * (4 * ra + 3 * rm) * 4 + layernorm_statistic_bytes(tokens, (3 * ra, 2 * rm), 2)
    assert btp["block_bytes"]["forward"] == btp["layers"] * per_layer
    layer = scale_model.layer_collectives("btp", scale_model.Shape("tiny", config.dim, config.ffn_dim, config.n_layers,
                                                                  config.n_heads, norm="layernorm"), tokens, 4, p=2)
    if ra == rm == config.dim // 4:  # the scale model's CoLA shape: rank d/4 everywhere
        assert layer.fwd_bytes == per_layer


def test_tp_scaling_against_one_process(tp_tiny):
    _out, r = tp_tiny
    v, single, s = r.data["variants"], r.data["single"], r.data["scaling"]
    assert list(single) == ["dense, 1 process", "CoLA, 1 process"]
    dense1, cola1 = single["dense, 1 process"]["step_s"], single["CoLA, 1 process"]["step_s"]
    # each TP variant against half the 1-process step of its own family
    for label, base in (("dense, megatron", dense1), ("CoLA, vanilla (DTensor)", cola1), ("CoLA, btp", cola1)):
        assert v[label]["single_s"] == base
        assert v[label]["perfect_s"] == pytest.approx(base / 2)
        assert v[label]["x_of_perfect"] == pytest.approx(v[label]["step_s"] / (base / 2))
    btp, megatron, vanilla = (v[k]["step_s"] for k in ("CoLA, btp", "dense, megatron", "CoLA, vanilla (DTensor)"))
    assert s["single_cola_over_dense"] == pytest.approx(cola1 / dense1)
    assert s["single_dense_over_cola"] == pytest.approx(dense1 / cola1)
    assert s["btp_speedup_over_megatron"] == pytest.approx(megatron / btp)
    assert s["btp_speedup_over_megatron_per_single_ratio"] == pytest.approx((megatron / btp) / (dense1 / cola1))
    assert s["btp_speedup_over_vanilla"] == pytest.approx(vanilla / btp)
    assert s["btp_x_of_perfect"] == v["CoLA, btp"]["x_of_perfect"]
    assert r.targets == []  # the targets are for 60m at seq 1024 only
    md = r.markdown()
    assert "vocab 256 (--vocab 256)" in md
    assert "| x of perfect scaling |" in md and "| dense, 1 process |" in md and "| CoLA, 1 process |" in md
    assert "btp speed-up over dense megatron / 1-process dense:CoLA ratio" in md

@pytest.mark.slow
def test_tp_profile_categories(tp_tiny):
    _out, r = tp_tiny
    prof = r.data["profile"]
    assert list(prof) == ["dense, megatron", "CoLA, vanilla (DTensor)", "CoLA, btp"]
    for label, p in prof.items():
        assert list(p["ms"]) == list(profile.CATEGORIES)
        assert p["total_ms"] == pytest.approx(sum(p["ms"].values()))
        for c, ms in p["ms"].items():
            assert p["percent"][c] == pytest.approx(100 * ms / p["step_ms"])
        # every variant does GEMMs, attention, waits on collectives and has a head (found by its shapes)
        for c in (profile.GEMMS, profile.ATTENTION, profile.COLLECTIVES, profile.HEAD):
            assert p["ms"][c] > 0, (label, c)
        assert f"| {label} | " in r.markdown()
    assert "| variant | GEMMs | attention | norms+elementwise | collectives waited on | head+loss | other |" in r.markdown()


@pytest.fixture(scope="module")
def pp_tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp")
    cli.main(["pp", "--size", "tiny", "--seq", str(SEQ), "--batch", str(BATCH), "--microbatches", str(MICRO),
              "--repeats", "1", "--warmup", "0", "--inner", "aot_eager", "--out", str(out)])
    return out, load(str(out), "pp")

@pytest.mark.slow
def test_pp_rows_and_ratios(pp_tiny):
    out, r = pp_tiny
    rows = r.data["rows"]
    assert list(rows) == ["1 process", "TP2 btp", "PP2", "DP2"] and r.data["baseline"] == "1 process"
    assert [(x["tp"], x["pp"], x["dp"]) for x in rows.values()] == [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]
    assert rows["PP2"]["micro_batches"] == MICRO and rows["TP2 btp"]["micro_batches"] == 1
    base = rows["1 process"]["step_s"]
    for label, x in rows.items():
        assert x["step_s"] == sorted(x["times_s"])[len(x["times_s"]) // 2]
        assert x["speedup"] == pytest.approx(base / x["step_s"])
        assert x["tokens_per_s"] == pytest.approx(BATCH * SEQ / x["step_s"])
        if label != "1 process":
            assert x["x_of_perfect"] == pytest.approx(x["step_s"] / (base / 2))
    assert rows["1 process"]["speedup"] == 1.0 and rows["1 process"]["x_of_perfect"] is None
    md = r.markdown()
    assert "| PP2 (1F1B, 2 micro-batches) | 1 | 2 | 1 |" in md and "| speed-up over 1 process |" in md
    assert r.command.startswith("boost-bench pp --size tiny")
    assert (out / "pp.png").exists()

@pytest.mark.slow
def test_pp_bytes_per_rank(pp_tiny):
    _out, r = pp_tiny
    rows, boundary = r.data["rows"], r.data["boundary"]
    d = LlamaConfig.preset("tiny").dim
    mb = BATCH // MICRO
    # per micro-batch one activation [mb, s, width] fp32 out, its gradient back
    per_step = {width: 2 * MICRO * mb * SEQ * width * 4 for width in (d, d // 2)}
    assert boundary["btp"]["shape"] == [mb, SEQ, d // 2] and boundary["btp"]["stream_shards"] == 2
    assert boundary["megatron"]["shape"] == [mb, SEQ, d] and boundary["megatron"]["stream_shards"] == 1
    assert boundary["btp"]["step_bytes"] == per_step[d // 2]
    assert boundary["megatron"]["step_bytes"] == per_step[d]
    assert boundary["btp"]["step_bytes"] * 2 == boundary["megatron"]["step_bytes"]
    assert boundary["btp"]["of_megatron"] == 0.5
    # PP2 without TP sends the whole stream
    assert rows["PP2"]["comm"]["bytes"] == per_step[d] and rows["PP2"]["comm"]["count"] == 2 * MICRO
    # DP2: every gradient of the CoLA model once, fp32
    params = sum(p.numel() for p in Llama(LlamaConfig.preset("tiny")).parameters())
    assert rows["DP2"]["comm"] == {"kind": "all-reduce", "count": 1, "bytes": 4 * params}
    assert rows["TP2 btp"]["comm"]["count"] > 0 and rows["1 process"]["comm"]["bytes"] == 0
    [target] = r.targets
    assert target.value == 0.5 and target.met
