"""Cold and warm first step of boost-train against depth: the whole model as one graph beside
per-block compilation (``passes.unit``).

Usage:
    python benchmarks/compile_depth.py [--layers 2 8 16 32] [--units model block] [--steps 10]
                                       [--extra OVERRIDE ...] [--json PATH]

Each job is ``boost-train model=cola-60m +model.overrides.n_layers=N passes.unit=U`` (batch
2 x 128, one thread, no checkpoints or evaluation) in a fresh process. Cold: an empty Inductor
cache (``TORCHINDUCTOR_CACHE_DIR``, a new folder per job). Warm: the same job again on the cache
the cold run left (a restart after a fault). The start (summary.json's ``setup_s``: building,
sharding and wrapping the model, where ``parallelize_`` captures the whole model under tp; plus
``first_step_s``: capture, compile and the step) and the steady step (median of the steps after
the third) are reported, with the ratios per block / whole model and N layers / 2 layers. A
second table gives the warm first step alone and that step less one steady step: what a restart
spends beyond the step's own compute, which grows with depth whatever compiles it.
``--extra`` adds overrides to every job (``parallel=tp2`` runs under torchrun with 2 ranks).

``--steady N``: instead, the steady forward+backward of the cola-60m model (its 32000-token
vocabulary) with N layers, whole and per block in one process, their steps interleaved (25
each, the median of the last 20): the two compiled forms side by side on the same machine state.
``--steady N --tp 2``: the same with both sharded with btp over two gloo processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from boost_compile.process_exit import exit_without_finalizing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(layers: int, unit: str, cache: Path, steps: int, extra: list[str], nproc: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="compile-depth-"))
    overrides = [
        "model=cola-60m", f"+model.overrides.n_layers={layers}", f"passes.unit={unit}",
        "trainer.batch=2", "trainer.seq=128", f"trainer.steps={steps}", "trainer.eval_every=0",
        "trainer.save_every=0", "checkpoint.enabled=false", "trainer.plot=false", "trainer.progress=none",
        "trainer.threads=1", "data.max_bytes=400000", *extra, f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
                     "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    proc = subprocess.run([*launcher, "-m", "boost_compile.train", *overrides], capture_output=True, text=True,
                          env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({layers} layers, unit {unit}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["step_s"] for r in rows if "step_s" in r and r.get("step", 0) > 3]
    shutil.rmtree(run_dir, ignore_errors=True)
    # the start: building, sharding (parallelize_'s captures under tp) and wrapping the model, then
    # the first step (capture, compile, run)
    start_s = summary.get("setup_s", 0.0) + summary["first_step_s"]
    return {"first_step_s": summary["first_step_s"], "setup_s": summary.get("setup_s", 0.0), "start_s": start_s,
            "steady_s": statistics.median(step_s) if step_s else None, "final_loss": summary["final_loss"]}


def steady_interleaved(layers: int, steps: int = 25, tp: int = 1) -> str:
    """The median step (s) of the whole model and of the per-block model, interleaved; ``tp=2``:
    both sharded with btp over two gloo processes (rank 0's medians)."""
    if tp == 1:
        med = _steady_medians(layers, steps, None)
    else:
        import torch.multiprocessing as mp

        folder = Path(tempfile.mkdtemp(prefix="steady-tp-"))
        mp.spawn(_steady_tp_worker, args=(tp, layers, steps, str(folder)), nprocs=tp, join=True)
        med = json.loads((folder / "medians.json").read_text())
        shutil.rmtree(folder, ignore_errors=True)
    return f"| {layers} | {med['model']:.3f} | {med['block']:.3f} | {med['block'] / med['model']:.3f}x |"


def _steady_tp_worker(rank: int, world: int, layers: int, steps: int, folder: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    med = _steady_medians(layers, steps, dist.group.WORLD)
    if rank == 0:
        (Path(folder) / "medians.json").write_text(json.dumps(med))
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)


def _steady_medians(layers: int, steps: int, group: object) -> dict[str, float]:
    import time

    import torch

    import boost_compile as bc
    from boost_compile.models import Llama, LlamaConfig

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    vocab = LlamaConfig.preset("cola-60m").vocab_size
    tokens, targets = (torch.randint(0, vocab, (2, 128), generator=gen) for _ in range(2))
    runs = {}
    for unit in ("model", "block"):
        torch.manual_seed(0)
        model = Llama(LlamaConfig.preset("cola-60m", n_layers=layers))
        if group is not None:
            bc.parallelize_(model, (tokens,), group, plan="btp")
        if unit == "block":
            bc.compile_blocks(model, {"inner": "inductor"})
            runs[unit] = (model, model)
        else:
            runs[unit] = (model, torch.compile(model, backend="boost", options={"inner": "inductor"}))
    times: dict[str, list[float]] = {unit: [] for unit in runs}
    for _ in range(steps):
        for unit, (model, fn) in runs.items():
            start = time.perf_counter()
            fn(tokens, targets).backward()
            model.zero_grad(set_to_none=True)
            times[unit].append(time.perf_counter() - start)
    return {unit: statistics.median(t[5:]) for unit, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 16, 32])
    parser.add_argument("--units", nargs="+", default=["model", "block"], choices=["model", "block"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--extra", nargs="*", default=[])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--steady", type=int, nargs="+", metavar="N", help="interleaved steady steps at N layers")
    parser.add_argument("--tp", type=int, default=1, help="--steady: shard both with btp over this many processes")
    args = parser.parse_args(argv)
    if args.steady:
        print("| layers | whole model (s) | per block (s) | per block / whole |\n|---:|---:|---:|---:|")
        for layers in args.steady:
            print(steady_interleaved(layers, tp=args.tp), flush=True)
        return 0
    nproc = 2 if any(e.startswith("parallel=") and e.split("=", 1)[1] in ("tp2", "dp2") for e in args.extra) else 1
    results: dict[str, dict] = {}
    for layers in args.layers:
        for unit in args.units:
            cache = Path(tempfile.mkdtemp(prefix="inductor-cache-"))
            cold = _job(layers, unit, cache, args.steps, args.extra, nproc)
            warm = _job(layers, unit, cache, args.steps, args.extra, nproc)
            shutil.rmtree(cache, ignore_errors=True)
            results[f"{unit}/{layers}"] = {"cold": cold, "warm": warm}
            print(f"{layers} layers, unit {unit}: cold {cold['start_s']:.1f} s (setup {cold['setup_s']:.1f} s), "
                  f"warm {warm['start_s']:.1f} s, "
                  f"steady {cold['steady_s']:.3f} s, loss {cold['final_loss']:.4f}", file=sys.stderr, flush=True)
    base = min(args.layers)
    print(f"cola-60m width, batch 2 x 128, one thread{', ' + ' '.join(args.extra) if args.extra else ''}: "
          "boost-train's start (setup + first step, s), its setup alone, and the steady step (s)\n")
    print("| layers | unit | cold start | (setup) | vs whole | vs 2 layers | warm start | vs 2 layers | steady step | vs whole |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layers in args.layers:
        for unit in args.units:
            r = results[f"{unit}/{layers}"]
            whole = results.get(f"model/{layers}")
            first = results[f"{unit}/{base}"]
            cold, warm = r["cold"]["start_s"], r["warm"]["start_s"]
            vs_whole = f"{cold / whole['cold']['start_s']:.2f}x" if whole else "-"
            steady_vs = f"{r['cold']['steady_s'] / whole['cold']['steady_s']:.2f}x" if whole else "-"
            print(f"| {layers} | {unit} | {cold:.1f} | {r['cold']['setup_s']:.1f} | {vs_whole} "
                  f"| {cold / first['cold']['start_s']:.2f}x | {warm:.1f} | {warm / first['warm']['start_s']:.2f}x "
                  f"| {r['cold']['steady_s']:.3f} | {steady_vs} |")
    # the warm first step holds one step of compute, which grows with depth whatever compiles
    # it: less one steady step, what is left is the restart's own work (capture, compile, loads)
    print("\nthe warm restart's first step (s), and that step less one steady step\n")
    print("| layers | unit | warm first step | vs 2 layers | steady step | first step - steady | vs 2 layers |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for layers in args.layers:
        for unit in args.units:
            warm, first = results[f"{unit}/{layers}"]["warm"], results[f"{unit}/{base}"]["warm"]
            rest, first_rest = (w["first_step_s"] - w["steady_s"] for w in (warm, first))
            print(f"| {layers} | {unit} | {warm['first_step_s']:.2f} | {warm['first_step_s'] / first['first_step_s']:.2f}x "
                  f"| {warm['steady_s']:.3f} | {rest:.2f} | {rest / first_rest:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
