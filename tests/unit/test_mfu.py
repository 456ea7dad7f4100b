"""Model FLOPs utilization: the FLOPs per token of a live model against a count by hand and
against the scale model, the peak of the run's dtype from the hardware file, and the ``mfu``
of boost-train's metric rows, summary and ``done:`` line.

Runs are tiny, as in test_train.py: preset tiny, a few steps of 4 x 32 bytes, eager.
"""

from __future__ import annotations

import importlib.resources
import json
import logging

import pytest
import torch
from conftest import METRICS_RUN, cfg_of

from boost_compile.costmodel import flops, scale_model
from boost_compile.costmodel.hardware import hardware_from_dict, load_hardware, peak_flops_for
from boost_compile.models import Llama
from boost_compile.train import run
from boost_compile.train.config import ModelConfig, TrainConfig
from boost_compile.train.utilization import device_peak, flops_per_token
from boost_compile.train.validate import model_shape

SEQ = 32


def hand_count(dim: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int,
               rank: int | None) -> float:
    """Training FLOPs of one token, written out: 6 per weight of every matmul (2 forward, 4 backward),
    and attention's two [seq, head_dim] products per head, half of them under the causal mask."""
    kv = kv_heads * (dim // heads)
    projections = [(dim, dim), (dim, kv), (dim, kv), (dim, dim), (dim, ffn), (dim, ffn), (ffn, dim)]
    weights = sum(d_in * d_out if rank is None else rank * (d_in + d_out) for d_in, d_out in projections)
    matmuls = layers * weights + dim * vocab  # the blocks and the output head; the embedding is a lookup
    scores_and_values = 2 * (2 * seq * dim) / 2  # per token and layer, forward: q.k and p.v over all heads, causal
    return 6 * matmuls + 3 * layers * scores_and_values


def meta_model(preset: str, **overrides) -> tuple[Llama, object]:
    """The preset's model on the meta device (shapes only) and its boost-train shape."""
    shape = model_shape(ModelConfig(preset=preset, overrides=overrides), SEQ)
    with torch.device("meta"):
        return Llama(shape.llama_config), shape


@pytest.mark.parametrize(("preset", "rank"), [("tiny-dense", None), ("tiny", 16)])
def test_flops_per_token_is_the_hand_count(preset, rank):
    model, shape = meta_model(preset)
    # tiny: dim 64, 2 layers, 4 heads of which 2 kv heads, ffn 176, vocab 256 (bytes), CoLA rank 16
    expected = hand_count(64, 2, 4, 2, 176, 256, SEQ, rank)
    assert flops_per_token(model, shape, SEQ) == pytest.approx(expected, rel=1e-12)
    assert flops_per_token(model, shape, 2 * SEQ) > flops_per_token(model, shape, SEQ)  # attention grows with seq


@pytest.mark.parametrize(("preset", "rank"), [("tiny-moe-dense", None), ("tiny-moe", 16)])
def test_a_mixture_of_experts_counts_the_experts_a_token_goes_through(preset, rank):
    """tiny-moe: each block's router (64 -> 4) and 2 of its 4 experts (gate, up 64 -> 88, down 88 -> 64)."""
    model, shape = meta_model(preset)
    dense_attention = hand_count(64, 2, 4, 2, 176, 256, SEQ, rank) - 6 * 2 * _mlp_weights(64, 176, rank)
    expert = _mlp_weights(64, 88, rank)
    expected = dense_attention + 6 * 2 * (64 * 4 + 2 * expert)
    assert flops_per_token(model, shape, SEQ) == pytest.approx(expected, rel=1e-12)


def _mlp_weights(dim: int, ffn: int, rank: int | None) -> int:
    return sum(d_in * d_out if rank is None else rank * (d_in + d_out) for d_in, d_out in ((dim, ffn), (dim, ffn), (ffn, dim)))


@pytest.mark.parametrize(("preset", "system"), [("llama-60m", "full-rank"), ("cola-60m", "btp"),
                                                ("cola-60m", "vanilla"), ("lowrank-60m", "btp"), ("lax-60m", "btp")])
def test_live_model_agrees_with_the_scale_model(preset, system):
    model, shape = meta_model(preset, vocab_size=32000)
    c = shape.llama_config
    assert c.n_kv_heads == c.n_heads and (c.rank_attn is None or c.rank_attn == c.dim // 4)  # the scale model's shape
    arch = "cola" if c.projection == "dense" else c.projection
    scale_shape = scale_model.Shape(preset, c.dim, c.ffn_dim, c.n_layers, c.n_heads, c.vocab_size, arch=arch)
    for seq in (SEQ, 1024):
        expected = flops.training_flops_per_token(scale_shape, system, seq)
        assert flops_per_token(model, shape, seq) == pytest.approx(expected, rel=1e-12)


def test_bundled_files_name_the_dtype_of_their_peak():
    assert peak_flops_for(load_hardware("cpu"), "fp32") == load_hardware("cpu").peak_flops
    assert peak_flops_for(load_hardware("cpu"), "bf16") is None
    for gpu in ("h200", "a100-80gb-nvlink"):
        assert peak_flops_for(load_hardware(gpu), "bf16") == load_hardware(gpu).peak_flops
        assert peak_flops_for(load_hardware(gpu), "fp32") is None


def unnamed_hardware(tmp_path, **extra):
    """The cpu file with a peak whose note and description name no dtype (plus ``extra`` keys)."""
    data = json.loads(importlib.resources.files("boost_compile").joinpath("hardware", "cpu.json").read_text())
    data["peak_flops"] = {"value": 1e12, "source": "somebody's number"}
    data["description"] = "a device"
    data.pop("peak_dtype", None)  # the bundled file says it; this one must not
    data.update(extra)
    path = tmp_path / "device.json"
    path.write_text(json.dumps(data))
    return data, path


def test_a_peak_of_no_named_dtype_gives_no_peak(tmp_path):
    data, path = unnamed_hardware(tmp_path)
    assert hardware_from_dict(data).peak_dtype == ""
    tc = TrainConfig()
    tc.parallel.hardware = str(path)
    peak, why = device_peak(tc, "cpu")
    assert peak is None and str(path) in why
    data, path = unnamed_hardware(tmp_path, peak_dtype="FP32")  # said explicitly
    assert device_peak(tc, "cpu")[0] == 1e12
    with pytest.raises(ValueError, match="peak_dtype"):
        hardware_from_dict({**data, "peak_dtype": "fp33"})


def cpu_peak() -> float:
    """One device's fp32 peak as the bundled cpu file writes it."""
    data = json.loads(importlib.resources.files("boost_compile").joinpath("hardware", "cpu.json").read_text())
    return float(data["peak_flops"]["value"])


def test_a_run_reports_mfu_in_rows_summary_and_done_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="boost_compile.train"):
        result = run(cfg_of(*METRICS_RUN), tmp_path)
    assert result["status"] == "completed" and result["world"] == 1
    fpt = hand_count(64, 2, 4, 2, 176, 256, SEQ, 16)  # preset tiny (CoLA), trainer=quick's seq 32
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 4 and all("mfu" in r for r in steps) and not any("mfu" in r for r in rows if "val_loss" in r)
    for r in steps:
        assert r["mfu"] == pytest.approx(fpt * r["tokens_per_s"] / (1 * cpu_peak()), rel=1e-9)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mfu"] == pytest.approx(fpt * summary["tokens_per_s"] / cpu_peak(), rel=1e-9)
    assert 0 < summary["mfu"] < 1
    done = [m for m in caplog.messages if m.startswith("done: ")]
    assert len(done) == 1 and f" mfu={summary['mfu']:.2%} " in done[0]


def test_no_known_peak_gives_no_mfu_and_one_line(tmp_path, caplog):
    # the cpu file's peak is fp32: a bf16 run has none to divide by
    with caplog.at_level(logging.INFO, logger="boost_compile.train"):
        result = run(cfg_of(*METRICS_RUN, "trainer.steps=2", "trainer.eval_every=0", "trainer.precision=bf16-mixed"),
                     tmp_path)
    assert result["status"] == "completed"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows and all("tokens_per_s" in r and "mfu" not in r for r in rows if "loss" in r)
    assert json.loads((tmp_path / "summary.json").read_text())["mfu"] is None
    lines = [m for m in caplog.messages if m.startswith("mfu: ")]
    assert len(lines) == 1 and "not reported" in lines[0] and "fp32" in lines[0] and "bf16" in lines[0]
    assert " mfu=" not in next(m for m in caplog.messages if m.startswith("done: "))
