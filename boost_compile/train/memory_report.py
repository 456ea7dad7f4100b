"""``trainer.memory_report``: the memory of a training step, measured term by term on each rank.

Every rank writes ``memory_rank{R}.json`` into the run folder (bytes, integers), the
figures a layout planner predicts, measured on the real run:

- ``params``, ``grads``, ``optimizer``: the rank's local tensors (a DTensor's
  ``to_local()``) after the first step, with gradients and AdamW state all live
  (:func:`~boost_compile.train.optim.state_bytes`, the Trainer's ``state``);
- ``dp_buckets``: DDP's gradient buckets (``dp > 1`` without pipeline stages), the
  bucket tensors of DDP's reducer; 0 otherwise (a pipeline averages its gradients
  over dp through a transient flat buffer per dtype, which only the peak sees);
- ``saved_activations``: what the compiled forward hands to the backward, per
  micro-batch, summed over this rank's compiled graphs (every stage it holds): read
  from the partitioned graphs (``passes.saved_tensors.activation_bytes``: activations
  and kept generator states, each storage once, parameters and inputs excluded);
  ``saved_by_block`` splits it by block ("-": outside the blocks: embedding, final
  norm, head and loss; a pipeline's loss runs outside the stage graphs, in the
  schedule, so there the peak sees its saved tensors and this does not). Needs
  ``passes.backend=boost``; else null; ``saved_per_graph``: the same per partitioned
  graph; ``graphs``: the graphs compiled (evaluation's inference graphs among them,
  which save nothing); ``compile_unit``: ``model``, or ``block`` under FSDP2
  (``parallel.dp_shard > 1``), which keeps the blocks compiled one by one (it shards
  them so). Then one graph may run for many blocks, and the names in a block's graph
  are the block's own: ``saved_by_block`` is null, ``saved_per_graph`` the bytes one
  call of each graph saves, ``graph_calls`` each graph's calls in the profiled step
  (counted around its compiled forward), ``forwards`` the model's forwards there (its
  micro-steps; none with pipeline stages, whose schedule calls the stages, so there
  ``saved_activations`` is null and the per-graph figures stand), and ``saved_activations`` the sum of bytes times calls per forward: the
  blocks' saved tensors, not those of the embedding, final norm, head and loss, which
  run eagerly (the peak sees them). ``saved_inputs`` (and ``saved_inputs_per_graph``)
  is the same for the graph inputs a block keeps that are not parameters: its input,
  which the block before it made (whole-model graphs count it among the activations),
  and tensors every block reads, such as rotary tables, once per call though shared;
- ``peak``: the most tensor bytes live during one whole step (forward, backward,
  optimizer), the last step of the run, after the compiling ones: ``baseline`` (the
  bytes live as the step starts, by tensor accounting: ``baseline_terms``, params,
  the gradients then allocated (none: they are freed after each step), optimizer
  state, dp buckets) plus ``peak_above_start``, the maximum of the running sum of
  the step's allocations and frees, in time order, from a memory profile
  (``torch.profiler`` with ``profile_memory=True``; it sees every tensor PyTorch's
  allocator makes, Inductor's buffers and FSDP2's gathered weights and reduce-scatter
  buffers included, not the scratch memory of BLAS or oneDNN).
  ``end_above_start`` is that sum at the step's end (near 0 when nothing else stays
  alive; under gloo a collective's buffer freed on gloo's own thread is a free the
  profile does not see: a few such buffers, which may also sit in the peak);
  ``compiled_during_profile``: graphs the boost backend compiled
  inside the profiled step (0 unless the run has a single step or recompiles: the
  compiler's own tensors would then be in the peak). null without a profiled step
  (a run stopped early).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from boost_compile import _torch_compat as compat
from boost_compile.backend import Recorder
from boost_compile.train.optim import state_bytes

log = logging.getLogger("boost_compile.train")

REPORT_FILE = "memory_rank{rank}.json"


def recording_backend(backend: Callable[..., Any], recorder: Recorder) -> Callable[..., Any]:
    """``backend`` (which records each graph into ``recorder``) run with the compile caches off
    (``compat.NO_COMPILE_CACHES``: a cache hit would skip the partitioner, and with it the report of
    what the forward saves), each compiled forward counting its calls in its record's ``calls``:
    blocks compiled one by one may run one graph for many blocks."""

    @functools.wraps(backend)  # blocks.py reads the boost backend's settings through the wrapper
    def compile_recording(gm: Any, example_inputs: Sequence[Any]) -> Any:
        before = len(recorder.graphs)
        with compat.compile_settings(**compat.NO_COMPILE_CACHES):
            compiled = backend(gm, example_inputs)
        if len(recorder.graphs) == before:
            return compiled
        record = recorder.graphs[before]

        def counted(*args: Any) -> Any:
            record.calls += 1
            return compiled(*args)

        if getattr(compiled, "_boxed_call", False):  # Dynamo then calls it with one list: passed on as it is
            counted._boxed_call = True  # type: ignore[attr-defined]
        return counted

    return compile_recording


def peak_of(records: Sequence[tuple[int, int, str]], device: str) -> tuple[int, int]:
    """(maximum, final value) of the running sum of ``device``'s allocator records (time order)."""
    kinds = compat.HOST_MEMORY_DEVICES if device == "cpu" else {device}
    running = peak = 0
    for _start, nbytes, kind in records:
        if kind in kinds:
            running += nbytes
            peak = max(peak, running)
    return peak, running


