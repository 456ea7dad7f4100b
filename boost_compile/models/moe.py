"""The reference model's mixture-of-experts feed-forward: a router sends each token to ``top_k`` of
``n_experts`` SwiGLU experts, whose outputs are weighted by the router's renormalised scores.

    MoE.forward   x [b, s, d] -> router logits -> softmax -> top_k (weights renormalised)
                  [-> capacity: a sequence's assignments past an expert's capacity dropped]
                  -> Experts(tokens, top_k_index, top_k_weights) -> [b, s, d]

What balances the router (:class:`MoE`; every one is defined per sequence, so a batch split over
data-parallel or expert-parallel ranks gives the numbers of one process):

- ``aux_loss_coef``: the auxiliary load-balancing loss (Switch Transformer's form, computed per
  sequence as DeepSeek-V3's sequence-wise balance loss), ``E * sum_e f_e * P_e`` per sequence;
- ``capacity_factor``: each expert takes at most ``ceil(cf * s * top_k / E)`` of a sequence's
  assignments, the others dropped (the sentinel index ``E``, weight 0: the token keeps its residual);
- ``bias_rate``: DeepSeek-V3's auxiliary-loss-free balancing, a per-expert bias added to the scores
  for the selection only, moved after every optimizer step (:meth:`MoE.update_bias`).

In training (``self.training`` and grad enabled) each layer counts its routing in buffers, read
and reset after every step by :mod:`boost_compile.train.moe_balance` (metrics, bias updates).

:class:`Experts` keeps every expert's weights stacked, ``[n_experts, d_in, d_out]``: dense
``gate`` / ``up`` / ``down`` matrices, or each of them as two bottleneck factors of rank ``r``
(CoLA: a SiLU between them; plain low-rank: none). It has transformers' experts contract,
``forward(hidden [T, d], top_k_index [T, k], top_k_weights [T, k])`` with every parameter
``[num_experts, ...]``, so :func:`boost_compile.expert_parallel_` shards it by expert as it shards
Qwen3-MoE's or Mixtral's.

The experts' matrix products are grouped: the (token, slot) assignments are sorted by expert, so
each expert's rows are contiguous, and one grouped GEMM per matrix multiplies every expert's rows
by its weight (:func:`~boost_compile.models.grouped_gemm.grouped_mm`: ``torch._grouped_mm`` where
it runs, else a custom op with the kernel or a loop inside; one graph in every dtype).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from boost_compile.models.grouped_gemm import grouped_mm
from boost_compile.models.lowrank import ACTIVATIONS, cola_std

#: the three matrices of a SwiGLU expert: name -> (d_in, d_out) as "dim" / "ffn"
EXPERT_MATRICES = {"gate": ("dim", "ffn"), "up": ("dim", "ffn"), "down": ("ffn", "dim")}
INIT_STD = 0.02


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

    def _project(self, name: str, x: Tensor, offsets: Tensor) -> Tensor:
        if self.rank is None:
            return grouped_mm(x, getattr(self, name), offsets)
        latent = grouped_mm(x, getattr(self, f"{name}_down"), offsets)
        if self.activation is not None:
            latent = ACTIVATIONS[self.activation](latent)
        return grouped_mm(latent, getattr(self, f"{name}_up"), offsets)

    def _mlp(self, rows: Tensor, offsets: Tensor) -> Tensor:
        hidden = F.silu(self._project("gate", rows, offsets)) * self._project("up", rows, offsets)
        return self._project("down", hidden, offsets)

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """``hidden`` [T, d]; token t's output is the sum over its k slots of ``top_k_weights[t, j]``
        times expert ``top_k_index[t, j]`` of it, added in expert order. A slot whose index is the
        sentinel ``num_experts`` (an assignment dropped by a capacity) adds exactly nothing."""
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the sentinel sorts last: rows past the last offset
        token = torch.div(order, k, rounding_mode="floor")
        experts = torch.arange(self.num_experts, device=flat.device)
        offsets = (flat.unsqueeze(1) == experts).sum(0).cumsum(0).to(torch.int32)
        # rows past the last offset (the sentinel's) give 0 and receive 0 from every grouped product
        out = self._mlp(hidden[token], offsets)
        weight = top_k_weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(hidden).index_add(0, token, (out * weight).to(hidden.dtype))


#: MoE's buffers kept in float32 (or float64) when the model is cast to bf16 or fp16: a bias that
#: moves by ``bias_rate`` a step, and sums of the step's balance losses
FP32_BUFFERS = ("router_bias", "aux_stats")


class MoE(nn.Module):
    """Router and experts: each token to its ``top_k`` experts by softmax score, the chosen scores
    renormalised to sum to one (Mixtral's and Qwen3-MoE's routing).

    Balancing (each per sequence: the numbers do not depend on how the batch is split over ranks):

    - ``aux_loss_coef`` > 0: in training, the layer leaves :attr:`aux_loss`, the mean over the batch's
      sequences of ``E * sum_e f_e * P_e`` (``f_e``: the fraction of the sequence's (token, slot)
      assignments the router chose for expert e, before any drop; ``P_e``: expert e's softmax
      probability averaged over the sequence's tokens); only ``P`` carries a gradient (to the
      router). :class:`~boost_compile.models.llama.Llama` adds it to its loss (see there).
      Its minimum over ``P`` for balanced choices is 1.
    - ``capacity_factor``: each expert takes at most ``ceil(cf * s * top_k / E)`` of a sequence's
      assignments, first come first served in token order, then slot order; the others get the
      sentinel index ``E`` and weight 0 (the token keeps its residual; the kept weights are not
      renormalised again). None: dropless.
    - ``bias_rate`` > 0: the buffer ``router_bias`` [E] (float32, zeros, saved in checkpoints) is
      added to the scores to choose the top_k; the weights are the unbiased scores.
      :meth:`update_bias` moves it after each optimizer step (DeepSeek-V3's loss-free balancing).

    Counting (training forwards only: ``self.training`` and grad enabled, so evaluation and
    no-grad forwards do not count): ``routed_tokens`` [2, E] the step's assignments chosen (row 0)
    and kept (row 1) per expert, ``aux_stats`` [2] the sum of the sequences' balance losses and
    the number of sequences; :mod:`boost_compile.train.moe_balance` reads and resets them.
    """

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int, rank: int | None = None,
                 activation: str | None = None, *, aux_loss_coef: float = 0.0,
                 capacity_factor: float | None = None, bias_rate: float = 0.0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts ({num_experts}), got {top_k}")
        if aux_loss_coef < 0 or bias_rate < 0:
            raise ValueError(f"aux_loss_coef and bias_rate must be >= 0, got {aux_loss_coef}, {bias_rate}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (None: dropless), got {capacity_factor}")
        self.top_k, self.num_experts = top_k, num_experts
        self.aux_loss_coef, self.capacity_factor, self.bias_rate = float(aux_loss_coef), capacity_factor, float(bias_rate)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, ffn_dim, rank, activation)
        if bias_rate > 0:
            self.register_buffer("router_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("routed_tokens", torch.zeros(2, num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("aux_stats", torch.zeros(2, dtype=torch.float32), persistent=False)
        #: the last training forward's balance loss (``aux_loss_coef`` > 0), taken by the model's loss
        self.aux_loss: Tensor | None = None

    def capacity(self, seq: int) -> int:
        """The assignments of a sequence of ``seq`` tokens each expert takes: ``ceil(cf * seq * top_k / E)``."""
        assert self.capacity_factor is not None
        return math.ceil(self.capacity_factor * seq * self.top_k / self.num_experts)

    def route(self, scores: Tensor) -> tuple[Tensor, Tensor]:
        """The top_k experts of each token (by ``scores + router_bias`` with a bias) and their weights,
        the unbiased scores renormalised over the chosen: ``(index [T, k], weights [T, k])``."""
        bias = getattr(self, "router_bias", None)
        if bias is None:
            weights, index = scores.topk(self.top_k, dim=-1)
        else:
            index = (scores + bias.to(scores.dtype)).topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, index)
        return index, weights / weights.sum(-1, keepdim=True)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        logits = self.router(tokens)
        scores = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)
        index, weights = self.route(scores)
        counting = self.training and torch.is_grad_enabled()
        if self.capacity_factor is None and not counting:
            return self.experts(tokens, index, weights.to(tokens.dtype)).view(b, s, d)
        e, n = self.num_experts, s * self.top_k
        per_seq = index.view(b, n)  # a sequence's assignments in token order, then slot order
        chosen = torch.zeros(b, e, dtype=torch.long, device=x.device).scatter_add(1, per_seq, torch.ones_like(per_seq))
        kept = chosen
        if self.capacity_factor is not None:
            capacity = self.capacity(s)
            keep = within_capacity(per_seq, chosen, capacity).view(b * s, self.top_k)
            index = torch.where(keep, index, e)
            weights = torch.where(keep, weights, 0)
            kept = chosen.clamp(max=capacity)
        if counting:
            probs = scores.view(b, s, e).mean(1)  # P [b, E]
            aux = e * ((chosen.to(probs.dtype) / n) * probs).sum(-1)  # [b]: E * sum_e f_e P_e per sequence
            if self.aux_loss_coef > 0:
                self.aux_loss = aux.mean()
            with torch.no_grad():
                self.routed_tokens.add_(torch.stack((chosen.sum(0), kept.sum(0))))
                self.aux_stats.add_(torch.stack((aux.detach().sum(), aux.new_full((), b))).to(self.aux_stats.dtype))
        return self.experts(tokens, index, weights.to(tokens.dtype)).view(b, s, d)

    @torch.no_grad()
    def update_bias(self, load: Tensor) -> None:
        """DeepSeek-V3's update after an optimizer step: ``bias_e += bias_rate * sign(mean(load) - load_e)``,
        ``load`` [E] the assignments the router chose for each expert over the step's whole batch
        (every data-parallel rank's), so every rank moves its bias alike."""
        bias = getattr(self, "router_bias", None)
        if bias is None:
            return
        load = load.to(device=bias.device, dtype=torch.float64)
        bias.add_((torch.sign(load.mean() - load) * self.bias_rate).to(bias.dtype))

    @torch.no_grad()
    def reset_balance(self) -> None:
        """Zero the bias and this step's counts (a fresh model)."""
        for name in ("router_bias", "routed_tokens", "aux_stats"):
            if getattr(self, name, None) is not None:
                getattr(self, name).zero_()
        self.aux_loss = None

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> MoE:
        """``nn.Module._apply`` (``to``, ``cuda``, ``bfloat16``, ...) keeping :data:`FP32_BUFFERS` in
        at least float32: a bias of bf16 would not move by a small ``bias_rate`` at all."""
        before = {n: self._buffers[n] for n in FP32_BUFFERS if self._buffers.get(n) is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.is_floating_point() and new.dtype.itemsize < 4:
                self._buffers[name] = (new if old.is_meta else old.to(new.device)).float()
        return self


def within_capacity(index: Tensor, chosen: Tensor, capacity: int) -> Tensor:
    """Whether each assignment is among its expert's first ``capacity`` in its sequence: ``index``
    [b, n] (a sequence's assignments in order), ``chosen`` [b, E] its counts per expert; [b, n] bool.
    A stable sort by expert keeps each expert's assignments in order; an assignment's place among
    them is its position in the sort less where its expert's run starts."""
    n = index.shape[1]
    order = torch.argsort(index, dim=-1, stable=True)
    starts = (chosen.cumsum(-1) - chosen).gather(-1, index.gather(-1, order))
    place = torch.arange(n, device=index.device) - starts
    return torch.empty_like(place).scatter(-1, order, place) < capacity


def experts_params(num_experts: int, dim: int, ffn_dim: int, rank: int | None) -> int:
    """Elements of :class:`Experts`' parameters, from the shapes alone."""
    per = sum(d_in * d_out if rank is None else rank * (d_in + d_out)
              for d_in, d_out in ((dim, ffn_dim), (dim, ffn_dim), (ffn_dim, dim)))
    return num_experts * per

