"""What the planner knows of a model: its widths, its projections, and where each parameter lives.

:class:`ModelSpec` is built from a preset (``cola-60m``), a boost-train model config,
or a Hugging Face ``config.json``, without building the model. It lists every
parameter tensor with its shape (:meth:`ModelSpec.tensors`), so that the memory
model can shard each one as a plan does (:func:`local_numel`), cut the blocks
into pipeline stages as boost-train does (:func:`stage_blocks`, the same split by
parameter count) and group them into FSDP2's units (:func:`fsdp_units`).

Beside the reference presets, the planner knows BOOST.md's 13B shape
(:data:`SHAPE_PRESETS`: ``cola-13b``, ``llama-13b``, ...), which boost-train runs as the
family's 7b preset with its widths changed (:func:`preset_args`), and two DeepSeek-V3-shaped
mixtures of experts (:data:`HF_SHAPES`: ``deepseek-v3``, ``deepseek-v3-lite``), Hugging Face
configs boost-train builds inline (:func:`hf_shape_args`).

Mixtures of experts (``n_experts > 0``): each MoE block's MLP is a router ``[n_experts, d]``,
``n_experts`` SwiGLU experts of width ``expert_ffn_dim`` stacked ``[n_experts, ...]`` (role
``"expert"``: split by expert parallelism over dim 0, never by TP: under boost-train's EP x TP every
TP rank holds its EP shard of the experts whole) and, where the model has them, shared experts as
one gated MLP of width ``shared_ffn_dim`` (split by TP like a dense MLP). ``dense_layers`` keep a
dense MLP of ``ffn_dim`` (DeepSeek's ``first_k_dense_replace``, Qwen's ``mlp_only_layers`` and
``decoder_sparse_step``). DeepSeek's multi-head latent attention (:class:`Mla`) is listed tensor by
tensor; its time is priced from its parameter count and attention widths (``plan/timing.py``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from boost_compile.costmodel import scale_model
from boost_compile.costmodel.formulas import PAPER_SHAPES
from boost_compile.export_folder import export_info

#: the busiest expert-parallel rank's routed rows over the mean, by default (a Job's ``moe_imbalance``,
#: boost-plan's ``--moe-imbalance``): what the time and memory models charge the busiest rank
MOE_IMBALANCE = 1.1
#: projection kinds of the reference model (``LlamaConfig.projection``)
LOW_RANK = ("cola", "lowrank", "lax")
#: the TP plan each kind of model is planned with, and vanilla (the baseline) for the low-rank ones
PLANS = {"dense": ("megatron",), "lowrank": ("btp", "vanilla")}


@dataclass(frozen=True)
class Tensor:
    """One parameter: its name, shape and how the plans split it (``role``)."""

    name: str
    shape: tuple[int, ...]
    #: "embed", "head", "norm" (a gain or bias of width d), "down" ([r, d_in] factor),
    #: "up" ([d_out, r] factor), "col" (dense [d_out, d_in], output sharded), "row" (input sharded),
    #: "col_bias" / "row_bias" (a projection's bias on its output), "whole" (never split by TP: a
    #: router, a latent projection and its norm), "expert" (stacked [n_experts, ...]: split by EP
    #: over dim 0, never by TP)
    role: str
    #: the block it belongs to (-1: outside the blocks)
    block: int = -1

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Mla:
    """DeepSeek's multi-head latent attention: q through a latent of ``q_lora_rank`` (None: one
    projection), k and v from a shared latent of ``kv_lora_rank`` plus a rope key of ``qk_rope_head_dim``."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-shaped model: dense, or low-rank in every block projection (CoLA, plain, LaX), its
    MLPs dense or mixtures of experts (see the module's docstring)."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    projection: str = "cola"  # dense, cola, lowrank, lax
    rank_attn: int | None = None
    rank_mlp: int | None = None
    norm: str = "rmsnorm"
    bias: bool = False
    tie_embeddings: bool = False
    #: boost-train can cut it into pipeline stages: a preset, or a Hugging Face model type its
    #: pipeline split knows (``distributed/pipeline.py``'s ``HF_MODEL_TYPES``); else no pp > 1 layout
    pipeline: bool = True
    #: routed experts per MoE block (0: a dense model), and the experts each token goes to
    n_experts: int = 0
    top_k: int = 0
    #: each routed expert's SwiGLU width (0: ffn_dim)
    expert_ffn_dim: int = 0
    #: the shared experts as one gated MLP of this width (DeepSeek: n_shared_experts x
    #: moe_intermediate_size; Qwen2-MoE: shared_expert_intermediate_size); 0: none
    shared_ffn_dim: int = 0
    #: Qwen2-MoE's sigmoid gate [1, d] on the shared expert's output
    shared_gate: bool = False
    #: blocks whose MLP stays dense (ffn_dim) in an MoE model
    dense_layers: tuple[int, ...] = ()
    #: per-head width when it is not dim / n_heads (Qwen3), q/k RMSNorms over it (Qwen3)
    attn_head_dim: int | None = None
    qk_norm: bool = False
    #: biases on q, k and v only (Qwen2's qkv_bias)
    qkv_bias: bool = False
    #: DeepSeek's multi-head latent attention in place of q/k/v/o
    mla: Mla | None = None

    def __post_init__(self) -> None:
        if self.projection != "dense" and (self.rank_attn is None or self.rank_mlp is None):
            raise ValueError(f"{self.name}: a {self.projection} model needs rank_attn and rank_mlp")
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"{self.name}: top_k {self.top_k} must be in 1..n_experts ({self.n_experts})")

    @property
    def moe(self) -> bool:
        """Whether the model has mixture-of-experts blocks."""
        return self.n_experts > 0

    @property
    def expert_width(self) -> int:
        return self.expert_ffn_dim or self.ffn_dim

    def moe_block(self, block: int) -> bool:
        """Whether block ``block``'s MLP is a mixture of experts."""
        return self.moe and block not in self.dense_layers

    @property
    def moe_layers(self) -> int:
        return sum(self.moe_block(i) for i in range(self.n_layers))

    @property
    def expert_rank(self) -> int | None:
        """The experts' bottleneck rank (the MLP's, rank_mlp) when the model is low-rank, else None."""
        return None if self.dense else self.rank_mlp

    def expert_params(self) -> int:
        """Parameters of one routed expert (its gate, up and down)."""
        d, f, r = self.dim, self.expert_width, self.expert_rank
        return 3 * d * f if r is None else 3 * r * (d + f)

    @property
    def dense(self) -> bool:
        return self.projection == "dense"

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def kind(self) -> str:
        """``dense`` or ``lowrank`` (the keys of :data:`PLANS`)."""
        return "dense" if self.dense else "lowrank"

    def projections(self) -> dict[str, tuple[int, int, int | None]]:
        """Block projection name -> (d_in, d_out, rank or None)."""
        from boost_compile.models.llama import block_projections

        ra, rm = (None, None) if self.dense else (self.rank_attn, self.rank_mlp)
        out = block_projections(self.dim, self.kv_dim, self.ffn_dim, ra, rm)
        q = self.n_heads * self.head_dim
        if q != self.dim:  # Qwen3's head_dim: q and o are [n_heads x head_dim, d]
            out["q_proj"], out["o_proj"] = (self.dim, q, ra), (q, self.dim, ra)
        return out

    def attention_tensors(self, i: int) -> list[Tensor]:
        """Block ``i``'s multi-head latent attention (megatron: the latent projections and their norms
        whole, the up projections column-parallel by heads, o row-parallel)."""
        mla, d, h = self.mla, self.dim, self.n_heads
        assert mla is not None
        pre = f"layers.{i}.self_attn"
        if mla.q_lora_rank is None:
            out = [Tensor(f"{pre}.q_proj.weight", (h * mla.qk_head_dim, d), "col", i)]
        else:
            out = [Tensor(f"{pre}.q_a_proj.weight", (mla.q_lora_rank, d), "whole", i),
                   Tensor(f"{pre}.q_a_layernorm.weight", (mla.q_lora_rank,), "whole", i),
                   Tensor(f"{pre}.q_b_proj.weight", (h * mla.qk_head_dim, mla.q_lora_rank), "col", i)]
        return out + [
            Tensor(f"{pre}.kv_a_proj_with_mqa.weight", (mla.kv_lora_rank + mla.qk_rope_head_dim, d), "whole", i),
            Tensor(f"{pre}.kv_a_layernorm.weight", (mla.kv_lora_rank,), "whole", i),
            Tensor(f"{pre}.kv_b_proj.weight", (h * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank), "col", i),
            Tensor(f"{pre}.o_proj.weight", (d, h * mla.v_head_dim), "row", i),
        ]

    def moe_tensors(self, i: int) -> list[Tensor]:
        """Block ``i``'s mixture of experts: the router, the routed experts stacked per expert (each
        SwiGLU matrix one [E, d_in, d_out] tensor, or two factors of rank rank_mlp when low-rank) and
        the shared experts (one gated MLP, column / row-parallel as a dense one)."""
        d, f, r, e = self.dim, self.expert_width, self.expert_rank, self.n_experts
        pre = f"layers.{i}.mlp"
        out = [Tensor(f"{pre}.router.weight", (e, d), "whole", i)]
        for name, (d_in, d_out) in {"gate": (d, f), "up": (d, f), "down": (f, d)}.items():
            if r is None:
                out.append(Tensor(f"{pre}.experts.{name}", (e, d_in, d_out), "expert", i))
            else:
                out += [Tensor(f"{pre}.experts.{name}_down", (e, d_in, r), "expert", i),
                        Tensor(f"{pre}.experts.{name}_up", (e, r, d_out), "expert", i)]
        if self.shared_ffn_dim:
            s = self.shared_ffn_dim
            out += [Tensor(f"{pre}.shared.gate_proj.weight", (s, d), "col", i),
                    Tensor(f"{pre}.shared.up_proj.weight", (s, d), "col", i),
                    Tensor(f"{pre}.shared.down_proj.weight", (d, s), "row", i)]
        if self.shared_gate:
            out.append(Tensor(f"{pre}.shared_gate.weight", (1, d), "whole", i))
        return out

    def tensors(self) -> tuple[Tensor, ...]:
        """Every parameter, in the reference model's order (a tied head is the embedding: listed once)."""
        return self._tensors

    @functools.cached_property
    def _tensors(self) -> tuple[Tensor, ...]:  # the search prices hundreds of layouts of one spec
        d, out = self.dim, [Tensor("embed", (self.vocab_size, self.dim), "embed")]
        norm = [("weight", (d,))] + ([("bias", (d,))] if self.norm == "layernorm" else [])
        attention = ("q_proj", "k_proj", "v_proj", "o_proj")
        for i in range(self.n_layers):
            for which in ("attention_norm", "ffn_norm"):
                out += [Tensor(f"layers.{i}.{which}.{w}", s, "norm", i) for w, s in norm]
            if self.mla is not None:
                out += self.attention_tensors(i)
            if self.qk_norm:
                out += [Tensor(f"layers.{i}.self_attn.{w}.weight", (self.head_dim,), "whole", i) for w in ("q_norm", "k_norm")]
            if self.moe_block(i):
                out += self.moe_tensors(i)
            for name, (d_in, d_out, rank) in self.projections().items():
                if (name in attention and self.mla is not None) or (name not in attention and self.moe_block(i)):
                    continue
                rowwise = name in ("o_proj", "down_proj")  # Megatron's row-parallel pair
                if rank is None:
                    out.append(Tensor(f"layers.{i}.{name}.weight", (d_out, d_in), "row" if rowwise else "col", i))
                else:
                    out.append(Tensor(f"layers.{i}.{name}.A", (rank, d_in), "down", i))
                    out.append(Tensor(f"layers.{i}.{name}.B", (d_out, rank), "up", i))
                if self.bias or (self.qkv_bias and name in ("q_proj", "k_proj", "v_proj")):
                    out.append(Tensor(f"layers.{i}.{name}.bias", (d_out,), "row_bias" if rowwise else "col_bias", i))
        out += [Tensor(f"norm.{w}", s, "norm") for w, s in norm]
        if not self.tie_embeddings:
            out.append(Tensor("head", (self.vocab_size, self.dim), "head"))
        return tuple(out)

    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors())

    def scale_shape(self) -> scale_model.Shape:
        """The scale model's shape (its time model assumes r = d / 4 and as many kv-heads as heads)."""
        arch = "cola" if self.dense else self.projection
        return scale_model.Shape(self.name, self.dim, self.ffn_dim, self.n_layers, self.n_heads, self.vocab_size,
                                 norm=self.norm, arch=arch)

    def with_vocab(self, vocab_size: int) -> ModelSpec:
        return replace(self, vocab_size=vocab_size)


