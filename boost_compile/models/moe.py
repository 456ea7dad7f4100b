"""The reference model's mixture-of-experts feed-forward: a router sends each token to ``top_k`` of
``n_experts`` SwiGLU experts, whose outputs are weighted by the router's renormalised scores.

    MoE.forward   x [b, s, d] -> router logits -> softmax -> top_k (weights renormalised)
                  -> Experts(tokens, top_k_index, top_k_weights) -> [b, s, d]

:class:`Experts` keeps every expert's weights stacked, ``[n_experts, d_in, d_out]``: dense
``gate`` / ``up`` / ``down`` matrices, or each of them as two bottleneck factors of rank ``r``
(CoLA: a SiLU between them; plain low-rank: none). It has transformers' experts contract,
``forward(hidden [T, d], top_k_index [T, k], top_k_weights [T, k])`` with every parameter
``[num_experts, ...]``, so :func:`boost_compile.expert_parallel_` shards it by expert as it shards
Qwen3-MoE's or Mixtral's.

The experts' matrix products are grouped: the (token, slot) assignments are sorted by expert, so
each expert's rows are contiguous, and one ``torch._grouped_mm`` per matrix multiplies every
expert's rows by its weight (:func:`grouped_mm`). Where that kernel is missing (float64, a GPU
below sm90, float32 under ``torch.compile``, whose meta kernel asks for bfloat16, a width that is
not a multiple of 16 bytes) a loop over the experts computes the same products: eagerly on each
expert's rows (:func:`looped_mm`), or in a compiled graph on every row, each keeping its own
expert's product (:func:`masked_mm`, ``n_experts`` times the FLOPs, in static shapes: one graph).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from boost_compile.models.lowrank import ACTIVATIONS, cola_std

#: the three matrices of a SwiGLU expert: name -> (d_in, d_out) as "dim" / "ffn"
EXPERT_MATRICES = {"gate": ("dim", "ffn"), "up": ("dim", "ffn"), "down": ("ffn", "dim")}
INIT_STD = 0.02


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matrix product of ``x`` runs in: autocast's where it is on, else ``x``'s."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):  # "meta" has no autocast
        return torch.get_autocast_dtype(kind)
    return x.dtype


def grouped_kernel(x: Tensor, widths: tuple[int, ...]) -> bool:
    """Whether ``torch._grouped_mm`` multiplies rows of ``x``'s dtype and device by matrices of these
    ``widths`` here: bfloat16 (CPU, or a GPU of sm90 and later), and float32 / float16 on the CPU
    outside ``torch.compile``; each width a multiple of 16 bytes (the kernel's stride rule)."""
    dtype = _compute_dtype(x)
    if not hasattr(torch, "_grouped_mm"):
        return False
    if any(w * dtype.itemsize % 16 for w in widths):
        return False
    if x.device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if x.device.type != "cpu":
        return False
    if dtype == torch.bfloat16:
        return True
    return dtype in (torch.float32, torch.float16) and not torch.compiler.is_compiling()


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """``x`` [N, d_in] (rows sorted by expert, expert e's ending at ``offsets[e]``) times ``w``
    [E, d_in, d_out], each row by its expert's matrix: [N, d_out]."""
    dtype = _compute_dtype(x)
    return torch._grouped_mm(x.to(dtype), w.to(dtype), offs=offsets)


def masked_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """:func:`grouped_mm` in static shapes, for a compiled graph without the kernel: every row times
    every expert's matrix, each row keeping its own expert's product (``torch.where``: a product
    of another expert never mixes in), at ``E`` times the FLOPs of the grouped kernel."""
    dtype = _compute_dtype(x)
    rows = torch.arange(x.shape[0], device=x.device)
    expert = torch.searchsorted(offsets, rows.to(offsets.dtype), right=True)  # E: past the last (dropped)
    xd = x.to(dtype)
    out = x.new_zeros(x.shape[0], w.shape[-1], dtype=dtype)
    for e in range(w.shape[0]):
        out = torch.where((expert == e).unsqueeze(1), xd @ w[e].to(dtype), out)
    return out


def looped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """:func:`grouped_mm` as a loop over the experts (any dtype and device; reads the offsets on the host)."""
    dtype = _compute_dtype(x)
    if offsets.is_meta:  # a capture on the meta device (parallelize_'s): shapes only, no counts to read
        return x.new_empty(x.shape[0], w.shape[-1], dtype=dtype)
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    parts = [x[a:b].to(dtype) @ w[e].to(dtype) for e, (a, b) in enumerate(zip(starts, ends, strict=True))]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1], dtype=dtype)


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts, ``down(silu(gate(x)) * up(x))``, weights stacked per expert.

    ``rank`` None: each matrix is one parameter ``[E, d_in, d_out]`` (``gate``, ``up``, ``down``);
    else two factors ``<name>_down`` ``[E, d_in, r]`` and ``<name>_up`` ``[E, r, d_out]`` with
    ``activation`` (``"silu"`` for CoLA, None for plain low-rank) between them.
    """

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, rank: int | None = None,
                 activation: str | None = None, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; valid: None, {', '.join(ACTIVATIONS)}")
        self.num_experts, self.dim, self.ffn_dim = num_experts, dim, ffn_dim
        self.rank, self.activation = rank, activation
        widths = {"dim": dim, "ffn": ffn_dim}
        factory = {"device": device, "dtype": dtype}
        for name, (d_in, d_out) in EXPERT_MATRICES.items():
            d_in, d_out = widths[d_in], widths[d_out]
            if rank is None:
                self.register_parameter(name, nn.Parameter(torch.empty(num_experts, d_in, d_out, **factory)))
            else:
                self.register_parameter(f"{name}_down", nn.Parameter(torch.empty(num_experts, d_in, rank, **factory)))
                self.register_parameter(f"{name}_up", nn.Parameter(torch.empty(num_experts, rank, d_out, **factory)))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Dense matrices N(0, 0.02) as the reference model's linears; factors CoLA's scaled normal."""
        widths = {"dim": self.dim, "ffn": self.ffn_dim}
        for name, (d_in, d_out) in EXPERT_MATRICES.items():
            if self.rank is None:
                nn.init.normal_(getattr(self, name), mean=0.0, std=INIT_STD)
                continue
            std = cola_std(widths[d_in], widths[d_out], self.rank)
            nn.init.normal_(getattr(self, f"{name}_down"), mean=0.0, std=std)
            nn.init.normal_(getattr(self, f"{name}_up"), mean=0.0, std=std)

    def _project(self, name: str, x: Tensor, offsets: Tensor, mm) -> Tensor:
        if self.rank is None:
            return mm(x, getattr(self, name), offsets)
        latent = mm(x, getattr(self, f"{name}_down"), offsets)
        if self.activation is not None:
            latent = ACTIVATIONS[self.activation](latent)
        return mm(latent, getattr(self, f"{name}_up"), offsets)

    def _mlp(self, rows: Tensor, offsets: Tensor, mm) -> Tensor:
        hidden = F.silu(self._project("gate", rows, offsets, mm)) * self._project("up", rows, offsets, mm)
        return self._project("down", hidden, offsets, mm)

    def _products(self, rows: Tensor) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """The grouped GEMM where the kernel runs; else, traced, :func:`masked_mm` (one graph, which
        ``parallelize_`` needs); else, eager, :func:`looped_mm`."""
        widths = (self.dim, self.ffn_dim) if self.rank is None else (self.dim, self.ffn_dim, self.rank)
        if grouped_kernel(rows, widths):
            return grouped_mm
        return masked_mm if torch.compiler.is_compiling() else looped_mm

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """``hidden`` [T, d]; token t's output is the sum over its k slots of ``top_k_weights[t, j]``
        times expert ``top_k_index[t, j]`` of it, added in expert order."""
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = torch.div(order, k, rounding_mode="floor")
        experts = torch.arange(self.num_experts, device=flat.device)
        offsets = (flat.unsqueeze(1) == experts).sum(0).cumsum(0).to(torch.int32)
        rows = hidden[token]
        out = self._mlp(rows, offsets, self._products(rows))
        weight = top_k_weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(hidden).index_add(0, token, (out * weight).to(hidden.dtype))


class MoE(nn.Module):
    """Router and experts: each token to its ``top_k`` experts by softmax score, the chosen scores
    renormalised to sum to one (Mixtral's and Qwen3-MoE's routing)."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int, rank: int | None = None,
                 activation: str | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts ({num_experts}), got {top_k}")
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, ffn_dim, rank, activation)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        logits = self.router(tokens)
        scores = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)
        weights, index = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(tokens, index, weights.to(tokens.dtype)).view(b, s, d)


def experts_params(num_experts: int, dim: int, ffn_dim: int, rank: int | None) -> int:
    """Elements of :class:`Experts`' parameters, from the shapes alone."""
    per = sum(d_in * d_out if rank is None else rank * (d_in + d_out)
              for d_in, d_out in ((dim, ffn_dim), (dim, ffn_dim), (ffn_dim, dim)))
    return num_experts * per

