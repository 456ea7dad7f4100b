"""What the checksums in ``complete.json`` cost a checkpoint save, and which digest to take.

    python benchmarks/bench_checkpoint_checksum.py [--model cola-60m] [--rounds 3] [--hash-mb 200]

Two parts, in one process:

- **digests**: sha256 and blake2b (hashlib) over a ``--hash-mb`` MB file of random bytes, read
  1, 4 and 8 MiB at a time as boost-train reads a checkpoint file (best of 3 reads; the file is
  in the page cache, so this is the digest's speed, not the disk's). The faster one is
  boost-train's ``CHECKSUM``.
- **saves**: the state a ``--model`` run checkpoints (its weights and AdamW's two moments, random,
  float32) saved with DCP into a temporary folder and marked complete, as
  ``Checkpointer.save`` does: **no checksum** (the baseline: DCP's FileSystemWriter and a
  record of sizes only, as before checksums), **sha256** and **blake2b** (``ChecksumWriter``
  digesting the shard it wrote, then the record with every file's digest), and **verify**
  (what resuming adds: every file read back and digested, ``checksum_problem``). The modes
  alternate for ``--rounds`` rounds; each figure is the best round. GB/s is the checkpoint's
  bytes over the time; the ratio is against the no-checksum save.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from boost_compile.models import Llama, LlamaConfig
from boost_compile.train.checkpoint import (
    CHECKSUM_CHUNK,
    ChecksumWriter,
    checksum_problem,
    file_checksum,
    write_record,
)

#: the row of what resuming adds (not a save)
VERIFY = "verify on resume (sha256, read back)"


def cpu_description() -> str:
    """The CPU's model name and its widest vector unit, from /proc/cpuinfo (its first processor)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    vector = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    sha = ", SHA extensions" if "sha_ni" in flags else ""
    return f"{fields.get('model name', platform.machine())} ({vector}{sha}), {os.cpu_count()} cores"


def model_state(preset: str) -> dict[str, dict[str, torch.Tensor]]:
    """A run's checkpointed tensors for ``preset``: weights and AdamW's two moments (random)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset(preset))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moments = {f"{k}.{m}": torch.randn_like(v) for k, v in weights.items() for m in ("exp_avg", "exp_avg_sq")}
    return {"model": weights, "optim": moments}


def time_digests(folder: Path, megabytes: int) -> dict[tuple[str, int], float]:
    """Seconds per digest of a ``megabytes`` MB file: (algorithm, chunk MiB) -> best of 3."""
    path = folder / "random.bin"
    with open(path, "wb") as f:
        for _ in range(megabytes):
            f.write(os.urandom(1_000_000))
    out = {}
    for algorithm in ("sha256", "blake2b"):
        for mib in (1, 4, 8):
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                file_checksum(path, algorithm, chunk=mib << 20)
                best = min(best, time.perf_counter() - start)
            out[(algorithm, mib)] = best
    path.unlink()
    return out


def save_plain(state: dict, path: Path) -> None:
    dcp.save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    write_record(path, 1, algorithm=None)


def save_digested(algorithm: str) -> Callable[[dict, Path], None]:
    def save(state: dict, path: Path) -> None:
        writer = ChecksumWriter(str(path), algorithm=algorithm)
        dcp.save(state, storage_writer=writer, no_dist=True)
        write_record(path, 1, writer.checksums, algorithm=algorithm)

    return save


def time_saves(state: dict, folder: Path, rounds: int) -> tuple[dict[str, float], int]:
    """Best seconds per mode, and the checkpoint's bytes."""
    modes = {"no checksum": save_plain, "sha256": save_digested("sha256"), "blake2b": save_digested("blake2b")}
    best = {name: float("inf") for name in [*modes, VERIFY]}
    size = 0
    for i in range(rounds):
        for name, save in modes.items():
            path = folder / f"step_{i}_{name.replace(' ', '_')}"
            start = time.perf_counter()
            save(state, path)
            best[name] = min(best[name], time.perf_counter() - start)
            size = sum(f.stat().st_size for f in path.iterdir() if f.name != "complete.json")
            if name == "sha256":
                start = time.perf_counter()
                assert checksum_problem(path) is None
                best[VERIFY] = min(best[VERIFY], time.perf_counter() - start)
            shutil.rmtree(path)
    return best, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cola-60m", help="a LlamaConfig preset (default cola-60m)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hash-mb", type=int, default=200, help="the size of the digests' file, MB (default 200)")
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        digests = time_digests(Path(tmp), args.hash_mb)
        state = model_state(args.model)
        saves, size = time_saves(state, Path(tmp), args.rounds)
    print(f"\n{cpu_description()}; {platform.python_implementation()} {platform.python_version()}, "
          f"torch {torch.__version__}\n")
    print(f"digest of a {args.hash_mb} MB file (page cache), best of 3; boost-train reads "
          f"{CHECKSUM_CHUNK >> 20} MiB at a time:\n")
    print("| digest | chunk | s | GB/s |")
    print("|---|---:|---:|---:|")
    for (algorithm, mib), seconds in digests.items():
        print(f"| {algorithm} | {mib} MiB | {seconds:.3f} | {args.hash_mb / 1000 / seconds:.2f} |")
    base = saves["no checksum"]
    print(f"\n{args.model} weights + AdamW moments, float32: a {size / 1e6:.0f} MB checkpoint "
          f"(one DCP shard + .metadata), best of {args.rounds} rounds; ratio against the no-checksum save:\n")
    print("| save | s | GB/s | vs no checksum |")
    print("|---|---:|---:|---:|")
    for name, seconds in saves.items():
        print(f"| {name} | {seconds:.3f} | {size / 1e9 / seconds:.2f} | {seconds / base:.2f}x |")


if __name__ == "__main__":
    main()
