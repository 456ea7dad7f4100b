"""A small Llama-style decoder whose projections can be dense, low-rank, CoLA or LaX.

Used by tests, benchmarks and the training loop. Every q/k/v/o/gate/up/down
projection is an ``nn.Linear`` (``projection="dense"``), a plain bottleneck
``LowRankLinear`` (``"lowrank"``), a CoLA bottleneck with a SiLU inside
(``"cola"``) or a LaX one (``"lax"``, :class:`LaxLinear`: a CoLA bottleneck whose
latent also receives the same projection's latent of the previous block); the
embedding and the output head always stay dense. The model is written to compile
with ``torch.compile(model, fullgraph=True)``: RoPE uses the real-valued
rotate-half form (no complex tensors) and attention goes through
``F.scaled_dot_product_attention``.

LaX's latents travel as a dict, projection name -> latent [b, s, r]: each block
takes the previous block's (``{}`` before the first) and returns its own beside
its output; the other kinds pass none and their blocks return the output alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from boost_compile.models.lowrank import LaxLinear, LowRankLinear, break_even_rank
from boost_compile.models.moe import Experts, MoE, experts_params

PROJECTIONS = ("dense", "lowrank", "cola", "lax")
#: ``norm``: Llama's RMSNorm, or LayerNorm with a bias (GPT-2, OPT and their kin)
NORMS = ("rmsnorm", "layernorm")
INIT_STD = 0.02
#: ``config.json``'s ``model_type`` for :meth:`Llama.save_pretrained`
MODEL_TYPE = "boost_llama"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# Shapes of the CoLA paper models: size -> (dim, n_layers, n_heads, ffn_dim, rank, max_seq_len).
PAPER_SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "60m": (512, 8, 8, 1376, 128, 1024),
    "130m": (768, 12, 12, 2048, 256, 1024),
    "350m": (1024, 24, 16, 2736, 256, 1024),
    "1b": (2048, 24, 32, 5461, 512, 4096),
    "7b": (4096, 32, 32, 11008, 1024, 4096),
}
# Preset family prefix -> projection kind.
FAMILIES = {"cola": "cola", "lowrank": "lowrank", "llama": "dense", "lax": "lax"}
TINY = {
    "vocab_size": 256,
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 176,
    "max_seq_len": 64,
    "rank_attn": 16,
    "rank_mlp": 16,
}
#: TINY's mixture-of-experts form: every block's MLP four experts of half the width, two per token
TINY_MOE = {"n_experts": 4, "experts_top_k": 2, "expert_ffn_dim": 88}


def _preset_table() -> dict[str, dict]:
    """Build the preset name -> config kwargs table (a fresh dict on every call)."""
    table: dict[str, dict] = {
        "tiny": {**TINY, "projection": "cola"},
        "tiny-dense": {**TINY, "projection": "dense", "rank_attn": None, "rank_mlp": None},
        "tiny-lowrank": {**TINY, "projection": "lowrank"},
        "tiny-lax": {**TINY, "projection": "lax"},
        "tiny-moe": {**TINY, **TINY_MOE, "projection": "cola"},
        "tiny-moe-dense": {**TINY, **TINY_MOE, "projection": "dense", "rank_attn": None, "rank_mlp": None},
    }
    for size, (dim, layers, heads, ffn, rank, seq) in PAPER_SHAPES.items():
        for family, projection in FAMILIES.items():
            dense = projection == "dense"
            table[f"{family}-{size}"] = {
                "vocab_size": 32000,
                "dim": dim,
                "n_layers": layers,
                "n_heads": heads,
                "n_kv_heads": heads,
                "ffn_dim": ffn,
                "max_seq_len": seq,
                "projection": projection,
                "rank_attn": None if dense else rank,
                "rank_mlp": None if dense else rank,
            }
    return table


#: the MLP's projections (under ``n_experts`` each expert's matrices)
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def block_projections(
    dim: int, kv_dim: int, ffn_dim: int, rank_attn: int | None, rank_mlp: int | None
) -> dict[str, tuple[int, int, int | None]]:
    """A Llama block's projections: name -> (d_in, d_out, rank), rank None for a dense one."""
    return {
        "q_proj": (dim, dim, rank_attn),
        "k_proj": (dim, kv_dim, rank_attn),
        "v_proj": (dim, kv_dim, rank_attn),
        "o_proj": (dim, dim, rank_attn),
        "gate_proj": (dim, ffn_dim, rank_mlp),
        "up_proj": (dim, ffn_dim, rank_mlp),
        "down_proj": (ffn_dim, dim, rank_mlp),
    }


