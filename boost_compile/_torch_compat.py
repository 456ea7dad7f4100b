"""Every private torch API boost_compile touches, in one place (checked against torch 2.13.0).

torch moves its private modules and attributes between releases. The rest of
the project reaches them only through the names below, so an upgrade that
breaks one breaks here, at a glance (``tests/unit/test_torch_compat.py`` greps
the sources for private torch names anywhere else). Process-wide configuration
changes go through context managers that put the old value back.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

# Inductor's hooks for a custom graph pass and a custom partitioner (keyed by their uuid())
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn  # noqa: F401

# the structured trace (TORCH_TRACE) that tlparse reads, and the logger it writes to
from torch._logging import trace_structured  # noqa: E402,F401

#: ``trace_structured``'s logger: it has a handler exactly while a trace is written.
TRACE_LOGGER = "torch.__trace"

#: The torch release these names were checked against.
CHECKED_WITH = "2.13.0"

# ----------------------------------------------------------------------------- ops and targets

#: The target Dynamo records for ``F.linear`` (the C binding it dispatches to).
TORCH_LINEAR = torch._C._nn.linear
#: The target Dynamo records for ``F.scaled_dot_product_attention``.
TORCH_SDPA = torch._C._nn.scaled_dot_product_attention
#: ``torch.<op>`` functions as Dynamo records them come from this module.
TORCH_FUNCTIONS_MODULE = "torch._C._VariableFunctions"
#: ATen graph targets: an operator overload (``aten.mm.default``).
OpOverload = torch._ops.OpOverload
#: Namespaces of the functional collectives (ATen ops).
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})
#: The functional collectives' wait (an ATen graph target).
WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
#: torch's Python wrappers over the functional collectives.
FUNCTIONAL_COLLECTIVES_MODULE = "torch.distributed._functional_collectives"


def op_namespace_and_name(target: Any) -> tuple[str, str] | None:
    """``("_c10d_functional", "all_reduce")`` for an ATen overload or packet, else None."""
    qualified = getattr(target, "_qualified_op_name", None)  # packets, and overloads through it
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace, target._opname
    if isinstance(qualified, str) and "::" in qualified:
        namespace, _, name = qualified.partition("::")
        return namespace, name
    return None


# ----------------------------------------------------------------------------- Dynamo graphs


def placeholder_source_name(node: Any) -> str | None:
    """The Dynamo source of a placeholder (``L['self']._modules['w']._parameters['weight']``),
    from its private ``grapharg`` metadata; None when there is none (Dynamo drops it once
    the backend returns)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    return source.name if source is not None else None


def op_schema(target: Any) -> Any:
    """An ATen overload's schema (its private ``_schema``), or None for other targets."""
    return getattr(target, "_schema", None)


# ----------------------------------------------------------------------------- AOT autograd and partitioning



def is_opaque_node(node: Any) -> bool:
    """A graph input AOT autograd treats as opaque (DTensor's DeviceMesh).

    A torch without the helper (2.11, the GPU machine's image) has no opaque graph inputs, so
    none is: the checkpoint partitioner then keeps its plain recompute tags.
    """
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node as opaque
    except ImportError:
        return False
    return opaque(node)


def default_partition(*args: Any, **kwargs: Any) -> Any:
    """AOT autograd's default joint-graph partitioner (aot_eager's)."""
    from torch._functorch.partitioners import default_partition as partition

    return partition(*args, **kwargs)


def min_cut_partition(*args: Any, **kwargs: Any) -> Any:
    """The min-cut rematerialization partitioner (Inductor's default; honours recompute tags)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition as partition

    return partition(*args, **kwargs)


def functorch_config_patch(changes: dict[str, Any]) -> Any:
    """``torch._functorch.config.patch``: functorch settings changed inside a ``with`` only."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(changes)


