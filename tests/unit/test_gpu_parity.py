"""backend="boost" on CUDA computes eager's numbers: the whole compiled path on a GPU.

The CPU suite proves the passes; on a GPU what else runs is Inductor's Triton code for the
grouped GEMMs and the online RMSNorm custom op, bf16 on tensor cores and the low-rank
checkpoint partitioner. Each case runs one forward and backward eagerly, in float64 (the truth)
and compiled with Inductor under boost, and applies the suite's parity rule (conftest) to the
loss and every gradient; it also checks the rewrite happened (one graph, the RMSNorm sites
rewritten, recomputation under ``checkpoint=lowrank``).

Skipped without CUDA. ``BOOST_TEST_DEVICE=cpu`` runs them on the CPU instead (the dry run of
``benchmarks/gpu_check.sh`` with ``DEVICE=cpu``); a 20-step boost-train run closes the file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import check_against_eager, check_recorded_compile, tiny_hf_llama, upcast
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config

from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig, FactorizeConfig
from boost_compile.factorize import factorize_
from boost_compile.models import Llama, LlamaConfig

DEVICE = os.environ.get("BOOST_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BATCH, SEQ, VOCAB = 2, 32, 256
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
CHECKPOINTS = ["none", "lowrank"]


@contextlib.contextmanager
def no_caches():
    """A cache hit would skip the partitioner whose report the checkpoint cases read."""
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def _tokens(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(DEVICE)


def _reference(preset: str, dtype: torch.dtype) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset(preset)).to(DEVICE, dtype)


def _hf_llama_lowrank(dtype: torch.dtype) -> torch.nn.Module:
    """A tiny Hugging Face Llama made low-rank by factorize_ (CoLA's silu bottleneck, r = d/4)."""
    model = tiny_hf_llama()
    factorize_(model, FactorizeConfig(rank_ratio=0.25, init="random", activation="silu"))
    return model.to(DEVICE, dtype)


def _compile_recorded(model: torch.nn.Module, checkpoint: str):
    rec = Recorder(keep_view=False)
    # on the CPU dry run the RMSNorm rewrite is asked for on the CPU too (its default is CUDA only)
    norm = {} if DEVICE == "cuda" else {"rmsnorm": {"devices": [DEVICE]}}
    config = BoostConfig.from_options({"inner": "inductor", "checkpoint": checkpoint, **norm})
    backend = functools.partial(compile_graph, config=config, recorder=rec)
    return torch.compile(model, backend=backend, fullgraph=True), rec


def _check(model: torch.nn.Module, checkpoint: str, loss_fn, inputs):
    with no_caches():
        graph = check_recorded_compile(model, lambda m: _compile_recorded(m, checkpoint), loss_fn, inputs)
    (norms,) = [r for r in graph.reports if r.name == "rmsnorm"]
    assert norms.rewritten, "the RMSNorm rewrite found no site"
    recomputed = [r.details.get("recomputed") for r in graph.partition_reports]
    if checkpoint == "lowrank":
        assert any(recomputed), "checkpoint=lowrank recomputed nothing"
    return graph


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny", "tiny-lax"])  # "tiny" is CoLA
def test_reference_model_parity(preset: str, dtype: torch.dtype, checkpoint: str) -> None:
    if preset == "tiny-dense" and checkpoint == "lowrank":
        pytest.skip("a dense model has no bottleneck to checkpoint")
    tokens, targets = _tokens(0), _tokens(1)
    _check(_reference(preset, dtype), checkpoint, lambda loss: loss, (tokens, targets))


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_llama_factorized_parity(dtype: torch.dtype, checkpoint: str) -> None:
    tokens = _tokens(0)
    model = _hf_llama_lowrank(dtype)
    _check(model, checkpoint, lambda out: torch.nn.functional.cross_entropy(
        upcast(out.logits).flatten(0, 1), tokens.flatten()), (tokens,))


def test_bf16_autocast_parity() -> None:
    """fp32 weights under bf16 autocast (boost-train's bf16-mixed): the rule for bf16."""
    from conftest import assert_parity, grads, step_errors

    tokens, targets = _tokens(0), _tokens(1)
    model = _reference("tiny", torch.float32)
    truth = _reference("tiny", torch.float64)
    truth.load_state_dict(model.state_dict())
    tested = _reference("tiny", torch.float32)
    tested.load_state_dict(model.state_dict())
    with no_caches():
        compiled, _rec = _compile_recorded(tested, "lowrank")
        runs = []
        for m, autocast in ((model, True), (truth, False), (compiled, True)):
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
                loss = m(tokens, targets)
            loss.backward()
            runs.append(loss.detach())
    errors = step_errors((runs[2], grads(tested)), (runs[0], model), (runs[1], truth))
    assert_parity(errors, torch.bfloat16, "bf16 autocast")


def test_reduce_overhead_parity() -> None:
    """``torch.compile(mode="reduce-overhead")``: Inductor's CUDA graphs under boost, on the tiny
    CoLA model. Two steps first (warm-up, then recording), so the checked step replays the
    graphs; the parity rule on its loss and gradients. On the CPU dry run Inductor skips the
    graphs (nothing to capture there) and the same step runs its plain kernels."""
    from torch._dynamo.utils import counters

    tokens, targets = _tokens(0), _tokens(1)

    def compile_warmed(model: torch.nn.Module):
        compiled = torch.compile(model, backend="boost", mode="reduce-overhead", fullgraph=True)
        for _ in range(2):
            torch.compiler.cudagraph_mark_step_begin()
            compiled(tokens, targets).backward()
            model.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        return compiled

    counters.clear()
    with no_caches():
        check_against_eager(_reference("tiny", torch.float32), compile_warmed, lambda m, _x: m(tokens, targets),
                            what="mode=reduce-overhead")
    skips = counters["inductor"]["cudagraph_skips"]
    if DEVICE == "cuda":
        from torch._inductor import cudagraph_trees

        assert skips == 0, f"Inductor skipped the CUDA graphs {skips} time(s) (TORCH_LOGS=perf_hints says why)"
        assert cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager is not None, "no CUDA graph tree"
    else:
        assert skips > 0, "the mode's triton.cudagraphs=True did not reach Inductor"


def test_boost_train_twenty_steps(tmp_path: Path) -> None:
    """boost-train's smoke run (20 steps, bf16-mixed, the boost backend) on the device."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "boost_compile.train", "trainer=quick", f"trainer.device={DEVICE}",
           "trainer.precision=bf16-mixed", "trainer.plot=false", "trainer.progress=none",
           "trainer.save_every=0", "data.max_bytes=200000", f"hydra.run.dir={tmp_path}"]
    # run from tmp_path: a checkout's boost_compile/ in the working folder lacks passes/
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 20, summary
    losses = summary["losses"]
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses))), losses
    assert summary["final_loss"] < summary["first_loss"], f"the loss did not fall in 20 steps: {losses}"
    log = (tmp_path / "train.log").read_text()
    assert f"device={DEVICE}" in log and "backend=boost(inner=inductor)" in log, log[:2000]