@dataclass
class LlamaConfig:
    """Shape and projection kind of a :class:`Llama` model.

    ``rank_attn`` / ``rank_mlp`` are the bottleneck ranks of the attention and
    MLP projections; they default to ``dim // 4`` for the low-rank kinds and are
    ignored when ``projection == "dense"``.

    ``n_experts`` > 0 makes every block's MLP a mixture of experts (:class:`~boost_compile.models.moe.MoE`):
    a router and ``n_experts`` SwiGLU experts of width ``expert_ffn_dim`` (default ``ffn_dim``),
    ``experts_top_k`` of them per token, each expert's matrices of the model's projection kind
    (dense, or bottlenecks of rank ``rank_mlp``; LaX's crossing latents have no expert form).

    What balances the router (:class:`~boost_compile.models.moe.MoE`; each is defined per sequence,
    so every data- or expert-parallel layout gives the numbers of one process):

    ``router_aux_loss_coef`` (0: off): the weight of the auxiliary load-balancing loss in the
    gradient. Per sequence, ``aux = E * sum_e f_e * P_e`` (``f_e``: the fraction of the
    sequence's (token, slot) assignments the router chose for expert e; ``P_e``: expert e's
    softmax probability averaged over its tokens); the model's aux loss is the mean over the MoE
    layers and the batch's sequences (1 for balanced routing). ``Llama.forward(tokens, targets)``
    returns the cross-entropy whose gradient includes ``router_aux_loss_coef * aux``; its value
    stays the cross-entropy (see :meth:`Llama.forward`).

    ``expert_capacity_factor`` (None: dropless): each expert takes at most
    ``ceil(cf * seq * experts_top_k / n_experts)`` of a sequence's assignments, in token order then
    slot order; the others are dropped (the token keeps its residual and its other slots; the kept
    weights are not renormalised again).

    ``router_bias_rate`` (0: off): DeepSeek-V3's auxiliary-loss-free balancing. A per-expert bias
    (buffer ``router_bias``, float32, saved in checkpoints) is added to the router's scores to
    choose the experts, not to weight them; after every optimizer step boost-train moves it by
    ``rate * sign(mean load - load_e)``, the loads summed over the step's whole batch.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    projection: str = "dense"
    rank_attn: int | None = None
    rank_mlp: int | None = None
    bias: bool = False
    norm: str = "rmsnorm"
    n_experts: int = 0
    experts_top_k: int = 2
    expert_ffn_dim: int | None = None
    router_aux_loss_coef: float = 0.0
    expert_capacity_factor: float | None = None
    router_bias_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.projection not in PROJECTIONS:
            raise ValueError(
                f"unknown projection {self.projection!r}; valid choices: {', '.join(PROJECTIONS)}"
            )
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim = dim / n_heads ({self.head_dim}) must be even for RoPE")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")
        if self.norm not in NORMS:
            raise ValueError(f"unknown norm {self.norm!r}; valid choices: {', '.join(NORMS)}")
        self._check_experts()
        if self.projection == "dense":
            return
        if self.rank_attn is None:
            self.rank_attn = max(1, self.dim // 4)
        if self.rank_mlp is None:
            self.rank_mlp = max(1, self.dim // 4)
        for group, rank in (("rank_attn", self.rank_attn), ("rank_mlp", self.rank_mlp)):
            if not isinstance(rank, int) or rank < 1:
                raise ValueError(f"{group} must be a positive integer, got {rank!r}")
        for name, (d_in, d_out, rank) in self.projection_shapes().items():
            limit = break_even_rank(d_in, d_out)
            if rank >= limit:
                group = "rank_mlp" if name in ("gate_proj", "up_proj", "down_proj") else "rank_attn"
                raise ValueError(
                    f"{group}={rank} is not below the break-even rank {limit:.1f} of {name} "
                    f"({d_in} -> {d_out}); a factorisation that large saves nothing"
                )

    def _check_experts(self) -> None:
        if not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ValueError(f"n_experts must be a non-negative integer (0: dense MLPs), got {self.n_experts!r}")
        self._check_balance()
        if not self.n_experts:
            return
        if self.projection == "lax":
            raise ValueError("n_experts: a LaX model's MLP latents cross between blocks, which experts cannot; "
                             "use projection cola, lowrank or dense")
        if not isinstance(self.experts_top_k, int) or not 1 <= self.experts_top_k <= self.n_experts:
            raise ValueError(f"experts_top_k must be between 1 and n_experts ({self.n_experts}), got {self.experts_top_k!r}")
        if self.expert_ffn_dim is None:
            self.expert_ffn_dim = self.ffn_dim
        if not isinstance(self.expert_ffn_dim, int) or self.expert_ffn_dim < 1:
            raise ValueError(f"expert_ffn_dim must be a positive integer, got {self.expert_ffn_dim!r}")

    def _check_balance(self) -> None:
        """The router's balance and capacity: numbers in range, and only for a mixture of experts."""
        def number(value: Any) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        for name in ("router_aux_loss_coef", "router_bias_rate"):
            value = getattr(self, name)
            if not number(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0 (0: off), got {value!r}")
        cf = self.expert_capacity_factor
        if cf is not None and (not number(cf) or cf <= 0):
            raise ValueError(f"expert_capacity_factor must be a number > 0 (null: dropless), got {cf!r}")
        used = [name for name in ("router_aux_loss_coef", "router_bias_rate", "expert_capacity_factor")
                if getattr(self, name)]
        if used and not self.n_experts:
            raise ValueError(f"{', '.join(used)} balance a mixture of experts' router; set n_experts > 0 "
                             "(or use model=tiny-moe)")

    @property
    def moe(self) -> bool:
        """Whether every block's MLP is a mixture of experts."""
        return self.n_experts > 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def projection_shapes(self) -> dict[str, tuple[int, int, int | None]]:
        """Per-block projection name -> (d_in, d_out, rank); rank is None when dense."""
        dense = self.projection == "dense"
        ffn = self.expert_ffn_dim if self.moe else self.ffn_dim
        return block_projections(self.dim, self.kv_dim, ffn, None if dense else self.rank_attn,
                                 None if dense else self.rank_mlp)

    def num_params(self) -> int:
        """Parameter count computed from the shapes alone (matches ``Llama.num_params``)."""
        norm = self.dim * (2 if self.norm == "layernorm" else 1)  # weight (and bias) of one norm
        block = 2 * norm  # attention_norm and ffn_norm
        for name, (d_in, d_out, rank) in self.projection_shapes().items():
            if self.moe and name in MLP_PROJECTIONS:
                continue
            block += d_in * d_out if rank is None else rank * (d_in + d_out)
            block += d_out if self.bias else 0
        if self.moe:  # the router and the stacked experts (no biases)
            rank = None if self.projection == "dense" else self.rank_mlp
            block += self.n_experts * self.dim + experts_params(self.n_experts, self.dim, self.expert_ffn_dim, rank)
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return embed + self.n_layers * block + norm + head

    @classmethod
    def presets(cls) -> list[str]:
        """Names accepted by :meth:`preset`."""
        return list(_preset_table())

    @classmethod
    def preset(cls, name: str, **overrides) -> LlamaConfig:
        """Config of a named preset (``tiny``, ``cola-60m``, ``llama-1b``, ...) with overrides."""
        table = _preset_table()
        if name not in table:
            raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(table)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(
                f"unknown LlamaConfig field(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}"
            )
        kwargs = {**table[name], **overrides}
        if kwargs["projection"] == "dense" and "projection" in overrides:
            # switching a low-rank preset to dense: drop the preset's ranks unless given
            for key in ("rank_attn", "rank_mlp"):
                if key not in overrides:
                    kwargs[key] = None
        return cls(**kwargs)


#: LaX's latents between two blocks: projection name (``q_proj``, ...) -> its latent [b, s, r]
Latents = dict[str, Tensor]


def make_projection(d_in: int, d_out: int, rank: int | None, kind: str, bias: bool) -> nn.Module:
    """A dense, plain low-rank, CoLA or LaX projection ``d_in -> d_out``."""
    if kind == "dense":
        return nn.Linear(d_in, d_out, bias=bias)
    if rank is None:
        raise ValueError(f"projection {kind!r} needs a rank")
    if kind == "lax":
        return LaxLinear(d_in, d_out, rank, bias=bias)
    activation = "silu" if kind == "cola" else None
    return LowRankLinear(d_in, d_out, rank, bias=bias, activation=activation)


def project(proj: nn.Module, name: str, x: Tensor, prev: Latents | None, own: Latents | None) -> Tensor:
    """``proj(x)``; for LaX (``own`` given) the projection also adds ``prev[name]``, the same
    projection's latent of the previous block (none in the first block), and leaves its own
    latent in ``own[name]`` for the next block."""
    if own is None:
        return proj(x)
    y, own[name] = proj(x, prev.get(name) if prev else None)
    return y


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin tables [max_seq_len, head_dim] for the rotate-half RoPE form."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: Tensor) -> Tensor:
    """Map the halves (x1, x2) of the last dimension to (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [b, heads, s, head_dim] by position; cos/sin are [s, head_dim]."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Repeat each kv head n_rep times: [b, kv, s, hd] -> [b, kv * n_rep, s, hd]."""
    if n_rep == 1:
        return x
    b, kv, s, hd = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, s, hd).reshape(b, kv * n_rep, s, hd)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        kind, bias = config.projection, config.bias
        shapes = config.projection_shapes()
        self.q_proj = make_projection(*shapes["q_proj"], kind, bias)
        self.k_proj = make_projection(*shapes["k_proj"], kind, bias)
        self.v_proj = make_projection(*shapes["v_proj"], kind, bias)
        self.o_proj = make_projection(*shapes["o_proj"], kind, bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, prev: Latents | None = None,
                own: Latents | None = None) -> Tensor:
        """Attention over ``x`` [b, s, dim]; ``prev`` / ``own``: LaX's latents (see :func:`project`)."""
        b, s, _ = x.shape
        # Head counts come from the tensors (-1), not the config, so a tensor-parallel
        # rank that holds a slice of the heads runs the same code on its local heads.
        q = project(self.q_proj, "q_proj", x, prev, own).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = project(self.k_proj, "k_proj", x, prev, own).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = project(self.v_proj, "v_proj", x, prev, own).view(b, s, -1, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        n_rep = q.shape[1] // k.shape[1]
        k = repeat_kv(k, n_rep)
        v = repeat_kv(v, n_rep)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(b, s, -1)
        return project(self.o_proj, "o_proj", out, prev, own)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        kind, bias = config.projection, config.bias
        shapes = config.projection_shapes()
        self.gate_proj = make_projection(*shapes["gate_proj"], kind, bias)
        self.up_proj = make_projection(*shapes["up_proj"], kind, bias)
        self.down_proj = make_projection(*shapes["down_proj"], kind, bias)

    def forward(self, x: Tensor, prev: Latents | None = None, own: Latents | None = None) -> Tensor:
        """The MLP of ``x``; ``prev`` / ``own``: LaX's latents (see :func:`project`)."""
        gate = F.silu(project(self.gate_proj, "gate_proj", x, prev, own))
        hidden = gate * project(self.up_proj, "up_proj", x, prev, own)
        return project(self.down_proj, "down_proj", hidden, prev, own)


def make_norm(config: LlamaConfig) -> nn.Module:
    """The block and final norm over ``dim``: RMSNorm, or LayerNorm with a bias."""
    if config.norm == "layernorm":
        return nn.LayerNorm(config.dim, eps=config.norm_eps)
    return nn.RMSNorm(config.dim, eps=config.norm_eps)


def make_mlp(config: LlamaConfig) -> nn.Module:
    """The block's feed-forward: the SwiGLU MLP, or with ``n_experts`` a mixture of such experts."""
    if not config.moe:
        return MLP(config)
    rank = None if config.projection == "dense" else config.rank_mlp
    activation = "silu" if config.projection == "cola" else None
    if config.bias:
        raise ValueError("n_experts: the experts have no biases; use bias=False")
    return MoE(config.dim, config.expert_ffn_dim, config.n_experts, config.experts_top_k, rank, activation,
               aux_loss_coef=config.router_aux_loss_coef, capacity_factor=config.expert_capacity_factor,
               bias_rate=config.router_bias_rate)


class Block(nn.Module):
    """Pre-norm decoder block: attention then MLP, each with a residual."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = make_norm(config)
        self.attention = Attention(config)
        self.ffn_norm = make_norm(config)
        self.mlp = make_mlp(config)
        self.crossing = config.projection == "lax"

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                latents: Latents | None = None) -> Tensor | tuple[Tensor, Latents]:
        """The block's output; a LaX block (``latents``: the previous block's, ``{}`` for the
        first) returns ``(output, its own latents)``. ``latents`` itself is left unchanged."""
        if self.crossing and latents is None:
            raise TypeError(
                "a LaX block adds the previous block's latents: call it as block(x, cos, sin, latents) "
                "with the latents the block before returned ({} for the first block)"
            )
        own: Latents | None = None if latents is None else {}
        h = x + self.attention(self.attention_norm(x), cos, sin, latents, own)
        ffn_in = self.ffn_norm(h)
        out = h + (self.mlp(ffn_in) if own is None else self.mlp(ffn_in, latents, own))
        return out if own is None else (out, own)


class Llama(nn.Module):
    """Llama-style decoder; ``forward(tokens)`` gives logits, with ``targets`` the mean loss."""

    def __init__(self, config: LlamaConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        with torch.device(device) if device is not None else nullcontext():
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.norm = make_norm(config)
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
            if config.tie_embeddings:
                self.output.weight = self.tok_embeddings.weight
            cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Embeddings and dense linears N(0, 0.02), bottlenecks CoLA init, norms ones, experts as
        :meth:`Experts.reset_parameters`.

        Also recomputes the RoPE tables, so a model built on ``meta`` and moved
        with ``to_empty`` becomes usable after calling this.
        """
        factors: set[int] = set()
        for module in self.modules():
            if isinstance(module, LowRankLinear):
                module.reset_parameters("cola")
                factors.update((id(module.down), id(module.up)))
        for module in self.modules():
            if isinstance(module, nn.Linear) and id(module) not in factors:
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, Experts):
                module.reset_parameters()
            elif isinstance(module, MoE):
                module.reset_balance()
            elif isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        self.reset_rope()

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Recompute the RoPE tables (buffers, not saved in the state dict)."""
        cfg = self.config
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.rope_cos.copy_(cos.to(self.rope_cos.device))
        self.rope_sin.copy_(sin.to(self.rope_sin.device))

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits [b, s, vocab]; with ``targets`` the mean cross-entropy.

        With ``router_aux_loss_coef`` > 0, in training, the loss's gradient also has the routers'
        balance loss: ``ce + coef * (aux - aux.detach())`` adds exactly zero to the value (the
        cross-entropy, comparable with runs without it) and ``coef * d aux`` to the gradient, so it
        is scaled as the loss is (gradient accumulation's ``1 / micro_steps``, DDP's mean). ``aux``
        is the mean over the MoE layers of their :attr:`MoE.aux_loss`. Without ``targets`` the
        layers' aux losses are left on them (``layer.mlp.aux_loss``) for a loss of the caller's own.
        """
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.config.max_seq_len}")
        h = self.tok_embeddings(tokens)
        cos = self.rope_cos[:seq].to(h.dtype)
        sin = self.rope_sin[:seq].to(h.dtype)
        latents: Latents | None = {} if self.config.projection == "lax" else None
        for layer in self.layers:
            if latents is None:
                h = layer(h, cos, sin)
            else:  # LaX: each block's latents cross into the next block's projections
                h, latents = layer(h, cos, sin, latents)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        logits = logits.flatten(0, 1)
        if logits.dtype != torch.float64:  # the loss in fp32 (bf16 logits upcast), an fp64 model's in fp64
            logits = logits.float()
        aux = self._router_aux_loss()
        if aux is None:  # returned as it is: the graph's node keeps the name cross_entropy (explain, TP reports)
            return F.cross_entropy(logits, targets.flatten())
        # zero in value, the balance loss's gradient in the backward
        return F.cross_entropy(logits, targets.flatten()) + \
            self.config.router_aux_loss_coef * (aux - aux.detach()).to(logits.dtype)

    def _router_aux_loss(self) -> Tensor | None:
        """The mean of the MoE layers' balance losses of this forward (taken off them), or None."""
        losses = []
        for layer in self.layers:
            moe = getattr(layer, "mlp", None)
            if isinstance(moe, MoE) and moe.aux_loss is not None:
                losses.append(moe.aux_loss)
                moe.aux_loss = None
        return torch.stack(losses).mean() if losses else None

    def num_params(self) -> int:
        """Number of distinct parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------------- save / load

    def save_pretrained(self, save_directory: str | os.PathLike, safe_serialization: bool = True) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into ``save_directory``.

        ``config.json`` holds the :class:`LlamaConfig` fields, ``model_type``,
        ``dtype`` and, for a dense config whose linears ``factorize_`` turned into
        bottlenecks, ``lowrank_layers`` (each one's shape and activation), so
        :meth:`from_pretrained` rebuilds the same modules and loads the weights
        bit for bit. Only safetensors is written (``safe_serialization=False`` is refused).
        """
        if not safe_serialization:
            raise ValueError("Llama.save_pretrained writes safetensors only (safe_serialization=True)")
        from safetensors.torch import save_model

        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_FILE).write_text(json.dumps(self.pretrained_config(), indent=2) + "\n")
        save_model(self, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        return out

    def pretrained_config(self) -> dict[str, Any]:
        """What :meth:`save_pretrained` writes as ``config.json`` (the model may be on meta)."""
        dtype = next(self.parameters()).dtype
        config = {"model_type": MODEL_TYPE, **dataclasses.asdict(self.config), "dtype": str(dtype).removeprefix("torch.")}
        layers = lowrank_layout(self)
        if layers and self.config.projection == "dense":
            config["lowrank_layers"] = layers
        return config

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, device: torch.device | str | None = None
    ) -> Llama:
        """The model :meth:`save_pretrained` or ``boost-export`` wrote (same modules, same dtype, same
        bits; one safetensors file or shards with their index)."""
        from boost_compile.safetensors_writer import load_folder_into

        folder = Path(path)
        config = json.loads((folder / CONFIG_FILE).read_text())
        model_type = config.pop("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(
                f"{folder / CONFIG_FILE} has model_type {model_type!r}, not {MODEL_TYPE!r}; "
                "a Hugging Face model loads with transformers.AutoModelForCausalLM.from_pretrained"
            )
        dtype = getattr(torch, config.pop("dtype", "float32"))
        layers = config.pop("lowrank_layers", {})
        with torch.device("meta"):
            model = cls(LlamaConfig(**config))
        apply_lowrank_layout(model, layers)
        model.to_empty(device=device or "cpu")
        for module in model.modules():  # the routers' step counts (not saved) start at zero
            if isinstance(module, MoE):
                module.reset_balance()
        if model.config.tie_embeddings:  # to_empty off meta makes a new tensor per module
            model.output.weight = model.tok_embeddings.weight
        model.reset_rope()
        model.to(dtype)  # as boost-train's bf16-true casts (the RoPE buffers too)
        load_folder_into(model, folder)
        return model


def lowrank_layout(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Every :class:`LowRankLinear` of ``model``: fqn -> its shape, bias and activation."""
    return {
        name: {
            "in_features": m.in_features,
            "out_features": m.out_features,
            "rank": m.rank,
            "bias": m.up.bias is not None,
            "activation": m.activation,
        }
        for name, m in model.named_modules()
        if isinstance(m, LowRankLinear)
    }


def apply_lowrank_layout(model: nn.Module, layers: dict[str, dict[str, Any]]) -> None:
    """Replace the modules named in ``layers`` (from :func:`lowrank_layout`) by such bottlenecks.

    The new modules are created on the device and dtype of the module they
    replace; their weights are to be loaded afterwards.
    """
    for fqn, spec in layers.items():
        old = model.get_submodule(fqn)
        ref = next(old.parameters(), None)
        factory = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
        new = LowRankLinear(
            spec["in_features"], spec["out_features"], spec["rank"],
            bias=spec["bias"], activation=spec["activation"], **factory,
        )
        parent, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
