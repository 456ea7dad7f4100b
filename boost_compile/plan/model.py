"""What the planner knows of a model: its widths, its projections, and where each parameter lives.

:class:`ModelSpec` is built from a preset (``cola-60m``), a boost-train model config,
or a Hugging Face ``config.json``, without building the model. It lists every
parameter tensor with its shape (:meth:`ModelSpec.tensors`), so that the memory
model can shard each one as a plan does (:func:`local_numel`), cut the blocks
into pipeline stages as boost-train does (:func:`stage_blocks`, the same split by
parameter count) and group them into FSDP2's units (:func:`fsdp_units`).

Beside the reference presets, the planner knows BOOST.md's 13B shape
(:data:`SHAPE_PRESETS`: ``cola-13b``, ``llama-13b``, ...), which boost-train runs as the
family's 7b preset with its widths changed (:func:`preset_args`).
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
    #: "col_bias" / "row_bias" (a projection's bias on its output)
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
class ModelSpec:
    """A Llama-shaped model: dense, or low-rank in every block projection (CoLA, plain, LaX)."""

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

    def __post_init__(self) -> None:
        if self.projection != "dense" and (self.rank_attn is None or self.rank_mlp is None):
            raise ValueError(f"{self.name}: a {self.projection} model needs rank_attn and rank_mlp")

    @property
    def dense(self) -> bool:
        return self.projection == "dense"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

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
        return block_projections(self.dim, self.kv_dim, self.ffn_dim, ra, rm)

    def tensors(self) -> tuple[Tensor, ...]:
        """Every parameter, in the reference model's order (a tied head is the embedding: listed once)."""
        return self._tensors

    @functools.cached_property
    def _tensors(self) -> tuple[Tensor, ...]:  # the search prices hundreds of layouts of one spec
        d, out = self.dim, [Tensor("embed", (self.vocab_size, self.dim), "embed")]
        norm = [("weight", (d,))] + ([("bias", (d,))] if self.norm == "layernorm" else [])
        for i in range(self.n_layers):
            for which in ("attention_norm", "ffn_norm"):
                out += [Tensor(f"layers.{i}.{which}.{w}", s, "norm", i) for w, s in norm]
            for name, (d_in, d_out, rank) in self.projections().items():
                rowwise = name in ("o_proj", "down_proj")  # Megatron's row-parallel pair
                if rank is None:
                    out.append(Tensor(f"layers.{i}.{name}.weight", (d_out, d_in), "row" if rowwise else "col", i))
                else:
                    out.append(Tensor(f"layers.{i}.{name}.A", (rank, d_in), "down", i))
                    out.append(Tensor(f"layers.{i}.{name}.B", (d_out, rank), "up", i))
                if self.bias:
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
    """From a :class:`boost_compile.models.LlamaConfig`."""
    return ModelSpec(name, config.dim, config.n_layers, config.n_heads, config.n_kv_heads, config.ffn_dim,
                     config.vocab_size, config.projection, config.rank_attn, config.rank_mlp, config.norm,
                     config.bias, config.tie_embeddings)


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


def from_hf_config(config: dict[str, Any] | str | Path, name: str | None = None) -> ModelSpec:
    """From a Hugging Face ``config.json`` (a path, its folder, or the dict): a dense Llama-like model.

    boost-train factorizes such a model (``factorize=``) before sharding it; the
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
    if model_type not in HF_LLAMA_LIKE:
        raise ValueError(
            f"the planner models Llama-like blocks (RMSNorm, gated MLP: {', '.join(HF_LLAMA_LIKE)}); "
            f"this config's model_type is {model_type!r}"
        )
    missing = [k for k in HF_KEYS if k not in config]
    if missing:
        raise ValueError(f"the Hugging Face config lacks {', '.join(missing)}")
    fields = {f: int(config[k]) for k, f in HF_KEYS.items()}
    fields["n_kv_heads"] = int(config.get("num_key_value_heads") or fields["n_heads"])
    return ModelSpec(name or model_type, **fields, projection="dense", bias=bool(config.get("attention_bias", False)),
                     tie_embeddings=bool(config.get("tie_word_embeddings", False)))


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
    """``spec`` with every block projection factorized at ``rank`` (boost-train's ``factorize=``)."""
    return replace(spec, projection=projection, rank_attn=rank, rank_mlp=rank)


# ----------------------------------------------------------------------------- sharding


def local_numel(t: Tensor, plan: str, tp: int, *, vocab_parallel: bool = True) -> int:
    """Elements of ``t`` one tensor-parallel rank holds under ``plan`` (btp, megatron, vanilla).

    btp shards the stream: every factor and gain on d (or on the local heads / d_ff
    slice), the embedding's columns; megatron splits each dense pair (column, then
    row) and keeps norms whole; vanilla splits every factor pair on r and keeps
    norms whole. The head (and, for megatron and vanilla, the embedding) is
    vocabulary-parallel unless ``vocab_parallel`` is false. Uneven splits count
    the largest slice.
    """
    if tp == 1:
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