def from_llama_config(name: str, config: Any) -> ModelSpec:
    """From a :class:`boost_compile.models.LlamaConfig`; with ``n_experts > 0`` every block's MLP is a
    mixture of ``n_experts`` SwiGLU experts of ``expert_ffn_dim`` (None: ffn_dim), ``experts_top_k``
    per token, of the config's projection kind, and no shared expert."""
    n_experts = int(getattr(config, "n_experts", 0) or 0)
    moe: dict[str, Any] = {}
    if n_experts:
        moe = {"n_experts": n_experts, "top_k": int(getattr(config, "experts_top_k", 2)),
               "expert_ffn_dim": int(getattr(config, "expert_ffn_dim", None) or config.ffn_dim)}
    # boost-train refuses pipeline stages with the routers' balance loss (only the last stage computes the loss)
    pipeline = not getattr(config, "router_aux_loss_coef", 0)
    return ModelSpec(name, config.dim, config.n_layers, config.n_heads, config.n_kv_heads, config.ffn_dim,
                     config.vocab_size, config.projection, config.rank_attn, config.rank_mlp, config.norm,
                     config.bias, config.tie_embeddings, pipeline=pipeline, **moe)


def _shape_presets() -> dict[str, tuple[str, dict[str, int]]]:
    """BOOST.md's shapes past the reference presets' 7b, per family: name -> (7b preset, its widths changed).

    The low-rank families take BOOST's CoLA rank d / 4 in every projection."""
    out = {}
    for size, d, d_ff, layers, heads in PAPER_SHAPES:
        if size != "13B":
            continue
        widths = {"dim": d, "n_layers": layers, "n_heads": heads, "n_kv_heads": heads, "ffn_dim": d_ff}
        for family in ("cola", "lowrank", "lax", "llama"):
            ranks = {} if family == "llama" else {"rank_attn": d // 4, "rank_mlp": d // 4}
            out[f"{family}-{size.lower()}"] = (f"{family}-7b", {**widths, **ranks})
    return out


#: presets the planner knows beyond boost_compile.models' table (``cola-13b``, ...)
SHAPE_PRESETS = _shape_presets()


def preset_args(name: str) -> tuple[str, ...]:
    """boost-train's model overrides for a preset of :data:`SHAPE_PRESETS` (or a reference one)."""
    if name not in SHAPE_PRESETS:
        return (f"model.preset={name}",)
    base, widths = SHAPE_PRESETS[name]
    return (f"model.preset={base}", *(f"+model.overrides.{k}={v}" for k, v in widths.items()))


def from_preset(name: str, **overrides: Any) -> ModelSpec:
    """A reference preset (``cola-60m``, ``llama-1b``, ...) or one of :data:`SHAPE_PRESETS`, with LlamaConfig overrides."""
    from boost_compile.models import LlamaConfig

    if name in SHAPE_PRESETS:
        base, widths = SHAPE_PRESETS[name]
        return from_llama_config(name, LlamaConfig.preset(base, **{**widths, **overrides}))
    return from_llama_config(name, LlamaConfig.preset(name, **overrides))


#: Hugging Face config keys -> ModelSpec fields (Llama, Qwen2, Mistral and their kin)
HF_KEYS = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
           "intermediate_size": "ffn_dim", "vocab_size": "vocab_size"}
