"""Scenarios run on every rank of a gloo group that a test fixture spawns; rank 0 writes the
ranks' results, one dict each, as JSON for the test to read."""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from boost_compile.process_exit import exit_without_finalizing


def spawn_scenarios(worker: Callable[..., None], world: int, scenarios: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """Start ``worker(rank, world, store, scenarios, result_path)`` on ``world`` processes; the ranks' results."""
    store, out = str(folder / "store"), folder / "results.json"
    mp.spawn(worker, args=(world, store, scenarios, str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())  # one dict per rank


def per_rank(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Scenario ``name``'s result on every rank (failing with a rank's traceback where it raised)."""
    for r in results:
        assert "error" not in r[name], r[name].get("error")
    return [r[name] for r in results]


def run_on_gloo(rank: int, world: int, store: str, scenarios: list[dict[str, Any]], result_path: str,
                run: Callable[[dict[str, Any]], dict[str, Any]], timeout_s: int = 120) -> None:
    """Join the gloo group of ``world`` ranks at ``store`` (a collective that waits past ``timeout_s``
    fails instead of hanging the other rank), one intra-op thread, then :func:`run_scenarios`."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)
    run_scenarios(rank, world, scenarios, result_path, run)


def run_scenarios(rank: int, world: int, scenarios: list[dict[str, Any]], result_path: str,
                  run: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """``run`` each scenario on this rank (an exception becomes its ``error``), gather every rank's
    results on rank 0, write them and leave the process group."""
    results: dict[str, Any] = {}
    for sc in scenarios:
        try:
            results[sc["name"]] = run(sc)
        except Exception:  # noqa: BLE001 - reported to the test
            results[sc["name"]] = {"error": traceback.format_exc()}
            print(f"rank {rank}, scenario {sc['name']}:", results[sc["name"]]["error"], file=sys.stderr, flush=True)
        torch._dynamo.reset()
        dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)
