"""FSDP2's collectives on host memory (boost_compile/distributed/host_comms.py), over three gloo
processes, against gloo's own ``reduce_scatter_tensor`` and ``all_gather_into_tensor``.

The inputs are small integers in float32, so every sum is exact whatever its order: the results
must be bitwise equal. Each call is also measured: the process's address-space high-water mark
(``VmPeak``) may not grow by half the buffer (gloo's own collectives allocate about the buffer
again). glibc is told to hand large blocks back (as benchmarks/start_memory.py does): else its
retained heap, not the collective, sets the high-water mark.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 3
NUMEL = WORLD * 2**21  # 24 MiB of float32


def _vm_peak_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmPeak"))


def _worker(rank: int, store: str, out: str) -> None:
    from boost_compile.distributed.host_comms import InPlaceAllGather, InPlaceReduceScatter

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    group = dist.group.WORLD
    grads = torch.randint(-50, 50, (NUMEL,), generator=torch.Generator().manual_seed(rank)).float()
    reference_input = grads.clone()
    tiny = torch.ones(WORLD * 4)  # the first calls of each kind set up gloo's state, outside the measure
    InPlaceReduceScatter()(torch.empty(4), tiny, group, dist.ReduceOp.SUM)
    InPlaceAllGather()(tiny, tiny.view(WORLD, -1)[rank], group)
    # ours first: gloo's own collectives below may keep buffers that would blur the measure
    got = torch.empty(NUMEL // WORLD)
    before = _vm_peak_mib()
    InPlaceReduceScatter()(got, grads, group, dist.ReduceOp.SUM)
    rs_growth = _vm_peak_mib() - before

    # FSDP2's all-gather: this rank's shard already in its slice of the output
    whole = torch.full((NUMEL,), float("nan"))
    whole.view(WORLD, -1)[rank].copy_(got)
    before = _vm_peak_mib()
    InPlaceAllGather()(whole, whole.view(WORLD, -1)[rank], group)
    ag_growth = _vm_peak_mib() - before

    expected = torch.empty(NUMEL // WORLD)
    dist.reduce_scatter_tensor(expected, reference_input, group=group)
    reference = torch.empty(NUMEL)
    dist.all_gather_into_tensor(reference, got, group=group)
    result = {"reduce_scatter_equal": torch.equal(got, expected), "all_gather_equal": torch.equal(whole, reference),
              "growth_mib": [rs_growth, ag_growth], "buffer_mib": NUMEL * 4 / 2**20}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.extended  # make test's FSDP2 runs (test_train_fsdp.py) use these collectives, judged by parity
def test_in_place_collectives_equal_gloos_and_allocate_no_second_buffer(tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")  # read by each spawned interpreter's glibc
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(str(tmp_path / "store"), out), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        r = json.loads(open(f"{out}.{rank}").read())
        assert r["reduce_scatter_equal"] and r["all_gather_equal"], (rank, r)
        assert max(r["growth_mib"]) < r["buffer_mib"] / 2, (rank, r)