#: model types whose blocks are a Llama block (RMSNorm, gated MLP): the planner's time and memory model
HF_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2", "granite")
#: mixture-of-experts model types the planner models (:func:`from_hf_config`)
HF_MOE = ("deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral")
#: config keys that make a model a mixture of experts: a config of another type with one of them is
#: refused, never priced as dense
MOE_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_intermediate_size", "num_experts_per_tok")


def from_hf_config(config: dict[str, Any] | str | Path, name: str | None = None) -> ModelSpec:
    """From a Hugging Face ``config.json`` (a path, its folder, or the dict): a dense Llama-like model,
    or one of the mixtures of experts of :data:`HF_MOE` (:func:`moe_from_hf`).

    boost-train factorizes a dense model (``factorize=``) before sharding it; the
    planner plans it as it comes (dense, megatron) unless ``rank`` is given to
    :func:`factorized`.
    """
    if not isinstance(config, dict):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if export_info(path) is not None:
            return from_export(path.parent, name)
        config = json.loads(path.read_text())
        name = name or path.parent.name
    model_type = str(config.get("model_type", ""))
    if model_type in HF_MOE:
        return moe_from_hf(config, name)
    moe_keys = [k for k in MOE_KEYS if config.get(k)]
    if moe_keys:
        raise ValueError(
            f"the planner models the mixtures of experts {', '.join(HF_MOE)}; this config's model_type is "
            f"{model_type!r} and it has {', '.join(moe_keys)}: it is not priced as a dense model"
        )
    if model_type not in HF_LLAMA_LIKE:
        raise ValueError(
            f"the planner models Llama-like blocks (RMSNorm, gated MLP: {', '.join(HF_LLAMA_LIKE)}) and the "
            f"mixtures of experts {', '.join(HF_MOE)}; this config's model_type is {model_type!r}"
        )
    missing = [k for k in HF_KEYS if k not in config]
    if missing:
        raise ValueError(f"the Hugging Face config lacks {', '.join(missing)}")
    fields = {f: int(config[k]) for k, f in HF_KEYS.items()}
    fields["n_kv_heads"] = int(config.get("num_key_value_heads") or fields["n_heads"])
    return ModelSpec(name or model_type, **fields, projection="dense", bias=bool(config.get("attention_bias", False)),
                     tie_embeddings=bool(config.get("tie_word_embeddings", False)), pipeline=_pipelined(model_type))


