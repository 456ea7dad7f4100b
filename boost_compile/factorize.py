"""``factorize_``: swap dense ``nn.Linear`` layers (and GPT-2's ``Conv1D``) for bottlenecks, in place.

    bc.factorize_(model, bc.FactorizeConfig(rank_ratio=0.25, init="svd"))

Which layers: by default, the linears inside the repeated blocks, read from the
captured graph (a linear whose output flows back into the residual stream); the
embedding and the output head stay dense. ``filter_fn(module, fqn) -> bool``
replaces that choice, as in torchao's ``quantize_``.

A ``Conv1D`` (Hugging Face's GPT-2 projections: ``y = x @ W + b`` with W as
[d_in, d_out], the transpose of a linear's) is factorized as the linear it is.

Initialisation:
- ``"svd"``: truncated SVD in fp32, sqrt of the singular values split into both
  factors; the reconstruction error is exactly the discarded singular-value energy.
- ``"random"``: CoLA's N(0,1) * r^-1/4 * (d_in + d_out)^-1/4 for both factors.

A model on the meta device (``boost_compile/meta_init.py``: nothing computed yet) is factorized
on meta: the bottlenecks are made there and ``report.source(base, seed)`` gives their values when
the model is materialised, slice by slice (:class:`FactorSource`): an SVD of one dense weight at a
time, read whole from ``base``, or the random factors drawn per parameter.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from boost_compile.analysis import capture_views
from boost_compile.config import FactorizeConfig
from boost_compile.meta_init import InitRecipe, buffers_on_meta, canonical_name, deferred_init, is_on_meta, meta_twins
from boost_compile.models.lowrank import LowRankLinear, break_even_rank, cola_std
from boost_compile.weight_sources import Sources, WeightSource

log = logging.getLogger("boost_compile")

FilterFn = Callable[[nn.Module, str], bool]


# ----------------------------------------------------------------------------- the math


def svd_factors(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-``rank`` factors of an ``nn.Linear`` weight ``W`` [d_out, d_in].

    Returns ``(down, up)`` in ``nn.Linear`` layouts, ``down`` [r, d_in] and ``up``
    [d_out, r], with ``up @ down`` the truncated SVD of W. Computed in fp32 and
    cast back to W's dtype.
    """
    w32 = weight.detach().to(torch.float32)
    u, s, vh = torch.linalg.svd(w32, full_matrices=False)
    root = s[:rank].sqrt()
    down = root[:, None] * vh[:rank]
    up = u[:, :rank] * root[None, :]
    return down.to(weight.dtype), up.to(weight.dtype)