def saved_bytes(recorder: Recorder) -> tuple[dict[str, int], list[int]]:
    """Saved activation bytes per block over every partitioned graph of ``recorder``, and per graph."""
    from boost_compile.passes.saved_tensors import activation_bytes

    by_block: dict[str, int] = {}
    per_graph: list[int] = []
    for graph in recorder.graphs:
        for report in graph.partition_reports:
            blocks = activation_bytes(report)
            per_graph.append(sum(blocks.values()))
            for block, n in blocks.items():
                by_block[block] = by_block.get(block, 0) + n
    return by_block, per_graph


def saved_per_call(recorder: Recorder, calls: Sequence[int], forwards: int) -> dict[str, Any]:
    """Blocks compiled one by one: each graph's saved bytes per call (what it makes, and the inputs it
    keeps that are no parameter), its calls in the profiled step, and their products summed over the
    graphs per model forward (a micro-batch)."""
    from boost_compile.passes.saved_tensors import activation_bytes, saved_input_bytes

    per_graph = [sum(sum(activation_bytes(r).values()) for r in g.partition_reports) for g in recorder.graphs]
    inputs = [sum(saved_input_bytes(r) for r in g.partition_reports) for g in recorder.graphs]
    calls = [*calls, *[0] * (len(per_graph) - len(calls))]  # graphs compiled after it (evaluation's) ran 0 times

    def per_forward(per_call: list[int]) -> int | None:
        return sum(b * c for b, c in zip(per_call, calls, strict=True)) // forwards if forwards else None

    return {"saved_activations": per_forward(per_graph), "saved_inputs": per_forward(inputs), "saved_by_block": None,
            "saved_per_graph": per_graph, "saved_inputs_per_graph": inputs, "graph_calls": calls, "forwards": forwards}


