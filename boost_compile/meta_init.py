"""Models built on the meta device and materialised rank by rank, each parameter's values a
function of the seed and the parameter's name.

A model too large for one device cannot be built whole on every rank and sharded afterwards.
Instead it is built inside :func:`deferred_init`: its parameters are created on ``meta`` (no
bytes; buffers stay real) and what its constructor and its own init write to each parameter is
recorded as an :class:`InitRecipe`. Each rank then computes the values of only the slice it holds
(:func:`materialize_`): an FSDP2 shard, a pipeline stage, or the whole parameter in one process.

    build on meta, recording -> shard (FSDP2) / split (PP) -> materialise each rank's slice

The random values do not come from the global RNG, whose stream depends on the order and shapes
of every draw before, but from a counter-based scheme: a parameter's elements, in row-major order,
are cut into blocks of ``min(BLOCK, numel)``, and block ``k`` of its ``i``-th random step is drawn
from a generator seeded by a hash of ``(seed, name, i, k)``. Any slice is then the same numbers in
every layout, and a rank draws only the blocks its slice touches (peak: its slice plus a block).
The one-process run uses the same scheme, so every layout starts from bitwise the same weights.

What the recorder replays: ``torch.nn.init``'s normal, uniform, constant, ones, zeros,
trunc_normal (routed to the recorder: torch's skips meta tensors), xavier and kaiming
initialisers and the in-place tensor methods they and model code call (``normal_``,
``uniform_``, ``fill_``, ``zero_``, ``mul_``, ``add_``, ``clamp_``, ``erfinv_``, ...), on a
parameter, its ``.data`` or an indexed view of it, and ``copy_`` from a real tensor (a Mamba
layer's ``A_log``). A view or a ``copy_`` makes that parameter materialise whole, one at a time;
a ``copy_`` source stays on the host until then. Anything else on a parameter (a write from a
tensor computed from a meta one, an init that skips meta tensors such as ``orthogonal_``), or a
parameter never written, is refused by :class:`MetaInitError`, naming the parameter and the operation.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from boost_compile import _torch_compat as compat
from boost_compile.weight_sources import Index, WeightSource, canonical_name, narrowed, slice_values

#: Elements per random block: a rank draws whole blocks and keeps its part of them.
BLOCK = 1 << 16
#: Elements computed at once when a slice is assembled row group by row group.
CHUNK = 1 << 22


class MetaInitError(ValueError):
    """The model's initialisation does something the per-parameter scheme cannot replay."""


# ----------------------------------------------------------------------------- the recipe


@dataclass(frozen=True, eq=False)
class Step:
    """One write of a parameter's initialisation: ``op`` with scalar ``args`` (``copy_``: from
    ``value``, a host tensor), applied to the parameter or, with a ``view`` chain (``(method, args)``
    pairs such as ``("__getitem__", (0,))``), to a view of it."""

    op: str
    args: tuple[Any, ...] = ()
    view: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    value: torch.Tensor | None = None


