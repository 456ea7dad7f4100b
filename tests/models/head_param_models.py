"""Tiny attention models with the parameters that tensor parallelism cuts by heads, or must not.

One Llama-like decoder (pre-norm, SwiGLU, eager attention) whose attention can carry, each
switched on alone or together:

- ``qk_norm="head"``: q and k normalised over head_dim, one weight shared by every head (Qwen3,
  Gemma 3). Each rank holds some heads, so each rank's gradient of that replicated weight
  covers its own heads: the whole gradient is their sum.
- ``qk_norm="head_gemma"``: the same with Gemma's weight ``1 + w`` in fp32, computed from the
  parameter before it scales anything (the replicated tensor whose gradient is partial is not
  the parameter itself).
- ``qk_norm="whole"``: q and k normalised over the whole projection, all heads at once (OLMo 2,
  OLMoE): the weight is cut like the projection's output and the statistic summed over the group.
- ``sinks``: one learned logit per head, a column next to the scores that the softmax sees and
  the values do not (gpt-oss): a per-head parameter, cut by heads.
- ``score_scale``: one learned scalar scaling every head's scores (a learned temperature):
  replicated, its gradient a sum over the ranks' heads.
- ``head_bias``: one learned scalar per head added to its scores: a per-head parameter broadcast
  from [1, H, 1, 1], cut by heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class HeadParamConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    n_layers: int = 2
    qk_norm: str | None = None  # None, "head", "head_gemma" or "whole"
    sinks: bool = False
    score_scale: bool = False
    head_bias: bool = False


class RMSNorm(nn.Module):
    """Hugging Face's form: the statistic in fp32, the weight after the cast back; ``one_plus``:
    Gemma's, ``1 + w`` in fp32 before the cast back."""

    def __init__(self, size: int, eps: float = 1e-6, one_plus: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if one_plus else torch.ones(size))
        self.eps, self.one_plus = eps, one_plus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.one_plus:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: HeadParamConfig) -> None:
        super().__init__()
        self.c = c
        self.n_heads, self.n_kv = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        if c.qk_norm in ("head", "head_gemma"):
            gemma = c.qk_norm == "head_gemma"
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, one_plus=gemma), RMSNorm(self.head_dim, one_plus=gemma)
        elif c.qk_norm == "whole":
            self.q_norm, self.k_norm = RMSNorm(self.n_heads * self.head_dim), RMSNorm(self.n_kv * self.head_dim)
        if c.sinks:
            self.sinks = nn.Parameter(torch.randn(self.n_heads) * 0.5)
        if c.score_scale:
            self.score_scale = nn.Parameter(torch.tensor(1.3))
        if c.head_bias:
            self.head_bias = nn.Parameter(torch.randn(self.n_heads) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.c.qk_norm == "whole":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, -1, self.head_dim)
        k = k.view(b, t, -1, self.head_dim)
        if self.c.qk_norm in ("head", "head_gemma"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        if self.c.score_scale:
            scores = scores * self.score_scale
        if self.c.head_bias:
            scores = scores + self.head_bias.view(1, -1, 1, 1)
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        scores = scores + mask
        if self.c.sinks:
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, t, -1)
            probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, c: HeadParamConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: HeadParamConfig) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(c.hidden_size), RMSNorm(c.hidden_size)
        self.self_attn, self.mlp = Attention(c), MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class HeadParamLM(nn.Module):
    def __init__(self, c: HeadParamConfig) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm(h))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def head_param_lm(seed: int = 0, **switches: object) -> HeadParamLM:
    """The model with ``switches`` (``HeadParamConfig`` fields) on, its weights from ``seed``; the
    norms' weights drawn around 1 so that each head's share of their gradients differs."""
    torch.manual_seed(seed)
    model = HeadParamLM(HeadParamConfig(**switches))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(p + 0.2 * torch.randn_like(p))
    return model
