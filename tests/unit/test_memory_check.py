"""The start in the planner and the check before the build.

- ``plan.memory.start_memory``: built on meta a rank holds its FSDP2 slices (about 1/n of the
  weights), built whole (TP, ``--init global_rng``) the whole model in fp32 and its shard;
- a planner row fits only when its start does too;
- boost-train under an address-space cap (RLIMIT_AS) that cannot hold the layout refuses before the
  build, in one line naming what it needs and has; ``parallel.check_memory=false`` skips it.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import FAST

from boost_compile.costmodel.hardware import load_hardware
from boost_compile.plan.memory import BUILD_BYTES, GIB, MATERIALISE_ELEMENTS, start_memory
from boost_compile.plan.model import from_preset
from boost_compile.plan.search import Job, Layout, price


def test_built_on_meta_a_rank_holds_its_slices_built_whole_the_model():
    spec = from_preset("llama-350m")
    weights = spec.num_params() * BUILD_BYTES
    one = start_memory(spec, "megatron", tp=1, pp=1, dp_shard=1)
    fsdp8 = start_memory(spec, "megatron", tp=1, pp=1, dp_shard=8)
    at_once = sum(MATERIALISE_ELEMENTS) * BUILD_BYTES  # a row group and a block (the embedding is larger)
    assert one == pytest.approx(weights + at_once, rel=1e-6)
    assert fsdp8 == pytest.approx(weights / 8 + at_once, rel=0.01)  # slices round up
    # a tiny model's row group and block are its largest tensor at most
    tiny = from_preset("tiny")
    largest = max(t.numel for t in tiny.tensors())
    assert start_memory(tiny, "btp", tp=1, pp=1, dp_shard=1) == (tiny.num_params() + 2 * largest) * BUILD_BYTES
    # a TP x FSDP2 rank its slices of its TP shards; built whole (global_rng), the whole model first
    assert start_memory(spec, "megatron", tp=2, pp=1, dp_shard=2) == pytest.approx(weights / 4 + at_once, rel=0.06)
    assert start_memory(spec, "megatron", tp=1, pp=1, dp_shard=8, on_meta=False) > weights
    # factorized by SVD on meta: one dense weight and its decomposition beside the rank's share
    from boost_compile.plan.memory import SVD_COPIES
    from boost_compile.plan.model import factorized, largest_block_tensor

    low = factorized(spec, 256)
    dense = largest_block_tensor(spec)
    assert start_memory(low, "btp", tp=2, pp=1, dp_shard=2, svd_elements=dense) - \
        start_memory(low, "btp", tp=2, pp=1, dp_shard=2) == dense * BUILD_BYTES * SVD_COPIES
    # a pipeline rank its stage (about half of the blocks)
    assert start_memory(spec, "megatron", tp=1, pp=2, dp_shard=1) < 0.6 * weights


def test_a_layout_fits_only_when_its_start_does():
    spec = from_preset("llama-350m")
    layout = Layout(tp=1, pp=1, dp=1, dp_shard=8)
    job = Job(spec, 8, 64, 8, 8, load_hardware("cpu"), 64 * GIB)
    row = price(job, layout)
    assert row.fits and row.start_gib < row.memory_gib
    whole = price(replace(job, on_meta=False), layout)
    assert whole.start_gib > whole.memory_gib  # the whole fp32 model on every rank, before it is sharded
    between = (row.memory_gib + whole.start_gib) / 2 * GIB
    assert price(replace(job, memory_bytes=between), layout).fits
    assert not price(replace(job, memory_bytes=between, on_meta=False), layout).fits


def _capped_train(args: list[str], headroom_gib: float) -> subprocess.CompletedProcess:
    """boost-train in a child whose address space may grow ``headroom_gib`` past this process's."""
    from boost_compile.train.metrics import address_space_bytes

    cap = address_space_bytes() + int(headroom_gib * GIB)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))

    return subprocess.run([sys.executable, "-m", "boost_compile.train", *args], capture_output=True, text=True,
                          preexec_fn=limit, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the address space is read from /proc")
def test_a_layout_the_cap_cannot_hold_is_refused_before_the_build(tmp_path):
    args = [*FAST, "model.preset=llama-350m", "passes=none", f"hydra.run.dir={tmp_path}"]
    proc = _capped_train(args, headroom_gib=1.0)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("boost-train: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "llama-350m does not fit: tp1 dp1 ckpt=none needs about" in errors[0]
    assert "RLIMIT_AS" in errors[0] and "parallel.check_memory=false" in errors[0]
    assert "materialised" not in proc.stderr + proc.stdout  # refused before the build
