"""One dataclass tree that is the schema for ``torch.compile(..., options=)``.

``BoostConfig.from_options(dict)`` turns the user's (possibly nested) dict into the
tree and rejects unknown keys and bad values with a message that names the valid
choices, so a typo never silently turns a pass off.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
FACTORIZE_INITS = ("svd", "random")
ACTIVATIONS = ("silu", "gelu", "relu")
RMSNORM_DEVICES = ("cuda", "cpu")
#: ``checkpoint=``: what the backward keeps (passes/activation_checkpoint.py describes each policy).
CHECKPOINT_MODES = ("none", "lowrank", "full", "budget")
NORM_STATISTIC_MODES = ("packed", "separate")
#: ``mode=``: the torch.compile modes boost takes; what each sets comes from Inductor itself
#: (``list_mode_options``). "lite" is not one: it turns off the post-grad passes boost's ATen passes run in.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: Inductor settings the backend sets itself (its ATen passes, its partitioner), or that would turn
#: its ATen passes off (they run among the post-grad passes): not for ``inductor=``.
BOOST_INDUCTOR_KEYS = ("post_grad_custom_post_pass", "custom_partitioner_fn", "use_post_grad_passes")


class ConfigError(ValueError):
    """A compile option that does not exist or has a value the backend cannot use."""


@dataclass
class AnalysisConfig:
    """How the graph analysis recognises structures.

    ``bottleneck_max_ratio``: a ``linear -> [act] -> linear`` chain is a bottleneck
    only when its inner width r is at most this fraction of both outer widths.
    """

    bottleneck_max_ratio: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.bottleneck_max_ratio <= 1.0:
            raise ConfigError(
                f"analysis.bottleneck_max_ratio must be in (0, 1], got {self.bottleneck_max_ratio}"
            )


@dataclass
class FactorizeConfig:
    """Dense linear -> bottleneck ``act(x A) B``.

    Give exactly one of:
      - ``rank``: the inner width r, the same for every layer;
      - ``rank_ratio``: r = rank_ratio * min(d_in, d_out) (CoLA's r = d/4 is 0.25);
      - ``param_ratio``: r chosen so the factors hold this fraction of the dense
        layer's parameters, r = param_ratio * d_in * d_out / (d_in + d_out).
    A layer where r does not save parameters (r >= d_in*d_out/(d_in+d_out)) is
    skipped with a warning.

    ``init``: "svd" (truncated SVD, sqrt of the singular values into both factors)
    or "random" (CoLA initialisation). ``activation``: None or one of silu/gelu/relu,
    placed between the factors. ``include_head``/``include_embedding``-like choices
    are made with a ``filter_fn`` in ``factorize_``.
    """

    rank: int | None = None
    rank_ratio: float | None = None
    param_ratio: float | None = None
    init: str = "svd"
    activation: str | None = None
    enabled: bool = True

    def __post_init__(self) -> None:
        given = [k for k in ("rank", "rank_ratio", "param_ratio") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError(
                "factorize needs exactly one of rank, rank_ratio, param_ratio; "
                f"got {given or 'none'}"
            )
        if self.rank is not None and self.rank < 1:
            raise ConfigError(f"factorize.rank must be >= 1, got {self.rank}")
        for key in ("rank_ratio", "param_ratio"):
            value = getattr(self, key)
            if value is not None and not 0.0 < value < 1.0:
                raise ConfigError(f"factorize.{key} must be in (0, 1), got {value}")
        if self.init not in FACTORIZE_INITS:
            raise ConfigError(
                f"factorize.init={self.init!r} is not valid; choose one of {FACTORIZE_INITS}"
            )
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"factorize.activation={self.activation!r} is not valid; "
                f"choose None or one of {ACTIVATIONS}"
            )

    def rank_for(self, d_in: int, d_out: int) -> int:
        """The inner width this config gives a ``d_in -> d_out`` layer."""
        if self.rank is not None:
            return self.rank
        if self.rank_ratio is not None:
            return max(1, round(self.rank_ratio * min(d_in, d_out)))
        assert self.param_ratio is not None
        return max(1, round(self.param_ratio * d_in * d_out / (d_in + d_out)))


@dataclass
class GroupConfig:
    """Linears that share an input become one GEMM on concatenated weights."""

    enabled: bool = True
    min_members: int = 2

    def __post_init__(self) -> None:
        if self.min_members < 2:
            raise ConfigError(f"group.min_members must be >= 2, got {self.min_members}")


@dataclass
class RMSNormConfig:
    """Every RMSNorm becomes the fused ``boost::rms_norm`` op.

    ``devices``: rewrite only graphs whose activations are on these device types.
    The op is a Triton kernel on CUDA; on CPU it is ATen code that Inductor cannot
    fuse, so CPU graphs keep Inductor's own norm unless "cpu" is listed.
    """

    enabled: bool = True
    devices: tuple[str, ...] = ("cuda",)

    def __post_init__(self) -> None:
        self.devices = tuple(self.devices)
        bad = [d for d in self.devices if d not in RMSNORM_DEVICES]
        if bad:
            raise ConfigError(f"rmsnorm.devices has {bad}; choose from {RMSNORM_DEVICES}")


@dataclass
class TPConfig:
    """Collectives for a model sharded by ``parallelize_`` (applies only to such models).

    ``norm_statistic``: how btp's online RMSNorm sends its fp32 statistic.
    ``packed`` (default): in the down factors' all-reduce, one collective per
    norm+group, the payload in fp32. ``separate``: the payload in the model's
    dtype and the statistic in a second, [T, 1] fp32 all-reduce; for bf16 models
    on fast links this halves the bytes of those collectives
    (``benchmarks/bench_norm_packing.py``).
    ``overlap``: issue each collective as early and wait for it as late as the
    graph allows (``passes/tp_overlap.py``), so a weight-gradient GEMM runs while
    an input gradient is all-reduced.
    """

    enabled: bool = True
    norm_statistic: str = "packed"
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.norm_statistic not in NORM_STATISTIC_MODES:
            raise ConfigError(
                f"tp.norm_statistic={self.norm_statistic!r} is not valid; choose one of {NORM_STATISTIC_MODES}"
            )


@dataclass
class OpCensusConfig:
    """Count the ATen ops of the forward and backward graphs (for ``explain``)."""

    enabled: bool = True


@dataclass
class VerifyConfig:
    """Translation validation (``verify.py``): each Torch-IR pass's graph, and the finished
    compile, run on the compile's own example inputs against the captured graph and float64
    under the parity rule; a rewrite that breaks it is dropped with a warning (strict: raised).

    ``enabled``: on by default: on a cold per-block compile of cola-60m-wide models it adds
    0.5% of the first step (benchmarks/RESULTS.md, "verify's cost").
    ``max_gib``: skip (and say so) a graph whose reference would hold more than this: about six
    copies of its inputs (parameters included) in their dtype and in float64, kept while it runs.
    """

    enabled: bool = True
    max_gib: float = 4.0

    def __post_init__(self) -> None:
        if self.max_gib < 0:
            raise ConfigError(f"verify.max_gib must be >= 0, got {self.max_gib}")


@dataclass
class BoostConfig:
    """Everything ``backend="boost"`` can be told.

    ``inner``: the compiler the rewritten graph is handed to.
    ``strict``: raise when an enabled pass found nothing to rewrite or skipped a site, and when
    ``verify`` finds a rewrite that changed what the graph computes.
    ``verify``: check every rewrite against the graph it replaced (``VerifyConfig``).
    ``factorize``: opt-in compile-time factorization for frozen models (None = off).
    ``group``: one GEMM per set of linears that share an input (on by default).
    ``rmsnorm``: every RMSNorm becomes the fused op (on by default, CUDA graphs).
    ``checkpoint``: activation checkpointing, one of ``CHECKPOINT_MODES`` (off by
    default); ``checkpoint_budget`` is PyTorch's activation memory budget, in
    [0, 1], used by ``checkpoint="budget"`` only. ``block_graph``: the graph is one repeated
    block compiled alone (``compile_blocks`` sets it): ``checkpoint="full"`` then keeps the
    block's input and output only, where a whole model's graph tells its blocks by module path.
    ``mode``: torch.compile's mode for the inner Inductor compile, one of ``COMPILE_MODES``,
    with the settings Inductor itself uses for it: "max-autotune" autotunes GEMMs and uses CUDA
    graphs, "max-autotune-no-cudagraphs" the same without CUDA graphs, "reduce-overhead" CUDA
    graphs only. ``torch.compile(mode=...)`` sets it; torch.compile takes ``mode`` or
    ``options``, never both, so give a mode together with other options here.
    ``inductor``: Inductor config values for the inner compile, keys as in
    ``torch._inductor.config`` (``{"max_autotune": True, "triton.cudagraphs": False}``; nested
    dicts are read as dotted keys), applied after the mode's settings, so they win. Inductor
    puts its config into its FX graph cache key: different settings never share an artifact.
    ``mode`` and ``inductor`` need ``inner="inductor"`` (elsewhere they would do nothing).
    """

    inner: str = "inductor"
    strict: bool = False
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)
    factorize: FactorizeConfig | None = None
    group: GroupConfig = field(default_factory=GroupConfig)
    rmsnorm: RMSNormConfig = field(default_factory=RMSNormConfig)
    tp: TPConfig = field(default_factory=TPConfig)
    op_census: OpCensusConfig = field(default_factory=OpCensusConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    checkpoint: str = "none"
    checkpoint_budget: float = 0.5
    block_graph: bool = False
    mode: str = "default"
    inductor: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.inner not in INNER_COMPILERS:
            raise ConfigError(
                f"inner={self.inner!r} is not a valid inner compiler; choose one of {INNER_COMPILERS}"
            )
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ConfigError(
                f"checkpoint={self.checkpoint!r} is not valid; choose one of {CHECKPOINT_MODES}"
            )
        if not 0.0 <= self.checkpoint_budget <= 1.0:
            raise ConfigError(f"checkpoint_budget must be in [0, 1], got {self.checkpoint_budget}")
        if self.mode not in COMPILE_MODES:
            raise ConfigError(f"mode={self.mode!r} is not valid for backend='boost'; choose one of {COMPILE_MODES}")
        self.inductor = _checked_inductor_options(self.inductor) if self.inductor else {}
        if self.inner != "inductor" and self.mode != "default":
            raise ConfigError(
                f"mode={self.mode!r} configures Inductor and would do nothing with inner={self.inner!r}; "
                "use inner='inductor' or mode='default'"
            )
        if self.inner != "inductor" and self.inductor:
            raise ConfigError(
                f"inductor={sorted(self.inductor)} configures Inductor and would do nothing with "
                f"inner={self.inner!r}; use inner='inductor' or drop them"
            )

    def inductor_patches(self) -> dict[str, Any]:
        """The Inductor config the inner compile runs under: the mode's settings, then ``inductor``."""
        from boost_compile import _torch_compat as compat

        return {**compat.inductor_mode_options(self.mode), **self.inductor}

    @classmethod
    def from_options(cls, options: BoostConfig | dict[str, Any] | None) -> BoostConfig:
        """Build the tree from ``options=`` (a dict, a BoostConfig, or None)."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, dict):
            raise ConfigError(f"options must be a dict or BoostConfig, got {type(options).__name__}")
        return _build(cls, options, prefix="")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> BoostConfig:
        """A copy with top-level fields changed (nested dicts are validated)."""
        merged = {**_shallow_dict(self), **changes}
        return _build(type(self), merged, prefix="")


def _checked_inductor_options(values: dict[str, Any]) -> dict[str, Any]:
    """``inductor=`` with nested dicts flattened to dotted keys, each key and value type
    checked against Inductor's own config (an unknown key names the close matches)."""
    from boost_compile import _torch_compat as compat

    if not isinstance(values, dict):
        raise ConfigError(f"inductor must be a dict of Inductor settings, got {type(values).__name__}")
    types_ = compat.inductor_option_types()
    flat: dict[str, Any] = {}
    pending = list(values.items())
    while pending:
        key, value = pending.pop(0)
        key = str(key)
        if isinstance(value, dict) and key not in types_ and any(k.startswith(f"{key}.") for k in types_):
            pending.extend((f"{key}.{k}", v) for k, v in value.items())
            continue
        if key not in types_:
            close = difflib.get_close_matches(key, list(types_), n=3)
            hint = f"did you mean {close}?" if close else "see torch._inductor.list_options()"
            raise ConfigError(f"inductor.{key} is not an Inductor setting (torch._inductor.config); {hint}")
        if key in BOOST_INDUCTOR_KEYS:
            raise ConfigError(f"inductor.{key} is set by backend='boost' itself (its ATen passes run there); leave it out")
        _check_inductor_type(key, types_[key], value)
        flat[key] = value
    return flat


def _check_inductor_type(key: str, annotation: Any, value: Any) -> None:
    """Inductor's own rule (torch.compile's options=): plain types are checked, generic ones not."""
    if get_origin(annotation) is not None or not isinstance(annotation, type):
        return
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return
    if not isinstance(value, annotation):
        raise ConfigError(f"inductor.{key}={value!r} has the wrong type; expected {annotation.__name__}")


def _shallow_dict(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _dataclass_in(annotation: Any) -> type | None:
    """The dataclass type inside ``X`` or ``X | None``, if any."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    if get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in get_args(annotation):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        where = prefix.rstrip(".") or "options"
        raise ConfigError(
            f"unknown key(s) {unknown} in {where}; valid keys are {sorted(fields)}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        sub = _dataclass_in(hints[name])
        if sub is not None and isinstance(value, dict):
            value = _build(sub, value, prefix=f"{prefix}{name}.")
        elif sub is not None and isinstance(value, bool) and hints[name] is sub and "enabled" in {
            f.name for f in dataclasses.fields(sub)
        }:
            # ``verify=True`` / ``group=False``: a section's on/off switch
            value = sub(enabled=value)
        elif sub is not None and isinstance(value, bool) and hints[name] is not sub:
            # ``factorize=False`` switches an optional pass off.
            if value:
                raise ConfigError(f"{prefix}{name}=True needs a dict of settings")
            value = None
        _check_scalar(f"{prefix}{name}", hints[name], value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as exc:  # pragma: no cover - defensive
        raise ConfigError(f"{prefix or 'options'}: {exc}") from exc


def _check_scalar(name: str, annotation: Any, value: Any) -> None:
    """Reject values whose Python type cannot match the annotation."""
    allowed = get_args(annotation) if get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    if value is None:
        if type(None) in allowed:
            return
        raise ConfigError(f"{name} may not be None")
    for typ in allowed:
        if get_origin(typ) is Literal and value in get_args(typ):
            return
        if get_origin(typ) is dict:
            if isinstance(value, dict):
                return
            continue
        if get_origin(typ) in (list, tuple):
            item = get_args(typ)[0] if get_args(typ) else object
            if isinstance(value, (list, tuple)) and all(isinstance(v, item) for v in value):
                return
            continue
        if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if typ is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if isinstance(typ, type) and typ not in (int, float) and isinstance(value, typ):
            return
    names = ", ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise ConfigError(f"{name}={value!r} has the wrong type; expected {names}")