@dataclass
class InitRecipe:
    """Every parameter's initialisation, by name (each alias of a tied parameter included)."""

    steps: dict[str, list[Step]] = field(default_factory=dict)
    shapes: dict[str, torch.Size] = field(default_factory=dict)
    seed: int = 0

    def values(self, name: str, box: tuple[slice, ...] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values of ``name``'s slice ``box`` (one slice per dim; None: the whole parameter)."""
        name = canonical_name(name)
        shape = self.shapes[name]
        steps = self.steps[name]
        box = tuple(box or ()) + tuple(slice(0, n) for n in shape[len(box or ()):])  # the dims not cut: whole
        key = f"{self.seed}|{name}"
        if any(step.view or step.op == "copy_" for step in steps) or len(shape) == 0:
            return _whole(steps, key, shape)[box].to(dtype)
        return _sliced(steps, key, shape, box).to(dtype)

    def has(self, name: str) -> bool:
        return canonical_name(name) in self.steps

    def shape(self, name: str) -> torch.Size:
        return self.shapes[canonical_name(name)]

    def host_bytes(self) -> int:
        """Bytes of the values kept whole on the host until materialised (``copy_`` sources)."""
        seen = {id(s.value): s.value for steps in self.steps.values() for s in steps if s.value is not None}
        return sum(v.numel() * v.element_size() for v in seen.values())


# ----------------------------------------------------------------------------- recording

#: In-place methods replayed element by element, with the scalar arguments they take.
_ELEMENTWISE = {"fill_", "zero_", "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_"}
#: In-place methods that draw.
_RANDOM = {"normal_", "uniform_"}
#: In-place operators, as the method they are.
_OPERATORS = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_"}
#: Methods that give the same elements (``.data``, ``detach``) or a view of some of them.
_ALIASES = {"data", "detach"}
_VIEWS = {"__getitem__", "select", "narrow", "view", "reshape", "t", "transpose", "flatten", "unflatten"}
#: In-place methods that change no value.
_NOT_WRITES = {"requires_grad_", "retain_grad", "share_memory_", "__set__"}
#: ``torch.nn.init``'s functions that reach the mode as themselves (or as transformers' wrappers
#: of them, which torch's own look up by name); the others reach it as the tensor methods they call.
_INIT_FUNCTIONS = {"normal_", "uniform_", "constant_", "kaiming_uniform_"}
_INIT_MODULES = {"torch.nn.init", "transformers.initialization"}


#: Factories whose ``device=param.device`` (meta, during the build) is made the host: the values an
#: init computes and copies in (``A_log = log(arange(1, n + 1))``) must be real to be replayed.
_FACTORIES = {torch.empty, torch.arange, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.linspace,
              torch.logspace, torch.tensor, torch.eye}
_LIKE_FACTORIES = {torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like,
                   torch.empty_like}


def _is_meta_device(device: Any) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _is_write(op: str) -> bool:
    return (op.endswith("_") and not op.startswith("__") and op not in _NOT_WRITES) or op in _OPERATORS \
        or op == "__setitem__"


def _method_name(func: Any) -> str:
    if getattr(func, "__name__", "") == "__get__":  # an attribute: Tensor.data.__get__
        return getattr(getattr(func, "__self__", None), "__name__", "__get__")
    return getattr(func, "__name__", str(func))


def _init_step(func: Callable[..., Any], args: tuple, kwargs: dict) -> Step:
    """The step a ``torch.nn.init`` function amounts to."""
    name = func.__name__
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if name == "normal_":
        return Step("normal_", (float(a["mean"]), float(a["std"])))
    if name == "uniform_":
        return Step("uniform_", (float(a["a"]), float(a["b"])))
    if name == "constant_":
        return Step("fill_", (float(a["val"]),))
    fan = _fan(a["tensor"], a["mode"])  # kaiming_uniform_: U(-b, b), b = gain * sqrt(3 / fan)
    limit = torch.nn.init.calculate_gain(a["nonlinearity"], a["a"]) * math.sqrt(3.0 / fan)
    return Step("uniform_", (-limit, limit))


def _fan(tensor: torch.Tensor, mode: str) -> int:
    """A weight's fan-in or fan-out (``torch.nn.init``'s definition: dim 1 or dim 0 times the rest)."""
    if tensor.dim() < 2:
        raise MetaInitError("kaiming_uniform_ needs a tensor of 2 or more dims")
    receptive = math.prod(tensor.shape[2:])
    return (tensor.shape[1] if mode == "fan_in" else tensor.shape[0]) * receptive


def _method_step(op: str, args: tuple, kwargs: dict) -> Step | None:
    """A tensor method's step, its arguments made positional scalars; None when one is not a scalar."""
    kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
    if op == "normal_":
        step = Step(op, (args[0] if args else kwargs.get("mean", 0.0), args[1] if len(args) > 1 else kwargs.get("std", 1.0)))
    elif op == "uniform_":
        step = Step(op, (args[0] if args else kwargs.get("from", 0.0), args[1] if len(args) > 1 else kwargs.get("to", 1.0)))
    elif op in ("add_", "sub_"):
        step = Step(op, (args[0] if args else kwargs["other"], args[1] if len(args) > 1 else kwargs.get("alpha", 1)))
    elif op == "clamp_":
        step = Step(op, (args[0] if args else kwargs.get("min"), args[1] if len(args) > 1 else kwargs.get("max")))
    else:
        step = Step(op, tuple(args) + tuple(kwargs.values()))
    return step if all(_scalar(a) for a in step.args) else None


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float))