def moe_from_hf(config: dict[str, Any], name: str | None = None) -> ModelSpec:
    """A ``deepseek_v3``, ``qwen3_moe``, ``qwen2_moe`` or ``mixtral`` config, read through transformers'
    config class (its defaults for the keys the file leaves out); what the planner does not model
    (attention or MLP biases beyond Qwen2's q/k/v ones, DeepSeek's ungated experts...) is refused by key."""
    from transformers import AutoConfig

    model_type = str(config["model_type"])
    given = {k: v for k, v in config.items() if k != "model_type"}
    try:
        c = AutoConfig.for_model(model_type, **given)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"transformers cannot read this {model_type} config: {exc}") from exc

    def refuse(key: str, why: str) -> ValueError:
        return ValueError(f"the planner does not model {model_type}'s {key}={getattr(c, key, None)!r} ({why})")

    if getattr(c, "hidden_act", "silu") not in ("silu", "swish"):
        raise refuse("hidden_act", "the experts are priced as SwiGLU MLPs")
    if getattr(c, "attention_bias", False):
        raise refuse("attention_bias", "biases on the attention projections")
    dim, layers, heads = int(c.hidden_size), int(c.num_hidden_layers), int(c.num_attention_heads)
    fields: dict[str, Any] = {"dim": dim, "n_layers": layers, "n_heads": heads, "vocab_size": int(c.vocab_size),
                              "n_kv_heads": int(getattr(c, "num_key_value_heads", None) or heads),
                              "ffn_dim": int(c.intermediate_size), "projection": "dense",
                              "tie_embeddings": bool(getattr(c, "tie_word_embeddings", False))}
    head_dim = getattr(c, "head_dim", None)
    if head_dim and int(head_dim) != dim // heads:
        fields["attn_head_dim"] = int(head_dim)
    if model_type == "deepseek_v3":
        fields.update(n_experts=int(c.n_routed_experts), top_k=int(c.num_experts_per_tok),
                      expert_ffn_dim=int(c.moe_intermediate_size),
                      shared_ffn_dim=int(c.n_shared_experts or 0) * int(c.moe_intermediate_size),
                      dense_layers=tuple(range(min(layers, int(c.first_k_dense_replace or 0)))),
                      n_kv_heads=heads, attn_head_dim=None,
                      mla=Mla(int(c.q_lora_rank) if c.q_lora_rank else None, int(c.kv_lora_rank),
                              int(c.qk_rope_head_dim), int(c.qk_nope_head_dim), int(c.v_head_dim)))
    elif model_type in ("qwen3_moe", "qwen2_moe"):
        step, only = int(c.decoder_sparse_step or 1), set(c.mlp_only_layers or ())
        experts = int(c.num_experts)
        dense = tuple(i for i in range(layers) if i in only or not (experts > 0 and (i + 1) % step == 0))
        fields.update(n_experts=experts, top_k=int(c.num_experts_per_tok), expert_ffn_dim=int(c.moe_intermediate_size),
                      dense_layers=dense)
        if model_type == "qwen3_moe":
            fields["qk_norm"] = True
        else:
            fields.update(shared_ffn_dim=int(c.shared_expert_intermediate_size), shared_gate=True,
                          qkv_bias=bool(getattr(c, "qkv_bias", True)))
    else:  # mixtral: every block's MLP is num_local_experts experts of intermediate_size
        fields.update(n_experts=int(c.num_local_experts), top_k=int(c.num_experts_per_tok),
                      expert_ffn_dim=int(c.intermediate_size))
    if not fields["n_experts"]:
        raise refuse("num_experts" if model_type != "deepseek_v3" else "n_routed_experts", "no experts")
    return ModelSpec(name or model_type, **fields, pipeline=_pipelined(model_type))


