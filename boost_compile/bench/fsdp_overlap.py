"""When FSDP2's collectives are issued against the blocks' compute, read from a profile.

Usage:
    python -m boost_compile.bench.fsdp_overlap [--ranks 2] [--layers 4] [--preset tiny] [--no-prefetch] [--json PATH]

Each rank (gloo on CPU, one thread) builds the model, compiles its blocks one by one with the
boost backend (inner aot_eager) and shards it as boost-train does (``train/fsdp.py``: a unit per
block, the embedding, the norm with the head, the root; the next unit prefetched). Two steps warm
up; the third runs under ``torch.profiler``. From rank 0's FSDP2 ranges (``FSDP::pre_forward
(layers.1)``, ``FSDP::all_gather (layers.2)``, ``FSDP::post_backward_reduce (layers.3)``, ...) it
prints each unit's forward and backward with the issue times of its all-gathers and reduce-scatter,
in ms from the step's start, and two verdicts:

- forward: the all-gather of block i+1 is issued before block i's forward ends (``prefetch``);
- backward: the first reduce-scatter is issued before the backward ends (while blocks below still
  run theirs).

``--no-prefetch`` (the baseline) leaves FSDP2's forward to gather each unit when it starts.
Issue order is what the profile shows exactly; how much of a gather's time a block's compute hides
on gloo's CPU threads is the machine's, and is printed, not judged.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

_RANGE = re.compile(r"^FSDP::(\w+) \((.+)\)$")


@dataclass
class Range:
    """One FSDP2 range of the profile: what it is, the unit it is for, start and end in ms."""

    kind: str
    unit: str
    start: float
    end: float


def fsdp_ranges(events: Any) -> list[Range]:
    """The ``FSDP::<kind> (<unit>)`` ranges of a profile's events, in ms from the first of them."""
    found = []
    for e in events:
        m = _RANGE.match(e.name)
        if m is not None:
            found.append((m.group(1), m.group(2), e.time_range.start / 1e3, e.time_range.end / 1e3))
    t0 = min((s for _, _, s, _ in found), default=0.0)
    return sorted((Range(k, u, s - t0, e - t0) for k, u, s, e in found), key=lambda r: r.start)


def first(ranges: list[Range], kind: str, unit: str) -> Range | None:
    return next((r for r in ranges if r.kind == kind and r.unit == unit), None)


def verdicts(ranges: list[Range], blocks: list[str]) -> dict[str, Any]:
    """Whether each next block's gather is issued inside this block's forward, and the first
    reduce-scatter before the backward ends; with the times they rest on."""
    forward = []
    for here, after in zip(blocks, blocks[1:], strict=False):
        ends = first(ranges, "post_forward", here)
        gather = first(ranges, "all_gather", after)
        forward.append({"block": here, "forward_end_ms": ends.start if ends else None,
                        "next": after, "next_gather_issued_ms": gather.start if gather else None,
                        "prefetched": bool(ends and gather and gather.start < ends.start)})
    reduces = [r for r in ranges if r.kind == "post_backward_reduce"]
    last_backward = max((r.end for r in ranges if r.kind in ("post_backward_reduce", "pre_backward")), default=None)
    first_reduce = reduces[0] if reduces else None
    lowest = first(ranges, "pre_backward", blocks[0])  # the backward of the first block: the last to run
    backward = {"first_reduce_scatter": first_reduce.unit if first_reduce else None,
                "first_reduce_scatter_issued_ms": first_reduce.start if first_reduce else None,
                "first_block_backward_starts_ms": lowest.start if lowest else None,
                "backward_ends_ms": last_backward,
                "issued_before_backward_ends": bool(first_reduce and lowest and first_reduce.start < lowest.start)}
    return {"forward": forward, "all_prefetched": all(f["prefetched"] for f in forward), "backward": backward}


def _rank(rank: int, world: int, folder: str, preset: str, layers: int, prefetch: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    import boost_compile as bc
    from boost_compile.models import Llama, LlamaConfig
    from boost_compile.train.fsdp import shard_model

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset(preset, n_layers=layers))
    tokens = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(rank))
    blocks = bc.compile_blocks(model, {"inner": "aot_eager"})
    units = shard_model(model, init_device_mesh("cpu", (world,)), "fp32", reshard_after_forward=True)
    if not prefetch:
        for unit in units:
            model.get_submodule(unit[0]).set_modules_to_forward_prefetch([])
    for _ in range(2):
        model(tokens, tokens).backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(tokens, tokens).backward()
    if rank == 0:
        ranges = fsdp_ranges(prof.events())
        out = {"ranks": world, "preset": preset, "layers": layers, "blocks": blocks, "prefetch": prefetch,
               "verdicts": verdicts(ranges, blocks), "ranges": [asdict(r) for r in ranges]}
        with open(os.path.join(folder, "rank0.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(ranks: int = 2, preset: str = "tiny", layers: int = 4, prefetch: bool = True) -> dict[str, Any]:
    import torch.multiprocessing as mp

    folder = tempfile.mkdtemp(prefix="fsdp-overlap-")
    mp.spawn(_rank, args=(ranks, folder, preset, layers, prefetch), nprocs=ranks, join=True)
    with open(os.path.join(folder, "rank0.json")) as f:
        return json.load(f)


def show(result: dict[str, Any]) -> str:
    lines = [f"FSDP2 over {result['ranks']} gloo ranks, {result['preset']} with {result['layers']} layers, "
             f"{'' if result['prefetch'] else 'no '}forward prefetch, rank 0, ms from the step's first FSDP2 range",
             "", "| range | unit | start | end |", "|---|---|---:|---:|"]
    wanted = ("pre_forward", "post_forward", "all_gather", "pre_backward", "post_backward_reduce")
    lines += [f"| {r['kind']} | {r['unit']} | {r['start']:.2f} | {r['end']:.2f} |" for r in result["ranges"]
              if r["kind"] in wanted]
    v = result["verdicts"]
    lines.append("")
    for f in v["forward"]:
        lines.append(f"forward: {f['next']}'s all-gather issued at {f['next_gather_issued_ms']:.2f} ms, {f['block']}'s "
                     f"forward ends at {f['forward_end_ms']:.2f} ms: {'prefetched' if f['prefetched'] else 'NOT prefetched'}")
    b = v["backward"]
    lines.append(f"backward: the first reduce-scatter ({b['first_reduce_scatter']}) issued at "
                 f"{b['first_reduce_scatter_issued_ms']:.2f} ms, {result['blocks'][0]}'s backward starts at "
                 f"{b['first_block_backward_starts_ms']:.2f} ms, the backward ends at {b['backward_ends_ms']:.2f} ms: "
                 f"{'before the backward ends' if b['issued_before_backward_ends'] else 'NOT before the backward ends'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--no-prefetch", action="store_true", help="the baseline: no forward prefetch")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = measure(args.ranks, args.preset, args.layers, not args.no_prefetch)
    print(show(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