def cola_factors(
    d_in: int, d_out: int, rank: int, *, dtype: torch.dtype = torch.float32, device: Any = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CoLA's random init: both factors N(0, 1) * r^-1/4 * (d_in + d_out)^-1/4."""
    std = cola_std(d_in, d_out, rank)
    down = torch.randn(rank, d_in, generator=generator, device=device) * std
    up = torch.randn(d_out, rank, generator=generator, device=device) * std
    return down.to(dtype), up.to(dtype)


def saves_parameters(d_in: int, d_out: int, rank: int) -> bool:
    """Whether r (d_in + d_out) < d_in d_out, i.e. r is below the break-even rank."""
    return rank < break_even_rank(d_in, d_out)


# ----------------------------------------------------------------------------- selection


def dense_projection(module: nn.Module) -> tuple[int, int, torch.Tensor] | None:
    """``(d_in, d_out, W as [d_out, d_in])`` for an ``nn.Linear`` or a GPT-2-style ``Conv1D``
    (read by its shape, so transformers need not be imported), else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, module.weight
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2 and (
        tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None))
    ):
        return int(weight.shape[0]), int(weight.shape[1]), weight.t()
    return None


@dataclass
class FactorizedLayer:
    fqn: str
    d_in: int
    d_out: int
    rank: int
    params_before: int
    params_after: int


@dataclass(frozen=True)
class SvdFactor:
    """A factor of the truncated SVD of the dense weight ``dense`` (``part``: "down", "up", or
    "bias", the dense layer's bias kept); ``transposed``: a ``Conv1D``'s [d_in, d_out] weight."""

    dense: str
    rank: int
    part: str
    transposed: bool = False


class FactorSource:
    """The values of the factors ``factorize_`` made on the meta device: an SVD factor from its
    dense weight, read whole from ``base`` and decomposed once for both factors (the last layer's
    kept: peak one layer's dense weight and its factors), a random factor drawn per parameter."""

    def __init__(self, base: WeightSource, svd: dict[str, SvdFactor], drawn: InitRecipe) -> None:
        self.base, self.svd, self.drawn = base, svd, drawn
        self._last: tuple[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] | None = None

    def has(self, name: str) -> bool:
        return canonical_name(name) in self.svd or self.drawn.has(name)

    def shape(self, name: str) -> torch.Size:
        name = canonical_name(name)
        if name not in self.svd:
            return self.drawn.shape(name)
        f = self.svd[name]
        if f.part == "bias":
            return self.base.shape(f.dense)
        d_out, d_in = self.base.shape(f.dense)[:: -1 if f.transposed else 1]
        return torch.Size((f.rank, d_in) if f.part == "down" else (d_out, f.rank))

    def values(self, name: str, box: tuple[slice, ...] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        name = canonical_name(name)
        if name not in self.svd:
            return self.drawn.values(name, box, dtype)
        f = self.svd[name]
        if f.part == "bias":
            return self.base.values(f.dense, box, dtype)
        if self._last is None or self._last[0] != (f.dense, f.rank):
            self._last = None  # freed before the next layer is read
            weight = self.base.values(f.dense, None, torch.float32)
            self._last = ((f.dense, f.rank), svd_factors(weight.t() if f.transposed else weight, f.rank))
        down, up = self._last[1]
        factor = down if f.part == "down" else up
        return (factor[box] if box is not None else factor).to(dtype)


@dataclass
class FactorizeReport:
    """What ``factorize_`` changed, and what it left dense and why."""

    layers: list[FactorizedLayer] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: on the meta device: each SVD factor's source, by the factor's name
    svd: dict[str, SvdFactor] = field(default_factory=dict)
    #: on the meta device: the random factors' init, by name
    drawn: InitRecipe = field(default_factory=InitRecipe)

    def source(self, base: WeightSource) -> Sources:
        """The values of a model factorized on meta: its factors (:class:`FactorSource`), then
        ``base`` for every parameter ``factorize_`` did not replace."""
        return Sources(FactorSource(base, self.svd, self.drawn), base)

    @property
    def params_before(self) -> int:
        return sum(x.params_before for x in self.layers)

    @property
    def params_after(self) -> int:
        return sum(x.params_after for x in self.layers)

    def __str__(self) -> str:
        lines = [f"factorized {len(self.layers)} linear(s): {self.params_before:,} -> {self.params_after:,} params"]
        lines += [f"  {x.fqn}: {x.d_in}->{x.d_out} rank {x.rank}" for x in self.layers]
        lines += [f"  skipped {fqn}: {why}" for fqn, why in self.skipped]
        return "\n".join(lines)


def default_example_inputs(model: nn.Module) -> tuple[torch.Tensor, ...]:
    """A small token batch for a language model (its first ``nn.Embedding`` sets the vocab)."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            device = module.weight.device
            return (torch.randint(0, module.num_embeddings, (1, 8), device=device),)
    raise ValueError(
        "factorize_ reads the repeated blocks from the captured graph and needs an input to "
        "capture it: pass example_inputs=(...) (or a filter_fn that picks the layers)"
    )


def block_linear_names(model: nn.Module, example_inputs: Sequence[Any]) -> set[str]:
    """FQNs of the ``nn.Linear`` (and ``Conv1D``) modules that lie inside the model's repeated blocks."""
    views = capture_views(model, *example_inputs)
    weights = {v.param_names[s.weight] for v in views for s in v.block_linears if s.weight in v.param_names}
    linears = {name for name, m in model.named_modules() if dense_projection(m) is not None}
    return {w.rsplit(".", 1)[0] for w in weights if w.endswith(".weight")} & linears


# ----------------------------------------------------------------------------- the swap


def factorize_(
    model: nn.Module,
    config: FactorizeConfig,
    filter_fn: FilterFn | None = None,
    *,
    example_inputs: Sequence[Any] | None = None,
    seed: int = 0,
) -> FactorizeReport:
    """Replace dense ``nn.Linear`` (and ``Conv1D``) layers of ``model`` by ``LowRankLinear``, in place.

    Without ``filter_fn`` the layers are the linears inside the repeated blocks,
    found in the graph captured from ``example_inputs`` (default: a small token
    batch for a model with an embedding). With ``filter_fn(module, fqn)``, every
    ``nn.Linear`` it accepts is factorized.

    A model on the meta device gets bottlenecks on meta; ``report.source(base)`` gives their
    values (``seed``: that of the random factors' per-parameter draws).
    """
    if not isinstance(config, FactorizeConfig):
        raise TypeError(f"factorize_ takes a FactorizeConfig, got {type(config).__name__}")
    linears = [(n, m) for n, m in model.named_modules() if dense_projection(m) is not None]
    on_meta = is_on_meta(model)
    if filter_fn is None:
        example = example_inputs or default_example_inputs(model)
        if on_meta:  # captured on meta: buffers and inputs there too
            with buffers_on_meta(model):
                chosen = block_linear_names(model, meta_twins(example))
        else:
            chosen = block_linear_names(model, example)
        selected = [(n, m) for n, m in linears if n in chosen]
    else:
        selected = [(n, m) for n, m in linears if filter_fn(m, n)]

    report = FactorizeReport(drawn=InitRecipe(seed=seed))
    for fqn, linear in selected:
        d_in, d_out, _weight = dense_projection(linear)
        rank = config.rank_for(d_in, d_out)
        if not saves_parameters(d_in, d_out, rank):
            why = (
                f"rank {rank} saves nothing for {d_in}->{d_out} "
                f"(break-even rank {break_even_rank(d_in, d_out):.1f})"
            )
            warnings.warn(f"factorize_: {fqn} left dense: {why}", stacklevel=2)
            report.skipped.append((fqn, why))
            continue
        new = _meta_bottleneck(linear, fqn, rank, config, report) if on_meta else _bottleneck_from(linear, rank, config)
        _set_submodule(model, fqn, new)
        report.layers.append(
            FactorizedLayer(
                fqn, d_in, d_out, rank,
                params_before=sum(p.numel() for p in linear.parameters()),
                params_after=sum(p.numel() for p in new.parameters()),
            )
        )
    log.info("%s", report)
    return report


def _bottleneck_from(linear: nn.Module, rank: int, config: FactorizeConfig) -> LowRankLinear:
    d_in, d_out, weight = dense_projection(linear)  # weight as [d_out, d_in]
    bias = getattr(linear, "bias", None)
    new = LowRankLinear(
        d_in, d_out, rank, bias=bias is not None, activation=config.activation,
        device=weight.device, dtype=weight.dtype,
    )
    if config.init == "svd":
        if config.activation is not None:
            warnings.warn(
                "factorize_: init='svd' with an activation between the factors does not "
                "approximate the dense layer; use init='random' to train from scratch",
                stacklevel=3,
            )
        down, up = svd_factors(weight, rank)
    else:
        down, up = cola_factors(d_in, d_out, rank, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        new.down.weight.copy_(down)
        new.up.weight.copy_(up)
        if bias is not None:
            # svd keeps the layer's function, bias included; random starts from zero
            new.up.bias.copy_(bias if config.init == "svd" else torch.zeros_like(bias))
    new.train(linear.training)
    return new


def _meta_bottleneck(linear: nn.Module, fqn: str, rank: int, config: FactorizeConfig,
                     report: FactorizeReport) -> LowRankLinear:
    """The bottleneck for ``linear`` on the meta device, its values' sources added to ``report``:
    an SVD of the dense weight (and the dense bias), or CoLA's draws recorded per parameter."""
    d_in, d_out, weight = dense_projection(linear)
    bias = getattr(linear, "bias", None)
    with deferred_init(report.drawn.seed) as recording:
        new = LowRankLinear(d_in, d_out, rank, bias=bias is not None, activation=config.activation,
                            dtype=weight.dtype)
    if config.init == "svd":
        if config.activation is not None:
            warnings.warn("factorize_: init='svd' with an activation between the factors does not "
                          "approximate the dense layer; use init='random' to train from scratch", stacklevel=3)
        dense = canonical_name(f"{fqn}.weight")
        transposed = not isinstance(linear, nn.Linear)
        report.svd[f"{canonical_name(fqn)}.down.weight"] = SvdFactor(dense, rank, "down", transposed)
        report.svd[f"{canonical_name(fqn)}.up.weight"] = SvdFactor(dense, rank, "up", transposed)
        if bias is not None:
            report.svd[f"{canonical_name(fqn)}.up.bias"] = SvdFactor(canonical_name(f"{fqn}.bias"), rank, "bias")
    else:  # the module's own CoLA init, recorded: N(0, std) for both factors, a zero bias
        recipe = recording.recipe(new)
        for name, steps in recipe.steps.items():
            report.drawn.steps[f"{canonical_name(fqn)}.{name}"] = steps
            report.drawn.shapes[f"{canonical_name(fqn)}.{name}"] = recipe.shapes[name]
    new.train(linear.training)
    return new


def _set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