def _pipelined(model_type: str) -> bool:
    """Whether boost-train cuts a Hugging Face model of this type into pipeline stages."""
    from boost_compile.distributed.pipeline import HF_MODEL_TYPES

    return model_type in HF_MODEL_TYPES


#: DeepSeek-V3-shaped models boost-plan knows by name (Hugging Face configs, nothing downloaded):
#: DeepSeek-V3's own (671B) and one with DeepSeek-V2-Lite's widths (15.7B: d 2048, 27 layers, 64
#: routed experts top-6 with 2 shared of 1408, the first block dense, attention with a kv latent of
#: 512 and no q latent) in V3's model type
HF_SHAPES: dict[str, dict[str, Any]] = {
    "deepseek-v3": {
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "n_group": 8, "topk_group": 4, "tie_word_embeddings": False,
    },
    "deepseek-v3-lite": {
        "model_type": "deepseek_v3", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "n_group": 1, "topk_group": 1, "tie_word_embeddings": False,
    },
}


def hf_shape_args(name: str) -> tuple[str, ...]:
    """boost-train's model overrides for a shape of :data:`HF_SHAPES`: hf-tiny's inline config, its keys replaced."""
    def value(v: Any) -> str:
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return ("model=hf-tiny", *(f"++model.hf_config.{k}={value(v)}" for k, v in HF_SHAPES[name].items()))


