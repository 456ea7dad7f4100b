"""A zoo of tiny language models written the way their communities write them.

Each builder returns ``(model, loss_fn)`` with ``loss_fn(model, tokens) -> loss``
for ``tokens`` a LongTensor [B, T] (the tests use [2, 16]). Every loss is the
next-token loss over the B x (T - 1) predicted positions: the model reads the full
``tokens`` and position t is scored against ``tokens[:, t + 1]`` (Hugging Face
shifts inside its loss, the others shift in ``loss_fn`` or, for nanoGPT, in the
targets it is given, with the last position set to nanoGPT's ``ignore_index=-1``).

All models are tiny (d=64, 2 layers, 4 heads, vocab 256, up to 32 positions), fp32,
dropout-free, and deterministic: each builder calls ``torch.manual_seed(seed)``
before it creates a parameter. The code of each style is written from scratch,
after the published shape of that style (nanoGPT's ``model.py``, Meta's llama
``model.py``, CoLA's raw-parameter ``ColaLayer``, Hugging Face configs); the
quirks are kept on purpose -- they are what the compiler has to cope with.

``STYLES`` maps a name to a zero-argument builder (``Built``: one build per process, copies of it).
"""

# Meta's llama code writes Optional[...]; kept as written
# ruff: noqa: UP045

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.nn import functional as F

import boost_compile

VOCAB = 256
DIM = 64
N_LAYERS = 2
N_HEADS = 4
MAX_SEQ = 32
RANK_RATIO = 0.25

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
Builder = Callable[[], tuple[nn.Module, LossFn]]


def _factorize(model: nn.Module) -> None:
    """The block linears -> SVD bottlenecks at r = d/4 (embedding and head stay dense)."""
    boost_compile.factorize_(model, boost_compile.FactorizeConfig(rank_ratio=RANK_RATIO))


# =============================================================================
# 1. nanoGPT (Karpathy's model.py, in its own style)
# =============================================================================


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False"""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class RMSNorm(nn.Module):
    """RMSNorm in the same hand-written style (no bias)"""

    def __init__(self, ndim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(ndim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class HandLayerNorm(nn.Module):
    """LayerNorm spelled out by hand, as tutorials write it (btp cannot give it the whole statistics)"""

    def __init__(self, ndim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def make_norm(config):
    if config.norm == "layer":
        return LayerNorm(config.n_embd, bias=config.bias)
    if config.norm == "hand-layer":
        return HandLayerNorm(config.n_embd)
    return RMSNorm(config.n_embd)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.fused_qkv = config.fused_qkv
        if self.fused_qkv:
            # key, query, value projections for all heads, but in a batch
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        else:
            self.q_attn = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
            self.k_attn = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
            self.v_attn = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # flash attention make GPU go brrrrr but support is only in PyTorch >= 2.0
        self.flash = hasattr(torch.nn.functional, 'scaled_dot_product_attention')
        if not self.flash:
            print("WARNING: using slow attention. Flash Attention requires PyTorch >= 2.0")
            # causal mask to ensure that attention is only applied to the left in the input sequence
            self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                        .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size() # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        if self.fused_qkv:
            q, k, v  = self.c_attn(x).split(self.n_embd, dim=2)
        else:
            q, k, v = self.q_attn(x), self.k_attn(x), self.v_attn(x)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        if self.flash:
            # efficient attention using Flash Attention CUDA kernels
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                                                 is_causal=True)
        else:
            # manual implementation of attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:,:,:T,:T] == 0, float('-inf'))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C) # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc    = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu    = nn.GELU()
        self.c_proj  = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = MAX_SEQ
    vocab_size: int = VOCAB
    n_layer: int = N_LAYERS
    n_head: int = N_HEADS
    n_embd: int = DIM
    dropout: float = 0.0
    bias: bool = False # True: bias in Linears and LayerNorms, like GPT-2. False: a bit better and faster
    fused_qkv: bool = True # False: three linears q_attn/k_attn/v_attn instead of c_attn
    norm: str = "rms" # "rms", "layer" or "hand-layer"


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config

        self.transformer = nn.ModuleDict(dict(
            wte = nn.Embedding(config.vocab_size, config.n_embd),
            wpe = nn.Embedding(config.block_size, config.n_embd),
            drop = nn.Dropout(config.dropout),
            h = nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f = make_norm(config),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # with weight tying when using torch.compile() some warnings get generated:
        # "UserWarning: functional_call was passed multiple values for tied weights.
        # This behavior is deprecated and will be an error in future versions"
        # not 100% sure what this is, so far seems to be harmless. TODO investigate
        self.transformer.wte.weight = self.lm_head.weight # https://paperswithcode.com/method/weight-tying

        # init all weights
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02/math.sqrt(2 * config.n_layer))

    def get_num_params(self, non_embedding=True):
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device) # shape (t)

        # forward the GPT model itself
        tok_emb = self.transformer.wte(idx) # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos) # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)

        if targets is not None:
            # if we are given some desired targets also calculate the loss
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            logits = self.lm_head(x[:, [-1], :]) # note: using list [-1] to preserve the time dim
            loss = None

        return logits, loss


def nanogpt_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """nanoGPT's (x, y) pair from one token window: y is x shifted by one; the
    last position has no next token and gets nanoGPT's ignore_index -1."""
    targets = torch.cat([tokens[:, 1:], tokens.new_full((tokens.size(0), 1), -1)], dim=1)
    _, loss = model(tokens, targets)
    return loss