def _host_value(value: Any) -> torch.Tensor | None:
    """A ``copy_`` source the scheme can keep: a real tensor (not one computed from a meta one)."""
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return value.detach().to("cpu", copy=True)
    return None


class _Recorder(TorchFunctionMode):
    """During construction: ``torch.empty`` without a device makes a meta tensor, and every write
    to a parameter (tracked from its registration) is recorded as a :class:`Step`."""

    def __init__(self) -> None:
        super().__init__()
        self.tracked: dict[int, torch.Tensor] = {}  # id -> the meta parameter (kept: ids stay theirs)
        self.views: dict[int, tuple[int, tuple]] = {}  # id(view) -> (id(parameter), chain)
        self.alive: list[torch.Tensor] = []
        self.steps: dict[int, list[Step]] = {}
        self.refused: dict[int, str] = {}
        #: the storage of each host tensor torch.empty made and nothing wrote yet: a parameter made
        #: of one (``nn.Linear``'s weight) has no initial value to keep
        self.unwritten: dict[int, int] = {}
        self.paused = False  # while a parameter is moved to meta: the recorder's own work

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def track(self, meta: torch.Tensor, initial: torch.Tensor | None) -> None:
        self.tracked[id(meta)] = meta
        self.steps[id(meta)] = [] if initial is None else [Step("copy_", value=initial)]

    def _where(self, t: Any) -> tuple[int, tuple] | None:
        if not isinstance(t, torch.Tensor):
            return None
        if id(t) in self.tracked:
            return id(t), ()
        return self.views.get(id(t))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if self.paused:
            return func(*args, **kwargs)
        if func in _FACTORIES and _is_meta_device(kwargs.get("device")):
            kwargs["device"] = "cpu"  # torch.arange(n, device=param.device): a value the init computes
        elif func in _LIKE_FACTORIES and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            kwargs["device"] = "cpu"
        target = args[0] if args else kwargs.get("tensor")
        where = self._where(target)
        out = func(*args, **kwargs)
        if func is torch.empty and not out.is_meta:
            self.unwritten[out.data_ptr()] = out.numel()  # a parameter's storage before its init
        elif where is None and isinstance(target, torch.Tensor) and _is_write(_method_name(func)) \
                and not target.is_meta:
            self.unwritten.pop(target.data_ptr(), None)  # a value the init computes, now written
        if where is None:
            if _method_name(func) == "to" and isinstance(out, torch.Tensor) and out.is_meta \
                    and isinstance(target, torch.Tensor) and not target.is_meta:
                return target.to(dtype=out.dtype)  # value.to(param.device): the value stays real
            return out
        pid, view = where
        op = _method_name(func)
        if op == "is_meta":  # code that skips meta tensors (orthogonal_, sparse_, eye_, dirac_) writes nothing
            self.refused.setdefault(pid, "its init asks whether it is on the meta device, and would skip it")
        elif op in _INIT_FUNCTIONS and getattr(func, "__module__", None) in _INIT_MODULES:
            self._record(pid, view, _init_step(func, args, kwargs))
        elif op in _ALIASES or (op in _VIEWS and isinstance(out, torch.Tensor) and out.is_meta):
            link = () if op in _ALIASES else ((op, tuple(args[1:]) + tuple(kwargs.values())),)
            self.views[id(out)] = (pid, view + link)
            self.alive.append(out)
        elif _is_write(op):
            self._write(pid, view, _OPERATORS.get(op, op), args, kwargs)
        return out

    def _write(self, pid: int, view: tuple, op: str, args: tuple, kwargs: dict) -> None:
        if op == "__setitem__":
            index, value = args[1], args[2]
            source = value if _scalar(value) else _host_value(value)
            if source is None:
                self.refused.setdefault(pid, "__setitem__ of a tensor computed from a parameter")
            elif _scalar(value):
                self._record(pid, view + (("__getitem__", (index,)),), Step("fill_", (value,)))
            else:
                self._record(pid, view + (("__getitem__", (index,)),), Step("copy_", value=source))
        elif op == "copy_":
            source = _host_value(args[1] if len(args) > 1 else kwargs.get("src"))
            if source is None:
                self.refused.setdefault(pid, "copy_ from a tensor computed from a parameter")
            else:
                self._record(pid, view, Step("copy_", value=source))
        elif op in _RANDOM or op in _ELEMENTWISE:
            step = _method_step(op, args[1:], kwargs)
            if step is None:
                self.refused.setdefault(pid, f"{op} with a tensor argument")
            else:
                self._record(pid, view, step)
        else:
            self.refused.setdefault(pid, op)

    def trunc_normal(self, tensor: torch.Tensor, mean: float, std: float, a: float, b: float) -> bool:
        """``torch.nn.init.trunc_normal_`` (which does nothing to a meta tensor): recorded."""
        where = self._where(tensor)
        if where is None:
            return False
        self._record(*where, Step("trunc_normal_", (float(mean), float(std), float(a), float(b))))
        return True

    def _record(self, pid: int, view: tuple, step: Step) -> None:
        self.steps[pid].append(Step(step.op, step.args, view, step.value))


