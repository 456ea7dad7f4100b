"""Low-rank bottleneck projection ``y = act(x A) B``.

A dense ``d_in x d_out`` projection is replaced by a *down* factor ``A``
(``d_in x r``) and an *up* factor ``B`` (``r x d_out``). With ``activation=None``
this is plain low-rank ("SVD") factorisation; with ``activation="silu"`` it is a
CoLA layer. Both factors are ``nn.Linear`` modules and the forward pass uses
``torch.nn.functional`` calls, so a captured graph reads ``linear -> [silu] ->
linear`` -- the pattern the compiler passes look for. :class:`LaxLinear` is the
LaX variant ("latent crossing"): a CoLA layer whose latent also receives the same
projection's latent of the previous block, ``linear -> silu -> add -> linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
}

INITS = ("cola", "kaiming")


def break_even_rank(d_in: int, d_out: int) -> float:
    """Rank at which a factorised layer has as many weights as the dense one."""
    return d_in * d_out / (d_in + d_out)


def cola_std(d_in: int, d_out: int, rank: int) -> float:
    """Standard deviation of each CoLA factor: ``r^-1/4 * (d_in + d_out)^-1/4``."""
    return rank**-0.25 * (d_in + d_out) ** -0.25


class LowRankLinear(nn.Module):
    """Bottleneck projection ``up(act(down(x)))`` with inner dimension ``rank``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        *,
        bias: bool = False,
        activation: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(
                f"unknown activation {activation!r}; valid choices: None, "
                + ", ".join(repr(a) for a in ACTIVATIONS)
            )
        self.in_features = in_features
        self.out_features = out_features
        self.rank = rank
        self.activation = activation
        factory = {"device": device, "dtype": dtype}
        self.down = nn.Linear(in_features, rank, bias=False, **factory)
        self.up = nn.Linear(rank, out_features, bias=bias, **factory)
        self.reset_parameters()

    def reset_parameters(self, init: str = "cola") -> None:
        """Initialise both factors (``"cola"``: scaled normal; ``"kaiming"``: nn.Linear default)."""
        if init == "cola":
            std = cola_std(self.in_features, self.out_features, self.rank)
            nn.init.normal_(self.down.weight, mean=0.0, std=std)
            nn.init.normal_(self.up.weight, mean=0.0, std=std)
            if self.up.bias is not None:
                nn.init.zeros_(self.up.bias)
        elif init == "kaiming":
            self.down.reset_parameters()
            self.up.reset_parameters()
        else:
            raise ValueError(f"unknown init {init!r}; valid choices: {', '.join(INITS)}")

    def forward(self, x: Tensor) -> Tensor:
        h = self.down(x)
        if self.activation is not None:
            h = ACTIVATIONS[self.activation](h)
        return self.up(h)

    @classmethod
    def from_factors(
        cls,
        A: Tensor,
        B: Tensor,
        bias: Tensor | None = None,
        activation: str | None = None,
    ) -> LowRankLinear:
        """Build a layer computing ``act(x @ A) @ B (+ bias)``; A is [d_in, r], B is [r, d_out]."""
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != B.shape[0]:
            raise ValueError(
                f"factors must be A [d_in, r] and B [r, d_out]; got {tuple(A.shape)} "
                f"and {tuple(B.shape)}"
            )
        d_in, rank = A.shape
        d_out = B.shape[1]
        if bias is not None and tuple(bias.shape) != (d_out,):
            raise ValueError(f"bias must have shape ({d_out},), got {tuple(bias.shape)}")
        layer = cls(
            d_in,
            d_out,
            rank,
            bias=bias is not None,
            activation=activation,
            device=A.device,
            dtype=A.dtype,
        )
        with torch.no_grad():
            layer.down.weight.copy_(A.T)
            layer.up.weight.copy_(B.T)
            if bias is not None:
                layer.up.bias.copy_(bias)
        return layer

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rank={self.rank}, bias={self.up.bias is not None}, activation={self.activation}"
        )


class LaxLinear(LowRankLinear):
    """LaX bottleneck: a CoLA layer whose latent crosses into the same projection of the next block.

    ``forward(x, prev)`` computes the latent ``h = silu(x A)`` and returns
    ``((h + prev) B, h)``: the output, and the latent the next block's projection
    adds. The first block has no ``prev`` (None): its output is CoLA's ``h B``.
    Same factors, state-dict keys and parameter count as the CoLA layer
    (``activation=None``: the crossing on a plain low-rank layer).
    """

    def __init__(self, in_features: int, out_features: int, rank: int, **kwargs: Any) -> None:
        """``LowRankLinear``'s arguments, with ``activation="silu"`` (CoLA's) unless given."""
        kwargs.setdefault("activation", "silu")
        super().__init__(in_features, out_features, rank, **kwargs)

    def forward(self, x: Tensor, prev: Tensor | None = None) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        h = self.down(x)
        if self.activation is not None:
            h = ACTIVATIONS[self.activation](h)
        return self.up(h if prev is None else h + prev), h

    def extra_repr(self) -> str:
        return super().extra_repr() + ", crossing=True"


def dense_or_lowrank_params(d_in: int, d_out: int, rank: int | None) -> int:
    """Weight count of a projection: dense when ``rank`` is None, else factorised."""
    return d_in * d_out if rank is None else rank * (d_in + d_out)


__all__ = [
    "ACTIVATIONS",
    "LaxLinear",
    "LowRankLinear",
    "break_even_rank",
    "cola_std",
    "dense_or_lowrank_params",
]
