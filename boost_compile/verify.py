"""Translation validation: every rewrite checked against the graph it replaced.

Dynamo hands the backend the real tensors of the first call. With ``verify`` on, the
backend runs the captured graph on copies of them three ways before any pass:

    eager    the captured graph in the inputs' dtype        (what the user's model computes)
    truth    the captured graph in float64                  (dtype literals such as
             ``.to(torch.float32)`` become float64 too, as a ``model.double()`` would give)

and then, after each Torch-IR pass that changed the graph, the rewritten graph in the
inputs' dtype. Each run is a forward and, for a training graph, a backward from fixed
random cotangents on every floating output; random ops draw from one generator state in
every run (and the caller's generators are left as they were). Every output and the
gradient of every input that requires one (the parameters) are judged by the parity rule
(``parity.py``): err(rewritten, truth) <= C * err(eager, truth) + floor.

A pass that breaks the rule is undone for that graph: a ``VerifyWarning`` names the pass,
the graph, the tensors that differ and the first node whose value differs (the graphs
compared node by node, by name), and the compile goes on without that rewrite; in strict
mode ``VerifyError`` is raised instead. The finished compile (the callable the user will
run, forward and backward) is checked once against the same reference; when it fails, the
captured graph is compiled again without the passes (and, if that fails too, run eagerly).

Under tensor parallelism (``parallelize_``'s btp and megatron) the reference is the unsharded
model, built from the captured graph and the gathered shards (``verify_tp.py``), and each rank's
program is judged on its slices, the TP passes and what ran between them as one program.

What cannot be compared is said, not guessed: DTensor parameters, a graph that calls
collectives of its own, fake example inputs, CUDA graphs, per-rank dropout masks.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from boost_compile import _torch_compat as compat
from boost_compile import parity
from boost_compile.analysis.fx_utils import is_collective, node_target_name
from boost_compile.verify_tp import (
    Cut,
    RankView,
    is_rank_program,
    per_rank_random,
    read_markers_as_identities,
    shapes_differ,
)

log = logging.getLogger("boost_compile")

#: The floating dtypes a float64 copy of a graph widens.
_NARROW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
#: The tensor methods that cast to one of them.
_NARROW_METHODS = ("float", "half", "bfloat16")
#: The cotangents' generator seed and the random ops' one (any fixed numbers).
_COTANGENT_SEED = 1234
_RANDOM_SEED = 4321


class VerifyWarning(UserWarning):
    """A rewrite changed what the graph computes; it was dropped."""


class VerifyError(RuntimeError):
    """A rewrite changed what the graph computes (strict mode)."""


@dataclass
class Check:
    """One comparison: a pass's rewrite, or the finished compile."""

    stage: str
    #: "verified", "dropped" (broke the rule, undone), or "unverified" (could not be compared)
    status: str
    detail: str = ""

    def line(self) -> str:
        return f"{self.stage}: {self.status}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class VerifyReport:
    """What ``verify`` compared on one graph, for ``explain``."""

    checks: list[Check] = field(default_factory=list)
    #: why nothing on this graph could be compared (None: a reference was built)
    unavailable: str | None = None

    def lines(self) -> list[str]:
        if self.unavailable:
            return [f"not verified: {self.unavailable}"]
        return [c.line() for c in self.checks]

    def to_dict(self) -> dict[str, Any]:
        return {"unavailable": self.unavailable, "checks": [vars(c) for c in self.checks]}


# ----------------------------------------------------------------------------- running a graph


def float64_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose narrow float dtype literals and casts (``.float()``) are float64
    (inputs are upcast by the caller), and whose grouped GEMMs (no float64 kernel) are loops."""
    graph = copy_graph(gm.graph)

    def widen(a: Any) -> Any:
        return torch.float64 if isinstance(a, torch.dtype) and a in _NARROW_FLOATS else a

    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, widen)
        node.kwargs = fx.node.map_aggregate(node.kwargs, widen)
        if node.op == "call_method" and node.target in _NARROW_METHODS:  # x.float(): no fp32 rounding either
            node.target = "double"
        if node.op == "call_function" and node.target in compat.GROUPED_MM_TARGETS:  # no float64 kernel
            node.target = compat.grouped_mm_loop
    wide = fx.GraphModule(gm, graph)
    for node in graph.nodes:  # the graph's own constants (compile-time factors), widened on the copy
        if node.op == "get_attr":
            *path, leaf = str(node.target).split(".")
            owner = wide.get_submodule(".".join(path)) if path else wide
            value = getattr(owner, leaf)
            if isinstance(value, torch.Tensor) and value.dtype in _NARROW_FLOATS:
                setattr(owner, leaf, value.detach().to(torch.float64))
    return wide


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A node-for-node copy (same names; metadata copied shallowly, fake tensors shared)."""
    new = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out, old_output = new.graph_copy(graph, val_map, return_output_node=True)
    new.output(out, type_expr=getattr(old_output, "type", None))
    for old, copied in val_map.items():
        compat.copy_dynamo_node_attributes(old, copied)
    return new