def give_constant_source(gm: Any, name: str) -> None:
    """Record a buffer made at compile time as coming from a constant of its own name.

    Dynamo's graph module maps every parameter and buffer to where it came from
    (``_param_name_to_source``); AOT autograd rejects a buffer with no source."""
    from torch._dynamo.source import ConstantSource

    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        sources[name] = ConstantSource(name)


def current_fake_mode() -> Any:
    """The fake-tensor mode of the compile in progress (``TracingContext``), else a new one."""
    from torch._guards import TracingContext
    from torch._subclasses.fake_tensor import FakeTensorMode

    tc = TracingContext.try_get()
    return tc.fake_mode if tc is not None and tc.fake_mode is not None else FakeTensorMode()


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """Silence fake-tensor's ERROR log inside (a caller that turns the failure into its own error)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


# ----------------------------------------------------------------------------- compile settings


@contextlib.contextmanager
def compile_settings(
    *, dynamo: dict[str, Any] | None = None, inductor: dict[str, Any] | None = None,
    functorch: dict[str, Any] | None = None,
) -> Iterator[None]:
    """Dynamo, Inductor and functorch config values changed inside, the old ones back on exit.

    Keys as torch spells them, nested ones dotted (``{"cpp.enable_kernel_profile": True}``).
    """
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with contextlib.ExitStack() as stack:
        for module, changes in ((dynamo_config, dynamo), (inductor_config, inductor), (functorch_config, functorch)):
            if changes:
                stack.enter_context(module.patch(changes))
        yield


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """The Inductor settings ``torch.compile(mode=mode)`` applies (``list_mode_options``; {} for "default")."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def inductor_option_types() -> dict[str, Any]:
    """Every Inductor config key (nested ones dotted, ``triton.cudagraphs``) -> its declared type."""
    import torch._inductor.config as inductor_config

    return {key: inductor_config.get_type(key) for key in inductor_config.get_config_copy()}


#: Compile settings under which every compile runs its passes (no FX-graph or AOT-autograd
#: cache hit skips them): for tools that read what the passes report.
NO_COMPILE_CACHES = {"inductor": {"fx_graph_cache": False}, "functorch": {"enable_autograd_cache": False}}


def dynamo_recompile_limit_value() -> int:
    import torch._dynamo.config as dynamo_config

    return int(dynamo_config.recompile_limit)


def dynamo_recompile_limit(at_least: int) -> contextlib.AbstractContextManager[None]:
    """Dynamo's per-code-object recompile limit raised to ``at_least`` inside (never lowered)."""
    if dynamo_recompile_limit_value() >= at_least:
        return contextlib.nullcontext()
    return compile_settings(dynamo={"recompile_limit": at_least})


# ----------------------------------------------------------------------------- compilers


def aot_autograd(**kwargs: Any) -> Any:
    """Dynamo's AOT-autograd backend factory (``fw_compiler``, ``bw_compiler``, ``partition_fn``)."""
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def make_boxed_func(fn: Any) -> Any:
    """Wrap a compiled graph's forward in AOT autograd's boxed calling convention."""
    from torch._functorch.aot_autograd import make_boxed_func as boxed

    return boxed(fn)


def compile_fx(*args: Any, **kwargs: Any) -> Any:
    """Inductor's entry point for a captured graph."""
    from torch._inductor.compile_fx import compile_fx as inductor

    return inductor(*args, **kwargs)


def backend_compiler_failed() -> type[Exception]:
    """The exception Dynamo wraps a backend's error in."""
    from torch._dynamo.exc import BackendCompilerFailed

    return BackendCompilerFailed


# ----------------------------------------------------------------------------- memory


#: The profiler's device types whose memory records are host memory (torch's own profiler counts these as CPU).
HOST_MEMORY_DEVICES = frozenset({"cpu", "mkldnn", "ideep"})