class MemoryReport:
    """One rank's ``memory_rank{R}.json``; does nothing unless ``enabled``.

    The Trainer compiles with :attr:`recorder`, :meth:`bind` s the model, enters
    :meth:`step` around each training step (only ``profile_step`` is profiled) and
    calls :meth:`write` at the end.
    """

    def __init__(self, enabled: bool, run_dir: Path, rank: int, profile_step: int, device: torch.device) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / REPORT_FILE.format(rank=rank)
        self.rank = rank
        self.profile_step = profile_step
        self.device = device
        self.recorder = Recorder(keep_view=False) if enabled else None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.ddp: nn.Module | None = None
        self.profile: dict[str, Any] | None = None
        #: blocks compiled one by one (FSDP2): the saved activations are each graph's times its calls
        self.per_block = False
        #: per graph, its forward's calls in the profiled step; and the model's forwards there
        self.calls: list[int] | None = None
        self.forwards = 0

    def bind(self, model: nn.Module, optimizer: torch.optim.Optimizer, train_fn: nn.Module | None = None) -> None:
        """The parameters, their optimizer, and what a step calls (DDP's buckets are read from it)."""
        from torch.nn.parallel import DistributedDataParallel

        from boost_compile.blocks import compiled_blocks

        self.model, self.optimizer = model, optimizer
        self.ddp = train_fn if isinstance(train_fn, DistributedDataParallel) else None
        self.per_block = bool(compiled_blocks(model))

    def dp_buckets(self) -> int:
        return compat.ddp_bucket_bytes(self.ddp) if self.ddp is not None else 0

    def step(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Around training step ``step``: the memory profile when it is ``profile_step``."""
        if not self.enabled or step != self.profile_step or self.model is None:
            return contextlib.nullcontext()
        return self._profiled(step)

    @contextlib.contextmanager
    def _profiled(self, step: int) -> Iterator[None]:
        from torch.profiler import ProfilerActivity, profile

        assert self.model is not None and self.optimizer is not None
        terms = {**state_bytes(self.model, self.optimizer), "dp_buckets": self.dp_buckets()}
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        graphs = len(self.recorder.graphs) if self.recorder is not None else 0
        calls_before = [g.calls for g in self.recorder.graphs] if self.recorder is not None else []
        forwards = [0]

        def count_forward(_module: nn.Module, _args: Any) -> None:
            forwards[0] += 1

        # the model runs eagerly around its compiled blocks: a hook there changes no guard (compiled whole, it would)
        hook = self.model.register_forward_pre_hook(count_forward) if self.per_block else None
        try:
            with profile(activities=activities, profile_memory=True) as prof:
                yield
        finally:
            if hook is not None:
                hook.remove()
        if self.recorder is not None:
            before = calls_before + [0] * (len(self.recorder.graphs) - len(calls_before))
            self.calls = [g.calls - b for g, b in zip(self.recorder.graphs, before, strict=True)]
        self.forwards = forwards[0]
        compiled = (len(self.recorder.graphs) if self.recorder is not None else 0) - graphs
        records = compat.profiler_memory_records(prof)
        above, end = peak_of(records, self.device.type)
        baseline = sum(terms.values())
        self.profile = {
            "peak": baseline + above, "peak_above_start": above, "baseline": baseline, "baseline_terms": terms,
            "end_above_start": end, "profiled_step": step, "allocator_events": len(records),
            "compiled_during_profile": compiled,
        }

    def write(self, state: dict[str, int] | None) -> Path | None:
        """Write the report (``state``: the Trainer's bytes of params, grads and optimizer state)."""
        if not self.enabled:
            return None
        report: dict[str, Any] = {"rank": self.rank}
        report.update({k: (state or {}).get(k) for k in ("params", "grads", "optimizer")})
        report["dp_buckets"] = self.profile["baseline_terms"]["dp_buckets"] if self.profile else self.dp_buckets()
        report["compile_unit"] = "block" if self.per_block else "model"
        if self.recorder is not None and self.recorder.graphs and self.per_block:
            if self.calls is not None:
                report.update(saved_per_call(self.recorder, self.calls, self.forwards), graphs=len(self.recorder.graphs))
            else:  # no profiled step: no calls counted
                report.update(dict.fromkeys(("saved_activations", "saved_inputs", "saved_by_block", "saved_per_graph",
                                             "saved_inputs_per_graph", "graph_calls", "forwards")),
                              graphs=len(self.recorder.graphs))
        elif self.recorder is not None and self.recorder.graphs:
            by_block, per_graph = saved_bytes(self.recorder)
            report.update(saved_activations=sum(by_block.values()), saved_by_block=by_block,
                          saved_per_graph=per_graph, graphs=len(self.recorder.graphs))
        else:  # not compiled with the boost backend: no partitioned graphs to read
            report.update(saved_activations=None, saved_by_block=None, saved_per_graph=None, graphs=0)
        keys = ("peak", "peak_above_start", "baseline", "baseline_terms", "end_above_start", "profiled_step",
                "allocator_events", "compiled_during_profile")
        report.update({k: (self.profile or {}).get(k) for k in keys})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(report, indent=1) + "\n")
        if self.rank == 0:
            mib = {k: (report[k] or 0) / 2**20 for k in ("params", "grads", "optimizer", "dp_buckets",
                                                         "saved_activations", "peak")}
            log.info("memory report (rank 0, MiB): params %.2f grads %.2f optimizer %.2f dp buckets %.2f "
                     "saved activations %.2f peak %.2f -> %s", *mib.values(), self.path)
        return self.path