def own_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` that shares no graph with it: the subgraphs of its higher-order ops (an
    ``autograd.Function``'s bodies) copied too, so a pass that edits them cannot edit the reference."""
    new = fx.GraphModule(gm, copy_graph(gm.graph))
    for name, child in list(new.named_children()):
        if isinstance(child, fx.GraphModule):
            setattr(new, name, copy.deepcopy(child))
    return new


def code_of(gm: fx.GraphModule) -> str:
    """The code of ``gm`` and of its higher-order ops' bodies: what a pass may have changed."""
    bodies = [child.code for _, child in sorted(gm.named_children()) if isinstance(child, fx.GraphModule)]
    return "\n".join([gm.code, *bodies])


@dataclass
class Snapshot:
    """A graph module as it was before a pass: its graph and its bodies, to put back."""

    graph: fx.Graph
    bodies: dict[str, fx.GraphModule]
    code: str

    def restore(self, gm: fx.GraphModule) -> None:
        gm.graph = self.graph
        for name, body in self.bodies.items():
            setattr(gm, name, body)
        gm.recompile()


def snapshot(gm: fx.GraphModule) -> Snapshot:
    bodies = {name: copy.deepcopy(child) for name, child in gm.named_children() if isinstance(child, fx.GraphModule)}
    return Snapshot(copy_graph(gm.graph), bodies, code_of(gm))


@dataclass
class Run:
    """The tensors one run produced, by name: ``output[i]`` and ``grad:<input>``."""

    values: dict[str, torch.Tensor | None]


class Inputs:
    """The example inputs, copied afresh for each run (in float64 for the truth)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        self.example = list(example_inputs)
        names = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.names = [_input_name(n) for n in names]

    def fresh(self, fp64: bool) -> tuple[list[Any], dict[str, torch.Tensor]]:
        """Copies of the inputs; the leaves that want a gradient, by name."""
        args, leaves = [], {}
        for name, x in zip(self.names, self.example, strict=False):
            if isinstance(x, torch.Tensor):
                y = _copy_keeping_strides(x.detach(), torch.float64 if fp64 and x.dtype in _NARROW_FLOATS else x.dtype)
                if x.requires_grad:
                    y.requires_grad_(True)
                    leaves[name] = y
                args.append(y)
            else:  # a size of a dynamic-shape compile: the number it is for these inputs
                args.append(compat.concrete(x))
        return args, leaves

    @property
    def devices(self) -> list[torch.device]:
        return sorted({x.device for x in self.example if isinstance(x, torch.Tensor) and x.device.type != "cpu"},
                      key=str)


def _copy_keeping_strides(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``x`` in ``dtype`` with ``x``'s sizes and strides: an Inductor graph checks its
    inputs' strides (a non-contiguous slice of a wider tensor stays one). A layout that cannot
    be written (a broadcast view) is copied contiguous, as the graph's own inputs then are."""
    try:
        y = torch.empty_strided(x.size(), x.stride(), dtype=dtype, device=x.device)
        return y.copy_(x)
    except RuntimeError:
        return x.to(dtype).clone()


def _input_name(node: fx.Node) -> str:
    from boost_compile.analysis.fx_utils import source_to_fqn

    source = compat.placeholder_source_name(node)
    return source_to_fqn(source) or node.name if source is not None else node.name


@contextlib.contextmanager
def _same_random_draws(devices: Sequence[torch.device]) -> Iterator[None]:
    """One generator state for every run; the caller's state restored afterwards."""
    cuda = [d.index if d.index is not None else torch.cuda.current_device() for d in devices if d.type == "cuda"]
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.manual_seed(_RANDOM_SEED)
        yield


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _own_saved_tensors() -> Any:
    """Saved-tensor hooks of verify's own (identity): the caller's (a memory census, offloading to
    the CPU) see the user's steps, not verify's runs inside the first one."""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def run(fn: Callable[..., Any], inputs: Inputs, fp64: bool, backward: bool, cuts: Mapping[str, Cut] | None = None) -> Run:
    """Forward (and backward from fixed cotangents) of ``fn`` on fresh copies of the inputs.

    ``cuts``: the outputs that are this rank's slice of a whole one (TP), whose cotangents are
    then the same slice of the whole output's."""
    args, leaves = inputs.fresh(fp64)
    with _same_random_draws(inputs.devices), torch.set_grad_enabled(backward), _own_saved_tensors():
        out = fn(*args)
        flat = compat.tree_leaves(out)
        values: dict[str, torch.Tensor | None] = {}
        seeds = []
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor):
                values[f"output[{i}]"] = t.detach()
                if backward and t.requires_grad and t.is_floating_point():
                    seeds.append((t, _cotangent(t, i, (cuts or {}).get(f"output[{i}]"))))
        if seeds:
            torch.autograd.backward([t for t, _ in seeds], [c for _, c in seeds])
    for name, leaf in leaves.items():
        values[f"grad:{name}"] = leaf.grad
    return Run(values)


def _cotangent(t: torch.Tensor, index: int, cut: Cut | None = None) -> torch.Tensor:
    """Fixed random numbers in fp32 (the same values, widened, for a float64 run); for an output
    that is a rank's slice of a whole one, that slice of the whole output's numbers."""
    gen = torch.Generator().manual_seed(_COTANGENT_SEED + index)
    shape = t.shape if cut is None else cut.whole_shape(t.shape)
    numbers = torch.randn(shape, generator=gen, dtype=torch.float32)
    return (numbers if cut is None else cut.local(numbers)).to(device=t.device, dtype=t.dtype)


# ----------------------------------------------------------------------------- the verifier


def _why_unverifiable(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str | None:
    if any(compat.is_fake(x) for x in example_inputs):
        return "the example inputs are fake tensors"
    from torch.distributed.tensor import DTensor

    if any(isinstance(x, DTensor) for x in example_inputs):
        return "DTensor inputs (each rank's program is part of a whole)"
    return _collectives(gm)


#: What a reference holds, in copies of the inputs' bytes: a copy per run in their dtype, one in
#: float64 (twice the bytes), and the eager and float64 gradients of the parameters kept.
_COPIES_HELD = 6


def _bytes(example_inputs: Sequence[Any]) -> int:
    return sum(x.numel() * x.element_size() for x in example_inputs if isinstance(x, torch.Tensor))


def _device(example_inputs: Sequence[Any]) -> torch.device:
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))


def _too_large(size: int, max_gib: float) -> str | None:
    need = _COPIES_HELD * size / 2**30
    if need > max_gib:
        return f"its reference would hold about {need:.1f} GiB, over verify.max_gib={max_gib:g}"
    return None


def _collectives(gm: fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and is_collective(node):
            return f"the graph runs collectives ({node_target_name(node)}): each rank's program is part of a whole"
    return None


class Verifier:
    """The reference of one graph and the checks of each stage against it."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], backward: bool, strict: bool,
                 graph_name: str, max_gib: float = math.inf) -> None:
        self.report = VerifyReport()
        self.backward = backward
        self.strict = strict
        self.graph_name = graph_name
        self.inputs = Inputs(gm, example_inputs)
        #: the reference's own inputs: the example inputs, or under TP the whole model's (gathered)
        self.ref_inputs = self.inputs
        self.report.unavailable = _why_unverifiable(gm, example_inputs)
        #: a rank's program (tensor parallelism): how its tensors are cut from the whole model's
        self.tp: RankView | None = None
        #: under TP, whether the rank's program is whole yet (the pass that inserts its collectives ran)
        self.program_complete = True
        #: why nothing after a stage is compared (TP: an approximation by design cannot become the reference)
        self.stopped: str | None = None
        if self.report.unavailable is None and is_rank_program(example_inputs):
            self._rank_program(gm, example_inputs, max_gib)
        else:
            self.captured = own_copy(gm)
            self.report.unavailable = self.report.unavailable or _too_large(_bytes(example_inputs), max_gib)
        self.eager: Run | None = None
        self.truth: Run | None = None
        self.dtype = _float_dtype(example_inputs)
        if self.report.unavailable is None:
            self._reference("the captured graph")
        if self.tp is not None:  # a verdict the whole group shares: each rank then checks the same program
            self._agree_available(example_inputs)

    def _rank_program(self, gm: fx.GraphModule, example_inputs: Sequence[Any], max_gib: float) -> None:
        """The captured graph of a ``parallelize_``d model as the whole model, on the gathered shards."""
        self.tp = RankView(gm, example_inputs, self.inputs.names)
        self.program_complete = False
        self.captured = read_markers_as_identities(own_copy(gm))
        self.report.unavailable = self.tp.unsupported or _too_large(self.tp.whole_bytes(example_inputs), max_gib)
        if self.report.unavailable is None:
            self.ref_inputs = Inputs(gm, self.tp.whole_inputs(example_inputs))

    def _agree_available(self, example_inputs: Sequence[Any]) -> None:
        if not self.tp.agree(self.report.unavailable is None, _device(example_inputs)):
            self.report.unavailable = self.report.unavailable or "another rank of the group could not build its reference"

    @property
    def available(self) -> bool:
        return self.report.unavailable is None and self.stopped is None

    def waits_for_program(self, p: Any) -> bool:
        """Under TP, whether the graph after pass ``p`` is still part of a rank's program: the
        collectives come with the pass that ``completes_rank_program``, and only then is it compared."""
        if getattr(p, "completes_rank_program", False):
            self.program_complete = True
        return not self.program_complete

    # -- one Torch-IR pass --------------------------------------------------------

    def check_pass(self, name: str, gm: fx.GraphModule) -> bool:
        """Whether ``gm`` (after pass ``name``) keeps the rule; False: the caller undoes the pass."""
        if not self.available:
            return True
        why = _collectives(gm) if self.tp is None else per_rank_random(gm)
        if why is not None:
            self.report.checks.append(Check(name, "unverified", why))
            if self.tp is not None:  # the finished compile draws the same masks: nothing after is compared
                self.stopped = name
            return True
        return self._judge(name, gm, "that rewrite is dropped for this graph")

    def _judge(self, stage: str, fn: Callable[..., Any], consequence: str) -> bool:
        """Run ``fn`` (a graph, or the compiled callable) and judge it against the reference."""
        tested, what, cut = None, None, None
        try:
            tested = run(fn, self.inputs, fp64=False, backward=self.backward,
                         cuts=self.tp.output_cuts if self.tp is not None else None)
        except Exception as e:  # noqa: BLE001 - a rewrite that no longer runs is a failed check
            what = f"it raised {_one_line(e)}"
        if tested is not None and self.tp is not None:
            cut = shapes_differ(tested.values, self.truth.values)
        bad = parity.compare(tested.values, self.eager.values, self.truth.values, self.dtype) if tested and not cut else []
        what = what or (_listed(bad) if bad else None)
        if self.tp is not None and not self.tp.agree(what is None, _device(self.inputs.example)):
            what = what or "another rank of the group found a difference"  # every rank keeps or drops alike
        if what is None:
            self.report.checks.append(Check(stage, "unverified", cut) if cut else Check(stage, "verified", self._worst(tested)))
            return True
        first = None
        if bad and isinstance(fn, fx.GraphModule):
            first = (first_differing_node(self.captured, fn, self.inputs, self.dtype) if self.tp is None
                     else "not searched under TP (a rank's partial sums differ from the whole model's by design)")
        return self._failed(stage, what, first, consequence)

    # -- the finished compile -----------------------------------------------------

    def check_compiled(self, stage: str, compiled: Callable[..., Any], fallback: str) -> bool:
        """Whether the callable the user will run keeps the rule against the captured graph."""
        if not self.available:
            return True
        return self._judge(stage, compiled, fallback)

    def keep_rank_program(self, gm: fx.GraphModule) -> None:
        """Keep a copy of this rank's program after the Torch-IR passes (TP's fallback)."""
        self.rank_program = own_copy(gm)

    def fresh_captured(self) -> fx.GraphModule:
        """A new copy of the captured graph (an inner compiler takes ownership of what it is given)."""
        return own_copy(self.captured)

    def rebase(self, stage: str, gm: fx.GraphModule) -> None:
        """``gm`` changes the function by design (``stage`` approximates): it becomes the reference."""
        if self.tp is not None:  # its graph is a rank's part, not a whole model to compare with
            self.report.checks.append(Check(stage, "unverified", "an approximation by design; under TP nothing "
                                            "after it is compared"))
            self.stopped = stage
            return
        self.report.checks.append(Check(stage, "unverified", "an approximation by design; later stages are "
                                        "compared with its graph"))
        self.captured = own_copy(gm)
        self._reference(f"the graph after {stage}")

    def _reference(self, what: str) -> None:
        """The eager and float64 runs of ``self.captured``; a failure makes the graph unverified."""
        try:
            self.eager = run(self.captured, self.ref_inputs, fp64=False, backward=self.backward)
            self.truth = run(float64_graph(self.captured), self.ref_inputs, fp64=True, backward=self.backward)
            if self.tp is not None:  # as this rank holds them: its slices of what is cut
                self.eager, self.truth = Run(self.tp.local(self.eager.values)), Run(self.tp.local(self.truth.values))
        except Exception as e:  # noqa: BLE001 - any failure to build a reference is reported, not raised
            self.report.unavailable = f"{what} could not be run as a reference: {_one_line(e)}"

    def release(self) -> None:
        """Drop the reference runs, the inputs and the graphs once the last check is done.

        They hold every output and gradient of the graph twice (once in float64) and a copy of its
        inputs; the verifier itself may live on in a reference cycle until Python's collector next
        runs, and with it those tensors (a 350M Llama block's: 148 MiB of a rank's peak)."""
        self.eager = self.truth = None
        self.inputs = self.ref_inputs = None  # type: ignore[assignment]
        self.captured = self.rank_program = None  # type: ignore[assignment]
        self.stopped = self.stopped or "released"

    def unverified(self, stage: str, why: str) -> None:
        if self.available:
            self.report.checks.append(Check(stage, "unverified", why))

    # -- helpers --------------------------------------------------------------------

    def _worst(self, tested: Run) -> str:
        scale = max((parity.norm64(t) for t in self.truth.values.values() if t is not None), default=0.0)
        worst = 0.0
        for name, ref in self.truth.values.items():
            t, e = tested.values.get(name), self.eager.values.get(name)
            if ref is None or t is None or e is None:
                continue
            c, floor = parity.PARITY.get(self.dtype, parity.PARITY[torch.float32])
            ratio = parity.rel_err(t, ref, scale) / max(parity.rel_err(e, ref, scale), floor / c)
            worst = max(worst, ratio)
        return f"{len(self.truth.values)} tensors, largest err / eager err {worst:.2f}"

    def _failed(self, stage: str, what: str, first: str | None,
                consequence: str = "that rewrite is dropped for this graph") -> bool:
        where = f"; first node whose value differs: {first}" if first else ""
        message = f"verify: {stage} changed what graph {self.graph_name} computes: {what}{where}"
        if self.strict:
            raise VerifyError(message)
        warnings.warn(f"{message}; {consequence}", VerifyWarning, stacklevel=2)
        log.warning("%s", message)
        self.report.checks.append(Check(stage, "dropped", what + where))
        return False


def first_differing_node(before: fx.GraphModule, after: fx.GraphModule, inputs: Inputs, dtype: torch.dtype) -> str | None:
    """The first node of ``after`` (in order) whose forward value breaks the rule against the node of
    the same name in ``before``; None when every shared node agrees (the difference is in backward)."""
    with torch.no_grad():
        truth = _node_values(float64_graph(before), inputs, fp64=True)
        eager = _node_values(before, inputs, fp64=False)
        tested = _node_values(after, inputs, fp64=False)
    for node in after.graph.nodes:
        name = node.name
        if name not in truth or name not in tested or name not in eager or node.op == "placeholder":
            continue
        if parity.compare({name: tested[name]}, {name: eager[name]}, {name: truth[name]}, dtype):
            return f"{name} ({node_target_name(node) if node.op != 'output' else 'output'})"
    return None


def _node_values(gm: fx.GraphModule, inputs: Inputs, fp64: bool) -> dict[str, torch.Tensor]:
    """Every node's tensor value (as it stands at the end of the run: in-place writes included)."""
    values: dict[str, torch.Tensor] = {}

    class Recording(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and (out.is_floating_point() or out.is_complex()):
                values[n.name] = out
            return out

    args, _ = inputs.fresh(fp64)
    with _same_random_draws(inputs.devices):
        try:
            Recording(gm).run(*args)
        except Exception as e:  # noqa: BLE001 - the values up to the failure still locate it
            log.info("verify: node-by-node run stopped: %s", _one_line(e))
    return values


def _listed(bad: Sequence[parity.Mismatch]) -> str:
    return "; ".join(map(str, bad[:3])) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")


def _float_dtype(example_inputs: Sequence[Any]) -> torch.dtype:
    """The narrowest floating dtype among the inputs (the one whose rounding the rule allows)."""
    dtypes = {x.dtype for x in example_inputs if isinstance(x, torch.Tensor) and x.is_floating_point()}
    for d in (torch.bfloat16, torch.float16, torch.float32):
        if d in dtypes:
            return d
    return torch.float32


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
