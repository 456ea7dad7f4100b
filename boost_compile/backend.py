"""The ``"boost"`` torch.compile backend.

``torch.compile(model, backend="boost", options={...})`` arrives here through the
``torch_dynamo_backends`` entry point. For each captured graph:

1. ``options`` becomes a ``BoostConfig`` (unknown keys fail with the valid ones);
2. the Torch-IR passes run in order on the Dynamo graph;
3. the graph goes to the inner compiler ("inductor", "aot_eager" or "eager"),
   with the ATen passes attached (Inductor: ``post_grad_custom_post_pass``;
   aot_eager: run on the forward and backward graphs before they execute).
   Inductor runs under the config of ``mode=`` (torch.compile's, or ``options["mode"]``)
   and of ``options["inductor"]``.

``Recorder`` (used by ``explain``) keeps the code and reports of every stage.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from boost_compile import _torch_compat as compat
from boost_compile.analysis import GraphView, count_ops
from boost_compile.config import BoostConfig, ConfigError
from boost_compile.pass_manager import (
    AtenPipeline,
    PassContext,
    PassReport,
    StageRecord,
    run_graph_passes,
)
from boost_compile.passes import aten_passes, checkpoint_partitioner, graph_passes
from boost_compile.verify import Verifier, VerifyError, VerifyReport


@dataclass
class GraphRecord:
    """Everything ``explain`` shows about one captured graph."""

    index: int
    stages: list[StageRecord] = field(default_factory=list)
    reports: list[PassReport] = field(default_factory=list)
    aten_reports: list[PassReport] = field(default_factory=list)
    #: one ``saved_tensors`` report per joint graph split (passes/saved_tensors.py)
    partition_reports: list[PassReport] = field(default_factory=list)
    view: GraphView | None = None
    #: what ``verify`` compared on this graph, and what it dropped (None: verify off)
    verify: VerifyReport | None = None
    #: the times its compiled forward ran, where a wrapper counts them (``trainer.memory_report``'s)
    calls: int = 0


@dataclass
class Recorder:
    """Collects a ``GraphRecord`` per graph the backend compiles."""

    graphs: list[GraphRecord] = field(default_factory=list)
    keep_view: bool = True
    #: record what the partitioner saves for backward (``partition_reports``). It wraps the
    #: partitioner even under checkpoint="none", which gives the compile its own cache keys;
    #: False leaves the compile as an unrecorded one (the FX graph and AOT caches shared)
    keep_partitions: bool = True

    def new_graph(self) -> GraphRecord:
        record = GraphRecord(index=len(self.graphs))
        self.graphs.append(record)
        return record


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: BoostConfig,
    recorder: Recorder | None = None,
) -> Callable[..., Any]:
    """Run the boost pipeline on one Dynamo graph and return the compiled callable."""
    record = recorder.new_graph() if recorder is not None else None
    stages = record.stages if record is not None else None
    if stages is not None:
        stages.append(StageRecord("captured", gm.code, count_ops(gm.graph)))
        if recorder.keep_view:
            # analyse a copy: later passes rewrite gm in place
            record.view = GraphView(copy.deepcopy(gm), example_inputs, config.analysis)

    ctx = PassContext(gm, example_inputs, config, grad_enabled=torch.is_grad_enabled())
    verifier = _verifier(gm, example_inputs, config, ctx, record)
    reports = run_graph_passes(graph_passes(config), ctx, stages, verifier)
    if record is not None:
        record.reports.extend(reports)

    sink = record.aten_reports if record is not None else []
    pipeline = AtenPipeline([p for p in aten_passes(config) if p.enabled()], sink)
    # activation checkpointing: the joint-graph partitioner (None: the inner compiler's own)
    partitions = record.partition_reports if record is not None and recorder.keep_partitions else None
    partitioner = checkpoint_partitioner(config, partitions)
    if verifier is not None and verifier.available and verifier.tp is not None:
        verifier.keep_rank_program(gm)  # the TP fallback: the inner compiler takes gm over
    compiled = _inner_compile(gm, example_inputs, config, pipeline, partitioner)
    if verifier is None or not verifier.available:
        return compiled
    return _verified_compile(compiled, verifier, example_inputs, config, pipeline)


def _verifier(gm: fx.GraphModule, example_inputs: Sequence[Any], config: BoostConfig, ctx: PassContext,
              record: GraphRecord | None) -> Verifier | None:
    """The reference of this graph for ``verify`` (None when verify is off)."""
    if not config.verify.enabled:
        return None
    name = compat.current_compile_id() or (str(record.index) if record is not None else "?")
    verifier = Verifier(gm, example_inputs, ctx.needs_grad(), config.strict, name, config.verify.max_gib)
    if record is not None:
        record.verify = verifier.report
    return verifier


def _verified_compile(compiled: Callable[..., Any], verifier: Verifier, example_inputs: Sequence[Any],
                      config: BoostConfig, pipeline: AtenPipeline) -> Callable[..., Any]:
    """``compiled``, checked against the captured graph when it is first called."""
    if config.mode == "reduce-overhead" or config.inductor.get("triton.cudagraphs"):
        verifier.unverified(f"compiled ({config.inner})", "CUDA graphs: a run outside the user's steps would record one")
        return compiled
    return CheckedOnFirstCall(compiled, verifier, example_inputs, config, pipeline)


class CheckedOnFirstCall:
    """The compiled graph, run once against the captured graph before its first real call.

    Not at compile time: the backward graph is compiled lazily, by the first backward, and that
    must happen outside the compile of the forward. On a mismatch the captured graph is compiled
    again without the passes; if that differs too, it runs as Dynamo gave it (each fallback is
    warned by the verifier; strict raises).
    """

    def __init__(self, compiled: Callable[..., Any], verifier: Verifier, example_inputs: Sequence[Any],
                 config: BoostConfig, pipeline: AtenPipeline) -> None:
        self.fn = compiled
        self.verifier: Verifier | None = verifier
        self.example_inputs = example_inputs
        self.config = config
        self.rewriting = [p.name for p in pipeline.passes if not p.observes_only]

    def __call__(self, *args: Any) -> Any:
        if self.verifier is not None:
            verifier, self.verifier = self.verifier, None
            try:
                self.fn = self._checked(verifier)
            finally:
                verifier.release()
            self.example_inputs = ()
        return self.fn(*args)

    def _checked(self, verifier: Verifier) -> Callable[..., Any]:
        inner = self.config.inner
        aten = f", ATen passes {'+'.join(self.rewriting)}" if self.rewriting else ""
        stage = f"compiled ({inner}{aten})"
        if verifier.tp is not None:  # a rank's program: the captured graph reads shards as whole tensors
            return self._checked_rank_program(verifier, stage)
        if verifier.check_compiled(stage, self.fn, "the captured graph is compiled again without the passes"):
            return self.fn
        plain = BoostConfig.from_options({"inner": inner, "mode": self.config.mode, "inductor": self.config.inductor})
        fallback = _inner_compile(verifier.fresh_captured(), self.example_inputs, plain, AtenPipeline([]))
        if verifier.check_compiled(f"captured graph compiled ({inner}), no passes", fallback,
                                   "the captured graph runs as Dynamo gave it"):
            return fallback
        return verifier.fresh_captured().forward

    def _checked_rank_program(self, verifier: Verifier, stage: str) -> Callable[..., Any]:
        """Under TP the fallback is this rank's program as the Torch-IR passes left it (each checked), eagerly."""
        if verifier.check_compiled(stage, self.fn, "this rank's program runs eagerly, as the passes left it"):
            return self.fn
        program = verifier.rank_program
        if verifier.check_compiled("this rank's program (eager)", program.forward, "nothing is left to fall back to"):
            return program.forward
        raise VerifyError(f"verify: graph {verifier.graph_name}: no tensor-parallel program of it computes the model")