def nanogpt(
    fused_qkv: bool = True, low_rank: bool = False, norm: str = "rms", bias: bool = False, seed: int = 0,
    stream_mean: float = 0.0,
) -> tuple[nn.Module, LossFn]:
    """nanoGPT: learned positions, tied head, c_attn (fused) or q/k/v_attn (split), GELU MLP.

    ``low_rank``: ``factorize_`` turns the block linears (c_attn or q/k/v_attn,
    attn.c_proj, c_fc, mlp.c_proj) into bottlenecks; wte/wpe and the tied head stay dense.
    ``stream_mean``: added to the position embeddings, so the residual stream's mean is that
    many times its spread (0.02): a norm's variance must survive a large mean.
    """
    if norm not in ("rms", "layer", "hand-layer"):
        raise ValueError(f"norm must be 'rms', 'layer' or 'hand-layer', got {norm!r}")
    torch.manual_seed(seed)
    model = GPT(GPTConfig(fused_qkv=fused_qkv, norm=norm, bias=bias))
    if stream_mean:
        with torch.no_grad():
            model.transformer.wpe.weight.add_(stream_mean * 0.02)
    if low_rank:
        _factorize(model)
    assert model.transformer.wte.weight is model.lm_head.weight
    return model, nanogpt_loss


# =============================================================================
# 2. Meta's original llama model.py (without fairscale)
# =============================================================================


@dataclass
class ModelArgs:
    dim: int = DIM
    n_layers: int = N_LAYERS
    n_heads: int = N_HEADS
    n_kv_heads: Optional[int] = None
    vocab_size: int = VOCAB
    multiple_of: int = 32  # make SwiGLU hidden layer size multiple of large power of 2
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000

    max_batch_size: int = 2
    max_seq_len: int = MAX_SEQ


class MetaRMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex64
    return freqs_cis


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    assert 0 <= 1 < ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    freqs_cis: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """torch.repeat_interleave(x, dim=2, repeats=n_rep)"""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        model_parallel_size = 1  # fairscale's get_model_parallel_world_size(), unsharded
        self.n_local_heads = args.n_heads // model_parallel_size
        self.n_local_kv_heads = self.n_kv_heads // model_parallel_size
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads

        # ColumnParallelLinear / RowParallelLinear at model_parallel_size 1
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        freqs_cis: torch.Tensor,
        mask: Optional[torch.Tensor],
    ):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)

        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)

        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        # training-style forward: no KV cache, the keys/values are this call's
        keys = xk
        values = xv

        # repeat k/v heads if n_kv_heads < n_heads
        keys = repeat_kv(keys, self.n_rep)  # (bs, seqlen, n_local_heads, head_dim)
        values = repeat_kv(values, self.n_rep)  # (bs, seqlen, n_local_heads, head_dim)

        xq = xq.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)
        keys = keys.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)
        values = values.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask  # (bs, n_local_heads, seqlen, seqlen)
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)  # (bs, n_local_heads, seqlen, head_dim)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        multiple_of: int,
        ffn_dim_multiplier: Optional[float],
    ):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        # custom dim factor multiplier
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)

        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.head_dim = args.dim // args.n_heads
        self.attention = Attention(args)
        self.feed_forward = FeedForward(
            dim=args.dim,
            hidden_dim=4 * args.dim,
            multiple_of=args.multiple_of,
            ffn_dim_multiplier=args.ffn_dim_multiplier,
        )
        self.layer_id = layer_id
        self.attention_norm = MetaRMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = MetaRMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        freqs_cis: torch.Tensor,
        mask: Optional[torch.Tensor],
    ):
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params = params
        self.vocab_size = params.vocab_size
        self.n_layers = params.n_layers

        # VocabParallelEmbedding / ColumnParallelLinear at model_parallel_size 1
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)

        self.layers = torch.nn.ModuleList()
        for layer_id in range(params.n_layers):
            self.layers.append(TransformerBlock(layer_id, params))

        self.norm = MetaRMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)

        self.freqs_cis = precompute_freqs_cis(
            params.dim // params.n_heads,
            params.max_seq_len * 2,
            params.rope_theta,
        )

    # Meta decorates this with @torch.inference_mode(); a training forward drops it
    def forward(self, tokens: torch.Tensor, start_pos: int = 0):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]

        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device)

            mask = torch.triu(mask, diagonal=1)

            # When performing key-value caching, we compute the attention scores
            # only for the new sequence. Thus, the matrix of scores is of size
            # (seqlen, cache_len + seqlen), and the only masked entries are (i, j) for
            # j > cache_len + i, since row i corresponds to token cache_len + i.
            mask = torch.hstack(
                [torch.zeros((seqlen, start_pos), device=tokens.device), mask]
            ).type_as(h)

        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        h = self.norm(h)
        output = self.output(h).float()
        return output


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of position t against ``tokens[:, t + 1]``."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def meta_llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return next_token_loss(model(tokens), tokens)


def meta_llama(n_kv_heads: int = 2, low_rank: bool = False, seed: int = 0) -> tuple[nn.Module, LossFn]:
    """Meta's llama: complex RoPE (``self.freqs_cis`` plain attribute), explicit
    masked attention, GQA by expand+reshape, SwiGLU with multiple_of rounding."""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(n_kv_heads=n_kv_heads))
    if low_rank:
        _factorize(model)
    return model, meta_llama_loss


# =============================================================================
# 3. CoLA's own style: raw factor parameters, no nn.Linear inside
# =============================================================================


@dataclass
class ColaConfig:
    vocab_size: int = VOCAB
    hidden_size: int = DIM
    intermediate_size: int = 128
    num_hidden_layers: int = N_LAYERS
    num_attention_heads: int = N_HEADS
    num_key_value_heads: int = 2
    attn_rank: int = DIM // 4
    mlp_rank: int = DIM // 4
    max_position_embeddings: int = MAX_SEQ
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class ColaLayer(nn.Module):
    """y = silu(x A) B: a low-rank projection with a nonlinearity in the bottleneck."""

    def __init__(self, in_features, out_features, rank):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        target_sdv = (in_features + out_features) ** (-1 / 2)
        std = (rank ** (-1 / 4)) * (target_sdv ** (1 / 2))
        self.A = nn.Parameter(torch.randn(in_features, rank) * std)  # [d_in, r]
        self.B = nn.Parameter(torch.randn(rank, out_features) * std)  # [r, d_out]

    def forward(self, x):
        return F.silu(x @ self.A) @ self.B

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


class ColaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class ColaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings).float()
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :], persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:, :, :seq_len, ...], self.sin_cached[:, :, :seq_len, ...]


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class ColaAttention(nn.Module):
    def __init__(self, config: ColaConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        r = config.attn_rank
        self.q_proj = ColaLayer(self.hidden_size, self.num_heads * self.head_dim, r)
        self.k_proj = ColaLayer(self.hidden_size, self.num_key_value_heads * self.head_dim, r)
        self.v_proj = ColaLayer(self.hidden_size, self.num_key_value_heads * self.head_dim, r)
        self.o_proj = ColaLayer(self.num_heads * self.head_dim, self.hidden_size, r)
        self.rotary_emb = ColaRotaryEmbedding(self.head_dim, config.max_position_embeddings, config.rope_theta)

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        cos, sin = self.rotary_emb(value_states, seq_len=q_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)

        attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=True)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class ColaMLP(nn.Module):
    def __init__(self, config: ColaConfig):
        super().__init__()
        r = config.mlp_rank
        self.gate_proj = ColaLayer(config.hidden_size, config.intermediate_size, r)
        self.up_proj = ColaLayer(config.hidden_size, config.intermediate_size, r)
        self.down_proj = ColaLayer(config.intermediate_size, config.hidden_size, r)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ColaDecoderLayer(nn.Module):
    def __init__(self, config: ColaConfig):
        super().__init__()
        self.self_attn = ColaAttention(config)
        self.mlp = ColaMLP(config)
        self.input_layernorm = ColaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = ColaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class ColaForCausalLM(nn.Module):
    def __init__(self, config: ColaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([ColaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = ColaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states)
        hidden_states = self.norm(hidden_states)
        return self.lm_head(hidden_states)


def raw_cola_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return next_token_loss(model(tokens), tokens)


def raw_cola(seed: int = 0, spelling: str = "matmul") -> tuple[nn.Module, LossFn]:
    """CoLA with raw A/B parameters (``x @ A``): 7 silu bottlenecks per block, GQA 4/2.

    ``spelling="transposed"``: the same factors stored [r, d_in] and [d_out, r] (nn.Linear's
    layout) and read as ``x.matmul(torch.t(A))`` and ``h @ B.T``.
    """
    torch.manual_seed(seed)
    model = ColaForCausalLM(ColaConfig())
    if spelling == "transposed":
        for layer in [m for m in model.modules() if isinstance(m, ColaLayer)]:
            layer.__class__ = TransposedColaLayer
            with torch.no_grad():
                layer.A = nn.Parameter(layer.A.t().contiguous())
                layer.B = nn.Parameter(layer.B.t().contiguous())
    return model, raw_cola_loss


class TransposedColaLayer(ColaLayer):
    """ColaLayer with its factors in nn.Linear's [out, in] layout, read through transposes."""

    def forward(self, x):
        return F.silu(x.matmul(torch.t(self.A))) @ self.B.T


# =============================================================================
# 3b. LaX (latent crossing) in CoLA's raw-parameter style
# =============================================================================


class LaxLayer(ColaLayer):
    """y = (silu(x A) + h_prev) B: a CoLA layer whose latent also takes the same projection's
    latent of the previous block (none in the first); returns (y, its own latent)."""

    def forward(self, x, h_prev=None):
        h = F.silu(x @ self.A)
        return (h if h_prev is None else h + h_prev) @ self.B, h


class LaxAttention(ColaAttention):
    def __init__(self, config: ColaConfig):
        super().__init__(config)
        r = config.attn_rank
        self.q_proj = LaxLayer(self.hidden_size, self.num_heads * self.head_dim, r)
        self.k_proj = LaxLayer(self.hidden_size, self.num_key_value_heads * self.head_dim, r)
        self.v_proj = LaxLayer(self.hidden_size, self.num_key_value_heads * self.head_dim, r)
        self.o_proj = LaxLayer(self.num_heads * self.head_dim, self.hidden_size, r)

    def forward(self, hidden_states, latents):
        bsz, q_len, _ = hidden_states.size()
        q, latents["q"] = self.q_proj(hidden_states, latents.get("q"))
        k, latents["k"] = self.k_proj(hidden_states, latents.get("k"))
        v, latents["v"] = self.v_proj(hidden_states, latents.get("v"))
        query_states = q.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = k.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = v.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(value_states, seq_len=q_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)
        attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=True)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        out, latents["o"] = self.o_proj(attn_output, latents.get("o"))
        return out


class LaxMLP(nn.Module):
    def __init__(self, config: ColaConfig):
        super().__init__()
        r = config.mlp_rank
        self.gate_proj = LaxLayer(config.hidden_size, config.intermediate_size, r)
        self.up_proj = LaxLayer(config.hidden_size, config.intermediate_size, r)
        self.down_proj = LaxLayer(config.intermediate_size, config.hidden_size, r)

    def forward(self, x, latents):
        gate, latents["gate"] = self.gate_proj(x, latents.get("gate"))
        up, latents["up"] = self.up_proj(x, latents.get("up"))
        out, latents["down"] = self.down_proj(F.silu(gate) * up, latents.get("down"))
        return out


class LaxDecoderLayer(ColaDecoderLayer):
    def __init__(self, config: ColaConfig):
        super().__init__(config)
        self.self_attn = LaxAttention(config)
        self.mlp = LaxMLP(config)

    def forward(self, hidden_states, latents):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), latents)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states), latents)