class DeferredInit:
    """What :func:`deferred_init` yields: call :meth:`recipe` with the built model."""

    def __init__(self, recorder: _Recorder, seed: int) -> None:
        self._recorder = recorder
        self._seed = seed

    def recipe(self, model: nn.Module) -> InitRecipe:
        """Every parameter's recorded initialisation, by name. MetaInitError, naming them, for a
        parameter written in a way the scheme cannot replay or never written at all, and for a
        buffer left on the meta device."""
        rec = self._recorder
        recipe = InitRecipe(seed=self._seed)
        problems = []
        for name, p in model.named_parameters(remove_duplicate=False):
            name = canonical_name(name)
            pid = id(p)
            if pid not in rec.tracked:
                problems.append(f"{name} (not created during the build)")
                continue
            recipe.shapes[name] = p.shape
            recipe.steps[name] = rec.steps[pid]
            if pid in rec.refused:
                problems.append(f"{name} ({rec.refused[pid]})")
            elif not rec.steps[pid]:
                problems.append(f"{name} (never written: torch.empty and no init)")
        problems += [f"buffer {name} (made by torch.empty)" for name, b in model.named_buffers() if b.is_meta]
        if problems:
            shown = ", ".join(dict.fromkeys(problems[:4])) + (f" and {len(problems) - 4} more" if len(problems) > 4 else "")
            raise MetaInitError(f"the model's initialisation cannot be replayed shard by shard: {shown}; "
                                "model.init=global_rng builds the whole model on every rank instead")
        return recipe


@contextlib.contextmanager
def deferred_init(seed: int) -> Iterator[DeferredInit]:
    """Build a model inside: its parameters are created on the meta device (buffers stay real: RoPE
    tables and masks, small, come from the config), and what the constructor and the model's own
    init write to each is recorded. ``.recipe(model)`` then gives the :class:`InitRecipe`.

    A parameter made from real values (``nn.Parameter(torch.ones(d))``) keeps them on the host as its
    first step; one made from ``torch.empty`` (``nn.Linear``'s weight) holds its bytes only until it is
    registered: one parameter's at a time, and never written (no page of it is touched). The global
    RNG is seeded with ``seed`` for the build and restored after: the draws a model makes on real
    tensors (a Mamba layer's ``dt_bias``) are the same in every layout, as every rank builds the
    same model.
    """
    recorder = _Recorder()
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and id(param) not in recorder.tracked:
            with recorder.pause():
                # popped: the address is free for a later tensor once this one is on meta
                empty = param.is_meta or recorder.unwritten.pop(param.data_ptr(), None) == param.numel()
                initial = None if empty else param.detach().to("cpu", copy=True)
                param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            recorder.track(param, initial)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        with torch.random.fork_rng(devices=[]), compat.trunc_normal_hook(recorder.trunc_normal):
            torch.manual_seed(seed)
            with recorder:
                yield DeferredInit(recorder, seed)
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- the values