def _inner_compile(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: BoostConfig,
    pipeline: AtenPipeline,
    partitioner: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    if config.inner == "eager":
        return gm.forward
    if config.inner == "aot_eager":
        def run_pipeline(aten_gm: fx.GraphModule, _inputs: Sequence[Any]) -> Callable[..., Any]:
            if pipeline.passes:
                pipeline(aten_gm.graph)
                aten_gm.recompile()
            return compat.make_boxed_func(aten_gm.forward)

        extra = {"partition_fn": partitioner} if partitioner is not None else {}
        return compat.aot_autograd(fw_compiler=run_pipeline, bw_compiler=run_pipeline, **extra)(gm, example_inputs)
    patches = config.inductor_patches()  # mode=, then options["inductor"]
    if pipeline.passes:
        patches["post_grad_custom_post_pass"] = pipeline
    if partitioner is not None:
        patches["custom_partitioner_fn"] = partitioner
    return compat.compile_fx(gm, example_inputs, config_patches=patches)


def with_mode(config: BoostConfig, mode: str | None) -> BoostConfig:
    """``config`` with torch.compile's ``mode=`` as its ``mode`` (None: as it is).

    A mode given both ways must agree: nothing says which of two would be meant.
    """
    if mode is None or mode == config.mode:
        return config
    if config.mode != "default":
        raise ConfigError(f"mode={mode!r} and options mode={config.mode!r} disagree; give the mode once")
    return config.replace(mode=mode)


def boost_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: BoostConfig | dict[str, Any] | None = None,
    mode: str | None = None,
    **kwargs: Any,
) -> Callable[..., Any]:
    """The Dynamo backend registered as ``"boost"``.

    ``torch.compile`` passes ``options=`` through unchanged, or ``mode=`` (it refuses both
    at once; ``options={"mode": ...}`` gives a mode with other options).
    """
    config = with_mode(BoostConfig.from_options(options), mode)
    return compile_graph(gm, example_inputs, config)


def compile(  # noqa: A001 - mirrors torch.compile
    model: Callable[..., Any],
    config: BoostConfig | dict[str, Any] | None = None,
    **compile_kwargs: Any,
) -> Callable[..., Any]:
    """``torch.compile(model, backend="boost", options=config)``, with the config checked now.

    ``mode=`` may come with ``config`` here (it becomes the config's ``mode``).
    """
    cfg = with_mode(BoostConfig.from_options(config), compile_kwargs.pop("mode", None))
    return torch.compile(model, backend=functools.partial(compile_graph, config=cfg), **compile_kwargs)