class LaxForCausalLM(ColaForCausalLM):
    """The latents travel from block to block in a dict keyed by projection."""

    def __init__(self, config: ColaConfig):
        super().__init__(config)
        self.layers = nn.ModuleList([LaxDecoderLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        latents: dict[str, torch.Tensor] = {}
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, latents)
        return self.lm_head(self.norm(hidden_states))


class GatedLaxLayer(LaxLayer):
    """LaX with more work on the latent: a learned gate, and the crossing scaled by 0.5:
    y = (silu(x A) * sigmoid(g) + 0.5 h_prev) B."""

    def __init__(self, in_features, out_features, rank):
        super().__init__(in_features, out_features, rank)
        self.gate = nn.Parameter(torch.randn(rank))

    def forward(self, x, h_prev=None):
        h = F.silu(x @ self.A)
        z = h * torch.sigmoid(self.gate)
        return (z if h_prev is None else z + 0.5 * h_prev) @ self.B, h


def raw_lax(seed: int = 0, gated: bool = False) -> tuple[nn.Module, LossFn]:
    """LaX over raw CoLA factors: every projection's latent crosses into the next block, GQA 4/2;
    ``gated``: :class:`GatedLaxLayer` everywhere."""
    torch.manual_seed(seed)
    model = LaxForCausalLM(ColaConfig())
    if gated:
        for name, layer in list(model.named_modules()):
            if isinstance(layer, LaxLayer):
                owner, _, attr = name.rpartition(".")
                new = GatedLaxLayer(layer.in_features, layer.out_features, layer.rank)
                with torch.no_grad():
                    new.A.copy_(layer.A)
                    new.B.copy_(layer.B)
                setattr(model.get_submodule(owner), attr, new)
    return model, raw_cola_loss


# =============================================================================
# 4. Hugging Face models built from configs (nothing downloaded)
# =============================================================================

HF_ATTN = "sdpa"


def _transformers():
    import pytest

    return pytest.importorskip("transformers")


def hf_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def _hf_common() -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=128,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=2,
        max_position_embeddings=MAX_SEQ * 2,
        attn_implementation=HF_ATTN,
    )