def from_export(folder: str | Path, name: str | None = None) -> ModelSpec:
    """From a ``boost-export`` folder: its model, a factorized one priced at the largest rank of its
    attention bottlenecks and of its MLP bottlenecks."""
    from boost_compile.export_folder import BOOST_LLAMA, llama_fields, lowrank_layers

    folder = Path(folder)
    if (export_info(folder) or {}).get("format") == BOOST_LLAMA:
        from boost_compile.models import LlamaConfig

        spec = from_llama_config(name or folder.name, LlamaConfig(**llama_fields(folder)[0]))
    else:
        spec = from_hf_config(json.loads((folder / "config.json").read_text()), name or folder.name)
    layers = lowrank_layers(folder)
    if not layers:
        return spec
    attn = [v["rank"] for k, v in layers.items() if "attn" in k or "attention" in k]
    mlp = [v["rank"] for k, v in layers.items() if not ("attn" in k or "attention" in k)]
    return replace(spec, projection="lowrank", rank_attn=max(attn or mlp), rank_mlp=max(mlp or attn))


def largest_block_tensor(spec: ModelSpec) -> int:
    """Elements of the largest tensor inside the blocks (a dense projection, before ``factorized``)."""
    return max(t.numel for t in spec.tensors() if t.block >= 0)