def _block_seed(key: str, step: int, block: int) -> int:
    digest = hashlib.blake2b(f"{key}|{step}|{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _draw(kind: str, key: str, step: int, start: int, n: int, total: int) -> torch.Tensor:
    """Elements ``[start, start + n)`` of the ``step``-th draw of a tensor of ``total`` elements:
    standard normal (``normal_``) or uniform on [0, 1) (``uniform_``), block by block."""
    size = max(1, min(BLOCK, total))
    out = torch.empty(n)
    first, last = start // size, (start + n - 1) // size
    for block in range(first, last + 1):
        gen = torch.Generator().manual_seed(_block_seed(key, step, block))
        values = torch.randn(size, generator=gen) if kind == "normal_" else torch.rand(size, generator=gen)
        lo, hi = max(start, block * size), min(start + n, (block + 1) * size)
        out[lo - start:hi - start] = values[lo - block * size:hi - block * size]
    return out


def _apply(step: Step, i: int, target: torch.Tensor, key: str, start: int, total: int) -> None:
    """Apply ``step`` (the ``i``-th) to ``target``, whose elements are ``[start, start + numel)`` of a
    tensor of ``total`` elements (the draws depend on those positions only)."""
    op, a = step.op, step.args
    if op == "copy_":
        target.copy_(step.value)
    elif op in _RANDOM:
        z = _draw(op, key, i, start, target.numel(), total).view(target.shape)
        if op == "normal_":
            target.copy_(z.mul_(a[1]).add_(a[0]))
        else:
            target.copy_(z.mul_(a[1] - a[0]).add_(a[0]))
    elif op == "trunc_normal_":  # N(mean, std) cut to [lo, hi], by the inverse CDF of a uniform draw
        mean, std, lo, hi = a
        cdf_lo, cdf_hi = (0.5 * (1.0 + math.erf((x - mean) / (std * math.sqrt(2.0)))) for x in (lo, hi))
        u = _draw("uniform_", key, i, start, target.numel(), total).view(target.shape)
        u.mul_(2.0 * (cdf_hi - cdf_lo)).add_(2.0 * cdf_lo - 1.0).erfinv_()
        target.copy_(u.mul_(std * math.sqrt(2.0)).add_(mean).clamp_(lo, hi))
    elif op == "fill_":
        target.fill_(a[0])
    elif op == "zero_":
        target.zero_()
    elif op in ("add_", "sub_"):
        getattr(target, op)(a[0], alpha=a[1])
    elif op == "clamp_":
        target.clamp_(a[0], a[1])
    else:
        getattr(target, op)(*a)


def _whole(steps: list[Step], key: str, shape: torch.Size) -> torch.Tensor:
    """The whole parameter, every step applied in order (a step on a view draws the view's own
    elements, from 0)."""
    x = torch.empty(shape)
    for i, step in enumerate(steps):
        target = x
        for method, args in step.view:
            target = getattr(target, method)(*args)
        whole = not step.view
        _apply(step, i, target, key, 0, x.numel() if whole else target.numel())
    return x


def _sliced(steps: list[Step], key: str, shape: torch.Size, box: tuple[slice, ...]) -> torch.Tensor:
    """The slice ``box`` of a parameter none of whose steps is on a view: its rows (dim 0) computed a
    group at a time, each group's other dims cut to the box."""
    rows = box[0].indices(shape[0])
    width = math.prod(shape[1:])
    total = shape[0] * width
    out = torch.empty([len(range(*s.indices(n))) for s, n in zip(box, shape, strict=True)])
    group = max(1, CHUNK // max(1, width))
    done = 0
    for r in range(rows[0], rows[1], group):
        r_end = min(r + group, rows[1])
        chunk = torch.empty((r_end - r, *shape[1:]))
        for i, step in enumerate(steps):
            _apply(step, i, chunk, key, r * width, total)
        part = chunk[(slice(None), *box[1:])]
        out[done:done + part.shape[0]] = part
        done += part.shape[0]
    return out


# ----------------------------------------------------------------------------- materialising


def local_box(p: torch.Tensor) -> tuple[slice, ...] | None:
    """The slice of the whole parameter this rank holds: a DTensor's local shard, else the whole (None)."""
    from boost_compile._torch_compat import dtensor_local_box

    return dtensor_local_box(p)


def local_index(p: torch.Tensor, whole: torch.Size, spec: Any = None) -> Index:
    """Where this rank's elements of ``p`` lie in the whole parameter of shape ``whole``: its TP
    shard (``spec``, ``parallelize_``'s ShardSpec, default ``p._boost_tp``) or its experts
    (``_boost_ep``, ``expert_parallel_``) cut again to its DTensor box (FSDP2)."""
    from boost_compile.distributed.shard import shard_index

    spec = getattr(p, "_boost_tp", None) if spec is None else spec
    index: list[torch.Tensor | None] = [None] * len(whole)
    if spec is not None and spec.dim is not None:
        index[spec.dim] = shard_index(spec, whole[spec.dim])
    experts = getattr(p, "_boost_ep", None)  # expert parallelism: this rank's experts, on dim 0
    if experts is not None:
        index[0] = torch.arange(experts.start, experts.start + experts.local)
    return narrowed(tuple(index), local_box(p))


@torch.no_grad()
def materialize_(model: nn.Module, source: WeightSource, device: torch.device | str,
                 names: dict[str, str] | None = None) -> None:
    """Give every meta parameter of ``model`` its values from ``source`` (an :class:`InitRecipe`,
    a checkpoint, factors; ``boost_compile/weight_sources.py``), on ``device``, one parameter at a
    time: the part this rank holds, a TP shard (``_boost_tp``) and/or a DTensor shard (FSDP2), else
    the whole parameter. Buffers move to ``device``.

    A parameter's values are found by its name in ``model`` (less wrapper segments), mapped through
    ``names`` (this module's name -> the name in the model the source knows) for a module cut out
    of it (a pipeline stage: ``split_model(..., memo=)`` says which copy is which).
    """
    device = torch.device(device)
    names = names or {}

    def key(name: str) -> str:
        name = canonical_name(name)
        return names.get(name, name)

    def values(name: str, p: torch.Tensor, spec: Any) -> torch.Tensor:
        local = p.to_local() if hasattr(p, "to_local") else p
        index = local_index(p, source.shape(name), spec)
        return slice_values(source, name, index, local.shape, p.dtype)

    if any(p.is_meta and hasattr(p, "to_local") for p in model.parameters()):
        buffers = dict(model.named_buffers())
        # before to_empty replaces them: each name, TP spec and experts (expert parallelism's, FSDP2 ignores)
        sharded = [(key(n), getattr(p, "_boost_tp", None), getattr(p, "_boost_ep", None))
                   for n, p in model.named_parameters()]
        model.to_empty(device=device)  # FSDP2 re-creates its shards' storage here
        for name, b in model.named_buffers():
            if name in buffers and not buffers[name].is_meta:
                b.copy_(buffers[name])
        for (name, spec, experts), p in zip(sharded, model.parameters(), strict=True):
            if spec is not None:  # to_empty made new parameters: the TP spec back on them
                p._boost_tp = spec
            if experts is not None:
                p._boost_ep = experts
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(values(name, p, spec))
        return
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, pname))
        for bname, b in module._buffers.items():
            if b is not None and b.device != device and not b.is_meta:
                module._buffers[bname] = b.to(device)
    for name, p in list(model.named_parameters()):
        if not p.is_meta:
            continue
        # contiguous, as a module built eagerly holds it (an SVD factor's values come transposed): the same
        # layout, the same GEMM kernels and bits as the model saved and loaded again
        new = type(p)(values(key(name), p, None).to(device).contiguous(), requires_grad=p.requires_grad)
        new.__dict__.update(p.__dict__)  # what parallelize_ put on it (_boost_tp)
        for module, pname in owners[id(p)]:
            module._parameters[pname] = new


@contextlib.contextmanager
def buffers_on_meta(model: nn.Module) -> Iterator[None]:
    """A model whose parameters are on the meta device, its buffers moved there too while it is
    captured (a graph of meta tensors only: the blocks, the roles), put back after."""
    moved = []
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta:
                moved.append((module, name, b))
                module._buffers[name] = b.to("meta")
    try:
        yield
    finally:
        for module, name, b in moved:
            module._buffers[name] = b


def meta_twins(inputs: Any) -> tuple[Any, ...]:
    """``inputs`` with each tensor's meta twin (same shape and dtype), for a capture on meta."""
    return tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)


def is_on_meta(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is on the meta device (not materialised yet)."""
    return any(p.is_meta for p in model.parameters())