def profiler_memory_records(prof: Any) -> list[tuple[int, int, str]]:
    """``(start_ns, bytes, device)`` of every allocator event a finished
    ``torch.profiler.profile(profile_memory=True)`` recorded, in time order (a free is negative;
    device ``"cpu"``, ``"cuda"``, ...).

    These are the profiler's raw ``[memory]`` records (``kineto_results``): ``prof.events()``
    adds most of them to the op they fall in (and to every op around it) and lists only the
    rest, so it cannot give the running total."""
    records = [
        (int(e.start_ns()), int(e.nbytes()), e.device_type().name.lower())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    ]
    return sorted(records, key=lambda r: r[0])


def ddp_bucket_bytes(ddp: Any) -> int:
    """Bytes of a DistributedDataParallel module's gradient buckets, read from its reducer
    (``_get_zeros_like_grad_buckets``: a zero tensor of each bucket's shape, made here and dropped)."""
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return sum(b.buffer().numel() * b.buffer().element_size() for b in buckets)


# ----------------------------------------------------------------------------- modules and collectives


def is_torch_compile_wrapper(module: Any) -> bool:
    """``torch.compile(module)``'s wrapper (an ``OptimizedModule``), not a module compiled in place."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def wrap_compiled_call(module: Any, wrap: Any) -> None:
    """Put ``wrap`` around the compiled forward of a module compiled in place (``module.compile()``)."""
    module._compiled_call_impl = wrap(module._compiled_call_impl)


def is_compiled_module(module: Any) -> bool:
    """``torch.compile(module)``'s wrapper, or a module compiled in place (``module.compile()``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain ``torch.Tensor`` (the same data, still in the autograd graph), called
    without the ``__torch_function__`` of its subclass."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.as_subclass(t, torch.Tensor)