def factorized(spec: ModelSpec, rank: int, projection: str = "lowrank") -> ModelSpec:
    """``spec`` with every block projection factorized at ``rank`` (boost-train's ``factorize=``); a
    mixture of experts or latent attention is refused (the planner does not model their factorization)."""
    if spec.moe or spec.mla is not None:
        raise ValueError(f"{spec.name}: the planner does not price a factorized mixture of experts or latent attention")
    return replace(spec, projection=projection, rank_attn=rank, rank_mlp=rank)


# ----------------------------------------------------------------------------- sharding


def local_numel(t: Tensor, plan: str, tp: int, *, vocab_parallel: bool = True) -> int:
    """Elements of ``t`` one tensor-parallel rank holds under ``plan`` (btp, megatron, vanilla).

    btp shards the stream: every factor and gain on d (or on the local heads / d_ff
    slice), the embedding's columns; megatron splits each dense pair (column, then
    row) and keeps norms whole; vanilla splits every factor pair on r and keeps
    norms whole. The head (and, for megatron and vanilla, the embedding) is
    vocabulary-parallel unless ``vocab_parallel`` is false. Uneven splits count
    the largest slice. A router, a latent projection and its norm (``whole``) and the experts
    (``expert``, split by EP only: :func:`expert_share`) stay whole.
    """
    if tp == 1 or t.role in ("whole", "expert"):  # experts: every TP rank holds its EP shard whole
        return t.numel

    def split(n: int) -> int:
        return -(-n // tp)

    rows, cols = (t.shape + (1,))[:2] if len(t.shape) == 1 else t.shape
    if t.role == "embed":
        if plan == "btp":
            return rows * split(cols)
        return split(rows) * cols if vocab_parallel else t.numel
    if t.role == "head":
        return split(rows) * cols if vocab_parallel else t.numel
    if t.role == "norm":
        return split(t.numel) if plan == "btp" and t.block >= 0 else t.numel
    if t.role in ("down", "up", "col", "row"):
        return t.numel // tp if t.numel % tp == 0 else (split(rows) * cols if t.role in ("up", "col") else rows * split(cols))
    if t.role == "col_bias":
        return split(t.numel)
    return split(t.numel) if plan == "btp" else t.numel  # row_bias: on the stream under btp, whole otherwise


def expert_share(numel: int, ep: int) -> int:
    """Elements of a stacked expert tensor one EP rank holds: its ``n_experts / ep`` experts."""
    return numel // ep


def stage_blocks(spec: ModelSpec, stages: int) -> list[range]:
    """The blocks of each pipeline stage, cut as boost-train cuts them (by parameter count)."""
    from boost_compile.distributed.pipeline import stage_layers

    per_block = [0] * spec.n_layers
    embed = head = 0
    for t in spec.tensors():
        if t.block >= 0:
            per_block[t.block] += t.numel
        elif t.role == "embed":
            embed += t.numel
        else:
            head += t.numel
    mean = sum(per_block) / len(per_block)
    costs = [embed / mean, *(b / mean for b in per_block), head / mean]
    return stage_layers(spec.n_layers, stages, costs=costs)


@dataclass(frozen=True)
class FsdpUnit:
    """One FSDP2 unit of boost-train (``train/fsdp.py``): what ``fully_shard`` gathers and reduces at once."""

    #: "embed", "block", "head" (the final norm with the head) or "root" (what no unit takes)
    kind: str
    tensors: tuple[Tensor, ...]


def fsdp_units(spec: ModelSpec) -> list[FsdpUnit]:
    """boost-train's FSDP2 units in forward order: the embedding, each block, the final norm with the
    head, then the root (empty unless the head is tied: a tied embedding and the final norm stay there)."""
    outside = [t for t in spec.tensors() if t.block < 0]
    units = []
    if not spec.tie_embeddings:
        units.append(FsdpUnit("embed", tuple(t for t in outside if t.role == "embed")))
    blocks: dict[int, list[Tensor]] = {}
    for t in spec.tensors():
        if t.block >= 0:
            blocks.setdefault(t.block, []).append(t)
    units += [FsdpUnit("block", tuple(blocks[b])) for b in sorted(blocks)]
    if not spec.tie_embeddings:
        units.append(FsdpUnit("head", tuple(t for t in outside if t.role != "embed")))
    root = tuple(t for t in outside if spec.tie_embeddings)
    return units + ([FsdpUnit("root", root)] if root else [])