def hf_llama_tied(low_rank: bool = False, seed: int = 0) -> tuple[nn.Module, LossFn]:
    """LlamaForCausalLM with ``tie_word_embeddings=True`` (head = embedding)."""
    transformers = _transformers()
    config = transformers.LlamaConfig(**_hf_common(), tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the head is not tied"
    if low_rank:
        _factorize(model)
        assert model.lm_head.weight is model.model.embed_tokens.weight, "factorize_ untied the head"
    return model, hf_loss


def hf_qwen2(low_rank: bool = False, seed: int = 0) -> tuple[nn.Module, LossFn]:
    """Qwen2ForCausalLM: q/k/v carry biases, o/MLP do not; untied head."""
    transformers = _transformers()
    config = transformers.Qwen2Config(**_hf_common(), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    # HF initialises biases to zero; make them nonzero so their gradients and the
    # factorized up-factor bias are exercised
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.02)
    if low_rank:
        _factorize(model)
    return model, hf_loss


def hf_gemma(low_rank: bool = False, seed: int = 0) -> tuple[nn.Module, LossFn]:
    """GemmaForCausalLM: sqrt(d)-scaled embedding, (1 + w) RMSNorms, tied head, head_dim 16."""
    transformers = _transformers()
    config = transformers.GemmaConfig(**_hf_common(), head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.GemmaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the head is not tied"
    # Gemma's norms start at w = 0 (scale 1 + w = 1); make them nonzero so the
    # (1 + w) form is visible in values and gradients
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    if low_rank:
        _factorize(model)
        assert model.lm_head.weight is model.model.embed_tokens.weight, "factorize_ untied the head"
    return model, hf_loss


def hf_gpt2_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The loss from the logits (GPT-2's own ``labels=`` loss breaks the graph in two)."""
    return next_token_loss(model(input_ids=tokens, use_cache=False).logits, tokens)


def hf_gpt2(seed: int = 0) -> tuple[nn.Module, LossFn]:
    """GPT2LMHeadModel: Conv1D projections (``addmm(b, x, W)``, W as [in, out]), a fused
    ``c_attn`` split into q/k/v, LayerNorm, learned positions, tied head."""
    transformers = _transformers()
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=64, n_layer=BLOCKS, n_head=4, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight, "the head is not tied"
    return model, hf_gpt2_loss


def hf_phi3(low_rank: bool = False, seed: int = 0) -> tuple[nn.Module, LossFn]:
    """Phi3ForCausalLM: one fused ``qkv_proj`` sliced into q, k, v (``qkv[..., :q_pos]``) and one
    fused ``gate_up_proj`` chunked in two; untied head."""
    transformers = _transformers()
    config = transformers.Phi3Config(**_hf_common(), pad_token_id=0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(config)
    if low_rank:
        _factorize(model)
    return model, hf_gpt2_loss


def hf_gpt2_lowrank(seed: int = 0) -> tuple[nn.Module, LossFn]:
    """GPT-2 with its Conv1D projections factorized (``factorize_`` reads Conv1D as the linear it is)."""
    model, loss = hf_gpt2(seed)
    _factorize(model)
    assert model.lm_head.weight is model.transformer.wte.weight, "factorize_ untied the head"
    return model, loss


def hf_opt(low_rank: bool = False, seed: int = 0) -> tuple[nn.Module, LossFn]:
    """OPTForCausalLM: pre-LayerNorm blocks with biases everywhere, ReLU MLP, learned positions
    (offset by 2, read from the attention mask's cumsum), tied head."""
    transformers = _transformers()
    config = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=N_LAYERS, ffn_dim=128, num_attention_heads=N_HEADS,
        max_position_embeddings=MAX_SEQ * 2, word_embed_proj_dim=DIM, do_layer_norm_before=True, dropout=0.0,
        attention_dropout=0.0, layerdrop=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=0, attn_implementation=HF_ATTN,
    )
    torch.manual_seed(seed)
    model = transformers.OPTForCausalLM(config)
    if low_rank:
        _factorize(model)
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight, "the head is not tied"
    return model, hf_gpt2_loss


# =============================================================================
# 7. modded-nanogpt (weightless F.rms_norm everywhere, in its own style)
# =============================================================================


def norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


def nonparametric_layer_norm(x: torch.Tensor) -> torch.Tensor:
    """OLMo's LayerNorm: no weight, no bias."""
    return F.layer_norm(x, (x.size(-1),))


class Rotary(nn.Module):
    def __init__(self, dim: int, max_seq_len: int):
        super().__init__()
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim // 4, dtype=torch.float32)
        angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(dim // 4)])
        t = torch.arange(max_seq_len, dtype=torch.float32)
        theta = torch.einsum("i,j -> ij", t, angular_freq)
        self.cos = nn.Buffer(theta.cos(), persistent=False)
        self.sin = nn.Buffer(theta.sin(), persistent=False)

    def forward(self, x_BTHD: torch.Tensor):
        cos, sin = self.cos[None, :x_BTHD.size(-3), None, :], self.sin[None, :x_BTHD.size(-3), None, :]
        x1, x2 = x_BTHD.to(dtype=torch.float32).chunk(2, dim=-1)
        y1 = x1 * cos + x2 * sin
        y2 = x1 * (-sin) + x2 * cos
        return torch.cat((y1, y2), 3).type_as(x_BTHD)


class ModdedAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, max_seq_len: int, norm=norm):
        super().__init__()
        self.norm = norm
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)
        self.rotary = Rotary(self.head_dim, max_seq_len)

    def forward(self, x: torch.Tensor):
        B, T = x.size(0), x.size(1)
        q = self.q(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k(x).view(B, T, self.num_heads, self.head_dim)
        v = self.v(x).view(B, T, self.num_heads, self.head_dim)
        q, k = self.norm(q), self.norm(k)  # QK norm over the head dim
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, self.num_heads * self.head_dim)
        return self.c_proj(y)


class ModdedMLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim, bias=False)
        self.c_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor):
        x = self.c_fc(x)
        x = F.relu(x).square()  # https://arxiv.org/abs/2109.08668v2
        return self.c_proj(x)


class ModdedBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, max_seq_len: int, norm=norm):
        super().__init__()
        self.norm = norm
        self.attn = ModdedAttention(dim, num_heads, max_seq_len, norm)
        self.mlp = ModdedMLP(dim)

    def forward(self, x: torch.Tensor):
        x = x + self.attn(self.norm(x))
        x = x + self.mlp(self.norm(x))
        return x


class ModdedGPT(nn.Module):
    def __init__(self, vocab_size: int, num_layers: int, num_heads: int, model_dim: int, max_seq_len: int, norm=norm):
        super().__init__()
        self.norm = norm
        self.embed = nn.Embedding(vocab_size, model_dim)
        self.blocks = nn.ModuleList([ModdedBlock(model_dim, num_heads, max_seq_len, norm) for _ in range(num_layers)])
        self.lm_head = nn.Linear(model_dim, vocab_size, bias=False)

    def forward(self, input_seq: torch.Tensor, target_seq: torch.Tensor | None = None):
        x = self.norm(self.embed(input_seq))
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        logits = self.lm_head(x).float()
        logits = 30 * torch.sigmoid(logits / (7.5 * x.size(-1) ** 0.5))
        if target_seq is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), target_seq.reshape(-1))


def modded_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token targets of the same length as the input (the last wraps around), as
    modded-nanogpt's loader gives (input_seq, target_seq) pairs of one length."""
    return model(tokens, torch.roll(tokens, -1, dims=1))


def modded_nanogpt(low_rank: bool = False, seed: int = 0, layer_norm: bool = False) -> tuple[nn.Module, LossFn]:
    """modded-nanogpt's shape: weightless ``F.rms_norm`` on the embedding, before each branch,
    on q and k (over the head dim) and before the head; ReLU^2 MLP; untied head; sigmoid-capped logits.
    ``layer_norm``: every norm is OLMo's non-parametric LayerNorm instead."""
    torch.manual_seed(seed)
    model = ModdedGPT(VOCAB, N_LAYERS, N_HEADS, DIM, MAX_SEQ, nonparametric_layer_norm if layer_norm else norm)
    if low_rank:
        _factorize(model)
    return model, modded_loss


# =============================================================================
# the registry
# =============================================================================

class Built:
    """A builder whose first call's model is kept: every call returns a deep copy of it.

    A low-rank build factorizes, and factorize_ captures the model with Dynamo (a trace
    each); tests build the same style several times (the reference and its twin, scenario
    after scenario). A copy holds the same parameters a new build would (each builder seeds
    itself; ``test_builders_are_deterministic`` checks it), and the global random state is left
    as the build left it. ``fresh()`` builds anew.
    """

    def __init__(self, builder: Builder) -> None:
        self.fresh = builder
        self._kept: tuple[nn.Module, LossFn, torch.Tensor] | None = None

    def __call__(self) -> tuple[nn.Module, LossFn]:
        if self._kept is None:
            model, loss_fn = self.fresh()
            self._kept = (model, loss_fn, torch.get_rng_state())
        model, loss_fn, rng = self._kept
        torch.set_rng_state(rng)
        return copy.deepcopy(model), loss_fn