def map_nested(fn: Any, tree: Any) -> Any:
    """``fn`` applied to every leaf of nested lists, tuples and dicts (torch's pytree), e.g. the
    arguments of a ``__torch_function__`` call (``torch.cat([a, b])``)."""
    from torch.utils import _pytree

    return _pytree.tree_map(fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of nested lists, tuples and dicts (torch's pytree), in order: a graph's outputs."""
    from torch.utils import _pytree

    return _pytree.tree_leaves(tree)


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (shapes and dtypes only, no data)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def concrete(value: Any) -> Any:
    """A symbolic int or float of a dynamic-shape compile as the number it stands for this time
    (its hint); any other value as it is."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = value.node.hint
        return hint if hint is not None else value
    return value


def reset_dynamo() -> None:
    """Forget every compiled frame and guard (``torch._dynamo.reset``): a fresh start per model."""
    torch._dynamo.reset()


def dynamo_counters() -> Any:
    """Dynamo's own counters (``torch._dynamo.utils.counters``): ``["stats"]["unique_graphs"]`` is
    the graphs it handed a backend since the last ``clear()``."""
    import torch._dynamo.utils

    return torch._dynamo.utils.counters


def current_compile_id() -> str | None:
    """The id Dynamo gives the compile in progress ("0/0": frame 0, its first compile), else None."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return str(compile_id) if compile_id is not None else None


def copy_dynamo_node_attributes(old: Any, new: Any) -> None:
    """Dynamo's own attributes of an FX node (a placeholder's ``_dynamo_source``, which AOT
    autograd reads) onto its copy: they are not metadata, and ``Graph.node_copy`` leaves them."""
    for key, value in vars(old).items():
        if key.startswith("_dynamo"):
            setattr(new, key, value)


def original_module(module: Any) -> Any:
    """The module under a ``torch.compile`` wrapper (itself when not wrapped)."""
    return getattr(module, "_orig_mod", module)


def functional_collectives() -> Any:
    """The functional-collective op namespace (``all_reduce``, ``wait_tensor``, ...)."""
    return torch.ops._c10d_functional


def all_to_all_single_autograd(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """The all-to-all of uneven splits whose backward sends the gradients back
    (``torch.distributed._functional_collectives``)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a

    return a2a(x, out_splits, in_splits, group)


#: ``torch._check``: a condition that fake tensors and the compiler understand.
check = torch._check


def resolve_process_group(group_name: str) -> Any:
    """The process group a functional collective names by ``group_name``."""
    return torch.distributed.distributed_c10d._resolve_process_group(group_name)


try:  # FSDP2's interfaces for custom collectives (``FSDPModule.set_custom_all_gather`` / ``_reduce_scatter``)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as FsdpAllGather
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as FsdpReduceScatter
except ImportError:  # a build without distributed
    FsdpAllGather = FsdpReduceScatter = object  # type: ignore[misc,assignment]


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh``'s dims as one dim called ``name``, reachable from the root mesh as ``root[name]``."""
    return mesh._flatten(name)


def dtensor_local_box(t: Any) -> tuple[slice, ...] | None:
    """The slice of a DTensor's whole that this rank holds, one ``slice`` per dim (None for a plain
    tensor): DTensor's own rule for uneven shards, from ``torch.distributed.tensor._utils``."""
    if not hasattr(t, "device_mesh") or not hasattr(t, "placements"):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


@contextlib.contextmanager
def trunc_normal_hook(hook: Any) -> Iterator[None]:
    """Offer every ``torch.nn.init.trunc_normal_`` to ``hook(tensor, mean, std, a, b)`` first (it
    returns True when it took the call). torch's helper, ``torch.nn.init._no_grad_trunc_normal_``,
    is looked up at each call, so transformers' wrappers (which hold torch's public function) reach
    it too; on a meta tensor it returns at once, before any tensor operation a mode could see."""
    import torch.nn.init as init

    original = init._no_grad_trunc_normal_

    def routed(tensor: Any, mean: float, std: float, a: float, b: float, generator: Any = None) -> Any:
        if hook(tensor, mean, std, a, b):
            return tensor
        return original(tensor, mean, std, a, b, generator)

    init._no_grad_trunc_normal_ = routed
    try:
        yield
    finally:
        init._no_grad_trunc_normal_ = original


#: torch's grouped GEMM as it appears in a captured graph (the Python binding, or the aten op)
GROUPED_MM_TARGETS = tuple(t for t in (getattr(torch, "_grouped_mm", None),
                                       getattr(torch.ops.aten, "_grouped_mm", None)) if t is not None)


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias: Any = None,
                    out_dtype: Any = None) -> torch.Tensor:
    """``torch._grouped_mm``'s products as a loop of plain matmuls, in any dtype: its kernels have no
    float64, which a graph's float64 reference needs. The four forms: 2-D x 3-D (rows of ``a``
    grouped by ``offs``), 3-D x 2-D (columns of ``b``), 2-D x 2-D (the inner dimension: [G, m, n]),
    3-D x 3-D (a batched matmul, no offsets). Rows or columns past the last offset are 0."""
    if bias is not None:
        raise NotImplementedError("grouped_mm_loop: a bias is not supported")
    ends = offs.tolist() if offs is not None else []
    spans = list(zip([0, *ends[:-1]], ends, strict=True)) if ends else []
    if a.dim() == 3 and b.dim() == 3:
        out = torch.bmm(a, b)
    elif a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for g, (s, e) in enumerate(spans):
            out[s:e] = a[s:e] @ b[g]
    elif a.dim() == 3 and b.dim() == 2:
        out = a.new_zeros(a.shape[1], b.shape[-1])
        for g, (s, e) in enumerate(spans):
            out[:, s:e] = a[g] @ b[:, s:e]
    else:
        out = torch.stack([a[:, s:e] @ b[s:e] for s, e in spans])
    return out if out_dtype is None else out.to(out_dtype)


def has_grouped_mm() -> bool:
    """Whether this torch has the grouped GEMM kernel (``torch._grouped_mm``)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    """torch's grouped GEMM kernel (:func:`grouped_mm_loop` gives its forms)."""
    return torch._grouped_mm(a, b, offs=offs)
