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
  which save nothing);
- ``peak``: the most tensor bytes live during one whole step (forward, backward,
  optimizer), the last step of the run, after the compiling ones: ``baseline`` (the
  bytes live as the step starts, by tensor accounting: ``baseline_terms``, params,
  the gradients then allocated (none: they are freed after each step), optimizer
  state, dp buckets) plus ``peak_above_start``, the maximum of the running sum of
  the step's allocations and frees, in time order, from a memory profile
  (``torch.profiler`` with ``profile_memory=True``; it sees every tensor PyTorch's
  allocator makes, Inductor's buffers included, not the scratch memory of BLAS or
  oneDNN). ``end_above_start`` is that sum at the step's end (near 0 when nothing
  else stays alive); ``compiled_during_profile``: graphs the boost backend compiled
  inside the profiled step (0 unless the run has a single step or recompiles: the
  compiler's own tensors would then be in the peak). null without a profiled step
  (a run stopped early).
"""

from __future__ import annotations

import contextlib
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


def uncached(backend: Callable[..., Any]) -> Callable[..., Any]:
    """``backend`` run with the compile caches off (``compat.NO_COMPILE_CACHES``): a cache hit
    would skip the partitioner, and with it the report of what the forward saves."""

    def compile_uncached(gm: Any, example_inputs: Sequence[Any]) -> Any:
        with compat.compile_settings(**compat.NO_COMPILE_CACHES):
            return backend(gm, example_inputs)

    return compile_uncached


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

    def bind(self, model: nn.Module, optimizer: torch.optim.Optimizer, train_fn: nn.Module | None = None) -> None:
        """The parameters, their optimizer, and what a step calls (DDP's buckets are read from it)."""
        from torch.nn.parallel import DistributedDataParallel

        self.model, self.optimizer = model, optimizer
        self.ddp = train_fn if isinstance(train_fn, DistributedDataParallel) else None

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
        with profile(activities=activities, profile_memory=True) as prof:
            yield
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
        if self.recorder is not None and self.recorder.graphs:
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