_BUILDERS: dict[str, Builder] = {
    "hf-gpt2-dense": hf_gpt2,
    "hf-gpt2-lowrank": hf_gpt2_lowrank,
    "hf-opt-dense": functools.partial(hf_opt, low_rank=False),
    "hf-opt-lowrank": functools.partial(hf_opt, low_rank=True),
    "modded-dense": functools.partial(modded_nanogpt, low_rank=False),
    "modded-lowrank": functools.partial(modded_nanogpt, low_rank=True),
    "modded-layernorm-lowrank": functools.partial(modded_nanogpt, low_rank=True, layer_norm=True),
    "nanogpt-layernorm-dense": functools.partial(nanogpt, fused_qkv=True, low_rank=False, norm="layer"),
    "nanogpt-layernorm-bias-dense": functools.partial(nanogpt, fused_qkv=True, low_rank=False, norm="layer", bias=True),
    "nanogpt-layernorm-mean100-lowrank": functools.partial(nanogpt, fused_qkv=True, low_rank=True, norm="layer",
                                                           bias=True, stream_mean=100.0),
    "hf-phi3-dense": functools.partial(hf_phi3, low_rank=False),
    "hf-phi3-lowrank": functools.partial(hf_phi3, low_rank=True),
    "nanogpt-fused-lowrank": functools.partial(nanogpt, fused_qkv=True, low_rank=True),
    "nanogpt-split-lowrank": functools.partial(nanogpt, fused_qkv=False, low_rank=True),
    "nanogpt-fused-dense": functools.partial(nanogpt, fused_qkv=True, low_rank=False),
    "nanogpt-split-dense": functools.partial(nanogpt, fused_qkv=False, low_rank=False),
    "nanogpt-layernorm-lowrank": functools.partial(nanogpt, fused_qkv=True, low_rank=True, norm="layer"),
    "nanogpt-layernorm-bias-lowrank": functools.partial(nanogpt, fused_qkv=True, low_rank=True, norm="layer", bias=True),
    "meta-llama-dense": functools.partial(meta_llama, low_rank=False),
    "meta-llama-lowrank": functools.partial(meta_llama, low_rank=True),
    "raw-cola": raw_cola,
    "raw-cola-transposed": functools.partial(raw_cola, spelling="transposed"),
    "raw-lax": raw_lax,
    "raw-lax-gated": functools.partial(raw_lax, gated=True),
    "hf-llama-tied-lowrank": functools.partial(hf_llama_tied, low_rank=True),
    "hf-llama-tied-dense": functools.partial(hf_llama_tied, low_rank=False),
    "hf-qwen2-lowrank": functools.partial(hf_qwen2, low_rank=True),
    "hf-qwen2-dense": functools.partial(hf_qwen2, low_rank=False),
    "hf-gemma-lowrank": functools.partial(hf_gemma, low_rank=True),
    "hf-gemma-dense": functools.partial(hf_gemma, low_rank=False),
}
#: name -> builder (each ``Built``: the first build kept, copies returned)
STYLES: dict[str, Built] = {name: Built(builder) for name, builder in _BUILDERS.items()}

#: Bottleneck chains per decoder block that ``capture_views`` must find
#: (low-rank entries only): fused nanoGPT c_attn, attn.c_proj, c_fc, mlp.c_proj = 4;
#: split nanoGPT q/k/v_attn, attn.c_proj, c_fc, mlp.c_proj = 6; Llama-style
#: q, k, v, o, gate, up, down = 7.
BOTTLENECKS_PER_BLOCK: dict[str, int] = {
    "nanogpt-fused-lowrank": 4,
    "nanogpt-split-lowrank": 6,
    "nanogpt-layernorm-lowrank": 4,
    "nanogpt-layernorm-bias-lowrank": 4,
    "nanogpt-layernorm-mean100-lowrank": 4,
    # c_attn, attn.c_proj, c_fc, mlp.c_proj
    "hf-gpt2-lowrank": 4,
    # q, k, v, out_proj, fc1, fc2
    "hf-opt-lowrank": 6,
    # q, k, v, c_proj, c_fc, mlp c_proj
    "modded-lowrank": 6,
    "modded-layernorm-lowrank": 6,
    "meta-llama-lowrank": 7,
    "raw-cola": 7,
    "raw-cola-transposed": 7,
    "raw-lax": 7,
    "raw-lax-gated": 7,
    "hf-llama-tied-lowrank": 7,
    "hf-qwen2-lowrank": 7,
    "hf-gemma-lowrank": 7,
    # qkv_proj, o_proj, gate_up_proj, down_proj
    "hf-phi3-lowrank": 4,
}

#: Every model here has this many decoder blocks.
BLOCKS = N_LAYERS

__all__ = [
    "BLOCKS", "BOTTLENECKS_PER_BLOCK", "STYLES", "nanogpt", "meta_llama", "raw_cola", "raw_lax",
    "hf_llama_tied", "hf_qwen2", "hf_gemma",
]
