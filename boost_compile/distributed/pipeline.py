"""Pipeline parallelism on PyTorch's own engine, ``torch.distributed.pipelining``.

A decoder is cut into contiguous stages of blocks; each rank of the pipeline
group holds one stage (or several "virtual" stages for the interleaved
schedules) and PyTorch's ``PipelineStage`` and schedules (GPipe, 1F1B,
interleaved 1F1B, interleaved zero bubble) move the micro-batches' activations
and gradients between ranks. There is no pipeline runtime here: this module only

* chooses the cut (:func:`stage_layers`): contiguous block ranges, balanced by
  parameter count by default, the embedding counted on the first stage and the
  final norm + head on the last (:func:`model_costs`), or given explicitly;
* builds one stage's module (:func:`split_model`) from the reference
  :class:`boost_compile.models.Llama` or a Hugging Face causal LM of the model
  types :data:`HF_MODEL_TYPES` (others are refused): a deep copy of that stage's blocks under their original names (parameter
  FQNs stay ``layers.3.attention...`` / ``model.layers.3.self_attn...``, so
  checkpoints and per-parameter comparisons line up with the whole model), the
  embedding on the first stage, the final norm and head on the last. Its
  ``forward`` takes tokens (first stage) or the hidden stream ``[mb, s, d]`` and
  returns the hidden stream, or the logits on the last stage. Each stage module
  is an ordinary ``nn.Module``: ``torch.compile(stage, backend="boost")`` or
  ``stage.compile(backend="boost")`` compiles it like any model;
* wraps the local stage modules in ``PipelineStage`` with static shapes taken from
  an example micro-batch (no shape-inference round trip) and returns the schedule
  (:func:`build_schedule`); :func:`pipeline_step` runs one training step on it.

Layout of virtual stages: with ``pp`` ranks and ``v`` stages per rank there are
``pp * v`` stages and stage ``i`` lives on rank ``i % pp`` (PyTorch's "loop"
layout, the one ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``
expect). With ``pp = 2, v = 2`` rank 0 holds stages 0 and 2, rank 1 stages 1 and 3.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor, nn

from boost_compile import _torch_compat as compat

#: schedule name -> (PyTorch schedule class name, needs several stages per rank)
SCHEDULES: dict[str, tuple[str, bool]] = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", True),
}


class PipelineError(ValueError):
    """A model, cut or schedule that the pipeline split cannot handle, and why."""


# ----------------------------------------------------------------------------- the cut


def _params(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def model_costs(model: nn.Module) -> list[float]:
    """Cost of each piece, in block-equivalents: ``[embedding, block 0, ..., block n-1, norm + head]``.

    The cost is the parameter count divided by the mean block's, so a uniform
    model's blocks cost 1 each. A head tied to the embedding is counted once, on
    the first stage (the head then adds only the final norm).
    """
    parts = _model_parts(model)
    blocks = [float(_params(b)) for b in parts["layers"]]
    mean = sum(blocks) / len(blocks) if blocks and sum(blocks) else 1.0
    emb = parts["embed"].weight
    head_weight = getattr(parts["head"], "weight", None)
    head = _params(parts["norm"]) + (0 if head_weight is emb else _params(parts["head"]))
    return [_params(parts["embed"]) / mean, *(b / mean for b in blocks), head / mean]


def stage_layers(
    n_layers: int,
    pp_stages: int,
    layers_per_stage: Sequence[int] | None = None,
    costs: Sequence[float] | None = None,
) -> list[range]:
    """Split block indices ``0..n_layers-1`` into ``pp_stages`` contiguous, non-empty ranges.

    ``layers_per_stage`` gives the count of each stage explicitly. Otherwise the
    cut minimises the most expensive stage (then the spread of the stage costs),
    with ``costs = [embedding, block 0, ..., block n-1, norm + head]`` in any unit,
    the embedding charged to the first stage and the head to the last
    (:func:`model_costs` gives parameter counts in block-equivalents). Without
    ``costs`` every block costs 1 and the embedding and head nothing: an even split,
    the remainder going to the earliest stages.
    """
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
    if not isinstance(pp_stages, int) or pp_stages < 1:
        raise ValueError(f"the number of pipeline stages must be a positive integer, got {pp_stages!r}")
    if pp_stages > n_layers:
        raise ValueError(
            f"{pp_stages} pipeline stages for {n_layers} blocks: every stage needs at least one block; "
            f"use at most {n_layers} stages (or a model with more layers)"
        )
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != pp_stages:
            raise ValueError(f"layers_per_stage has {len(counts)} entries for {pp_stages} stages: {counts}")
        if any(not isinstance(c, int) or c < 1 for c in counts):
            raise ValueError(f"every stage needs a positive whole number of blocks, got layers_per_stage={counts}")
        if sum(counts) != n_layers:
            raise ValueError(f"layers_per_stage={counts} sums to {sum(counts)}, not to the model's {n_layers} blocks")
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
        return [range(a, b) for a, b in pairwise(bounds)]
    if costs is None:
        base, extra = divmod(n_layers, pp_stages)
        return stage_layers(n_layers, pp_stages, [base + (i < extra) for i in range(pp_stages)])
    cost = [float(c) for c in costs]
    if len(cost) != n_layers + 2:
        raise ValueError(
            f"costs has {len(cost)} entries; expected n_layers + 2 = {n_layers + 2} "
            "([embedding, block 0, ..., block n-1, norm + head])"
        )
    if any(not c >= 0 for c in cost):  # also refuses NaN
        raise ValueError(f"costs must be non-negative numbers, got {cost}")
    embed, blocks, head = cost[0], cost[1:-1], cost[-1]
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def stage_cost(k: int, a: int, b: int) -> float:
        return prefix[b] - prefix[a] + (embed if k == 0 else 0.0) + (head if k == pp_stages - 1 else 0.0)

    # best[k][j]: (max stage cost, sum of squares) of the first j blocks cut into k + 1 stages
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n_layers + 1) for _ in range(pp_stages)]
    choice = [[0] * (n_layers + 1) for _ in range(pp_stages)]
    for j in range(1, n_layers + 1):
        c = stage_cost(0, 0, j)
        best[0][j] = (c, c * c)
    for k in range(1, pp_stages):
        for j in range(k + 1, n_layers + 1):
            for i in range(k, j):  # stage k holds blocks i..j-1
                prev = best[k - 1][i]
                c = stage_cost(k, i, j)
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[k][j]:
                    best[k][j], choice[k][j] = cand, i
    bounds = [n_layers]
    for k in range(pp_stages - 1, 0, -1):
        bounds.append(choice[k][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return [range(a, b) for a, b in pairwise(bounds)]


# ----------------------------------------------------------------------------- the stage modules


def _model_parts(model: nn.Module) -> dict[str, Any]:
    """The pieces of a supported model, or a PipelineError naming the attribute that is missing."""
    from boost_compile.models.llama import Llama

    if isinstance(model, Llama):
        return {
            "kind": "boost",
            "embed": model.tok_embeddings,
            "layers": model.layers,
            "norm": model.norm,
            "head": model.output,
        }
    name = type(model).__name__
    inner = getattr(model, "model", None)
    if inner is None:
        raise PipelineError(
            f"split_model does not understand {name}: it is not boost_compile.models.Llama and has no "
            "attribute 'model' (a Hugging Face LlamaForCausalLM-family model keeps its decoder in model.model)"
        )
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, attr):
            raise PipelineError(
                f"split_model does not understand {name}: it looked for model.{attr} "
                "(a Hugging Face LlamaForCausalLM-family model has model.embed_tokens, model.layers, "
                "model.norm, model.rotary_emb and lm_head)"
            )
    if not isinstance(inner.layers, nn.ModuleList):
        raise PipelineError(f"split_model does not understand {name}: model.layers is not an nn.ModuleList")
    head = getattr(model, "lm_head", None)
    if head is None:
        raise PipelineError(f"split_model does not understand {name}: it looked for lm_head (the output head)")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in HF_MODEL_TYPES:
        raise PipelineError(
            f"split_model does not support {name} (model_type {model_type!r}): a stage runs embed_tokens, the "
            "blocks, norm and lm_head and nothing else, which is checked for model types "
            f"{', '.join(HF_MODEL_TYPES)}; others may scale embeddings or logits outside those modules "
            "(Gemma 2's logit soft-capping, Granite's multipliers)"
        )
    return {"kind": "hf", "embed": inner.embed_tokens, "layers": inner.layers, "norm": inner.norm,
            "head": head, "rotary": inner.rotary_emb, "config": getattr(model, "config", None)}


def _kept_layers(layers: nn.ModuleList, keep: range) -> nn.ModuleDict:
    """The kept blocks under their original indices, so FQNs stay ``layers.<i>...``."""
    return nn.ModuleDict({str(i): layers[i] for i in keep})


class _StreamMarkers:
    """Where ``parallelize_(stage, ..., stream_io=True)`` marks a btp stage's input and output as
    this rank's d-slice of the stream (identity otherwise), and where ``parallelize_`` guards the
    stream input of a stage without the embedding (``set_input_guard``): inside ``forward``, so
    the guard is part of the stage's one compiled graph (a hook on the stage module would be
    compiled as a graph of its own, on every call)."""

    _stream_in: Callable[[Tensor], Tensor] | None = None
    _stream_out: Callable[[Tensor], Tensor] | None = None
    _input_guard: Callable[[Tensor], Tensor] | None = None
    _logits_out: Callable[[Tensor], Tensor] | None = None

    def set_stream_markers(self, stream_in: Callable[[Tensor], Tensor] | None, stream_out: Callable[[Tensor], Tensor] | None) -> None:
        self._stream_in, self._stream_out = stream_in, stream_out

    def set_input_guard(self, guard: Callable[[Tensor], Tensor] | None) -> None:
        self._input_guard = guard

    def set_logits_marker(self, marker: Callable[[Tensor], Tensor] | None) -> None:
        """``parallelize_(..., shard_logits=True)``: the last stage returns its vocabulary slice."""
        self._logits_out = marker

    def _logits(self, logits: Tensor) -> Tensor:
        return self._logits_out(logits) if self._logits_out is not None else logits

    @property
    def hidden_dtype(self) -> torch.dtype:
        """The dtype of the stream between stages: the stage's parameters' (it follows a cast)."""
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.float32)

    def _enter(self, x: Tensor) -> Tensor:
        if self._input_guard is not None:
            x = self._input_guard(x)
        return self._stream_in(x) if self._stream_in is not None else x

    def _leave(self, h: Tensor) -> Tensor:
        return self._stream_out(h) if self._stream_out is not None else h


class LlamaStage(_StreamMarkers, nn.Module):
    """One pipeline stage of :class:`boost_compile.models.Llama` (see :func:`split_model`)."""

    def __init__(self, parts: dict[str, Any], rope: tuple[Tensor, Tensor], max_seq_len: int,
                 stage_index: int, num_stages: int, layers: range) -> None:
        super().__init__()
        self.stage_index, self.num_stages, self.layer_range = stage_index, num_stages, layers
        self.hidden_size = parts["hidden"]
        self.max_seq_len = max_seq_len
        if "embed" in parts:
            self.tok_embeddings = parts["embed"]
        self.layers = parts["layers"]
        if "head" in parts:
            self.norm = parts["norm"]
            self.output = parts["head"]
            self.vocab_size = parts["head"].weight.shape[0]
        self.register_buffer("rope_cos", rope[0], persistent=False)
        self.register_buffer("rope_sin", rope[1], persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        seq = x.shape[1]
        if seq > self.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.max_seq_len}")
        h = self.tok_embeddings(x) if hasattr(self, "tok_embeddings") else self._enter(x)
        cos = self.rope_cos[:seq].to(h.dtype)
        sin = self.rope_sin[:seq].to(h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if hasattr(self, "output"):
            return self._logits(self.output(self.norm(h)))
        return self._leave(h)


#: Hugging Face model types whose decoder is embed -> blocks -> norm -> lm_head and nothing else
#: (no embedding multiplier outside embed_tokens, no logit soft-capping or scaling), each checked
#: stage by stage against the whole model (tests/distributed/test_pipeline.py)
HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "olmo2", "phi3")


def _sliding_layers(config: Any, n_layers: int) -> set[int]:
    """The blocks whose attention is a sliding window, as the Hugging Face model masks them:
    ``config.layer_types`` where the config has it (Qwen2, Qwen3), else every block when
    ``config.sliding_window`` is set (Mistral, Phi-3)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return {i for i in range(n_layers) if layer_types[i] == "sliding_attention"}
    return set(range(n_layers)) if getattr(config, "sliding_window", None) is not None else set()


def _causal_mask(config: Any, hidden: Tensor, position_ids: Tensor, sliding: bool = False) -> Any:
    """Hugging Face's own causal mask (or sliding-window causal mask) for the configured attention
    (None when SDPA's is_causal does)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    params = inspect.signature(make).parameters
    values = {
        "config": config,
        "inputs_embeds": hidden,
        "input_embeds": hidden,
        "attention_mask": None,
        "cache": None,
        "past_key_values": None,
        "cache_position": position_ids[0],
        "position_ids": position_ids,
    }
    return make(**{k: v for k, v in values.items() if k in params})


class HFLlamaStage(_StreamMarkers, nn.Module):
    """One pipeline stage of a Hugging Face ``LlamaForCausalLM``-family model (see :func:`split_model`).

    Parameter FQNs are the whole model's (``model.embed_tokens.weight``,
    ``model.layers.3.self_attn...``, ``lm_head.weight``); the rotary embedding is
    kept on every stage and recomputed from the position ids, as is the causal mask.
    """

    def __init__(self, parts: dict[str, Any], stage_index: int, num_stages: int, layers: range) -> None:
        super().__init__()
        self.stage_index, self.num_stages, self.layer_range = stage_index, num_stages, layers
        self.hidden_size = parts["hidden"]
        self.config = parts["config"]
        self.model = nn.Module()
        if "embed" in parts:
            self.model.embed_tokens = parts["embed"]
        self.model.layers = parts["layers"]
        self.model.rotary_emb = parts["rotary"]
        n_layers = getattr(self.config, "num_hidden_layers", layers.stop)
        self.sliding = _sliding_layers(self.config, n_layers) & set(layers) if self.config is not None else set()
        if "head" in parts:
            self.model.norm = parts["norm"]
            self.lm_head = parts["head"]
            self.vocab_size = parts["head"].weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        h = self.model.embed_tokens(x) if hasattr(self.model, "embed_tokens") else self._enter(x)
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        position_embeddings = self.model.rotary_emb(h, position_ids)
        full = _causal_mask(self.config, h, position_ids) if self.config is not None else None
        window = _causal_mask(self.config, h, position_ids, sliding=True) if self.sliding else None
        for index, layer in self.model.layers.items():
            mask = window if int(index) in self.sliding else full
            out = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
            h = out[0] if isinstance(out, tuple) else out
        if hasattr(self, "lm_head"):
            return self._logits(self.lm_head(self.model.norm(h)))
        return self._leave(h)


def split_model(
    model: nn.Module,
    stage_index: int,
    num_stages: int,
    *,
    layers_per_stage: Sequence[int] | None = None,
    costs: Sequence[float] | None = None,
    memo: dict[int, Any] | None = None,
) -> nn.Module:
    """A deep copy of stage ``stage_index`` of ``num_stages``: its blocks, plus embedding / norm + head.
    ``memo``: ``copy.deepcopy``'s, filled with each copied object's copy by the original's id.

    The cut is :func:`stage_layers` (``layers_per_stage``, else ``costs``, else
    :func:`model_costs` of ``model``). ``model`` itself is left untouched. A head
    tied to the embedding is refused unless both land on one stage.
    """
    parts = _model_parts(model)
    n_layers = len(parts["layers"])
    if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
        raise PipelineError(f"stage_index must be in 0..{num_stages - 1}, got {stage_index!r}")
    if layers_per_stage is None and costs is None:
        costs = model_costs(model)
    try:
        ranges = stage_layers(n_layers, num_stages, layers_per_stage, costs)
    except ValueError as exc:
        raise PipelineError(f"{type(model).__name__}: {exc}") from None
    keep = ranges[stage_index]
    first, last = stage_index == 0, stage_index == num_stages - 1
    if getattr(parts["head"], "weight", None) is parts["embed"].weight and num_stages > 1:
        raise PipelineError(
            f"{type(model).__name__}'s output head is tied to its embedding (one weight), and the embedding "
            f"is on stage 0 while the head is on stage {num_stages - 1}: a tied weight cannot be split across "
            "pipeline stages; untie it (tie_embeddings=False / tie_word_embeddings=False) or use one stage"
        )
    pieces: dict[str, Any] = {"layers": _kept_layers(parts["layers"], keep)}
    if first:
        pieces["embed"] = parts["embed"]
    if last:
        pieces["norm"], pieces["head"] = parts["norm"], parts["head"]
    if parts["kind"] == "hf":
        pieces["rotary"] = parts["rotary"]
    pieces = copy.deepcopy(pieces, memo)  # one copy: weights shared between kept pieces stay shared
    # the stream between stages: the embedding's width
    pieces["hidden"] = parts["embed"].weight.shape[1]
    if parts["kind"] == "boost":
        rope = (model.rope_cos.detach().clone(), model.rope_sin.detach().clone())
        return LlamaStage(pieces, rope, model.config.max_seq_len, stage_index, num_stages, keep)
    pieces["config"] = parts["config"]
    return HFLlamaStage(pieces, stage_index, num_stages, keep)


# ----------------------------------------------------------------------------- the schedule


def stage_module(module: nn.Module) -> LlamaStage | HFLlamaStage:
    """The stage module under a ``torch.compile`` wrapper, if any."""
    inner = compat.original_module(module)
    if not isinstance(inner, LlamaStage | HFLlamaStage):
        raise PipelineError(
            f"build_schedule takes stage modules made by split_model (optionally compiled), got {type(inner).__name__}"
        )
    return inner


def _is_compiled(module: nn.Module) -> bool:
    return any(compat.is_compiled_module(m) for m in module.modules())


def _example_io(stage: LlamaStage | HFLlamaStage, example: Tensor) -> tuple[Tensor, Tensor]:
    """Meta tensors of the stage's input and output for a micro-batch of tokens ``example``."""
    mb, seq = example.shape[:2]
    first = stage.stage_index == 0
    last = stage.stage_index == stage.num_stages - 1
    # requires_grad is part of PipelineStage's static metadata: the stream carries gradients back;
    # a stage parallelized with btp (parallelize_(..., stream_io=True)) sends its d-slice
    width = stage.hidden_size // getattr(stage, "_boost_stream_shards", 1)
    hidden = torch.empty(mb, seq, width, dtype=stage.hidden_dtype, device="meta", requires_grad=True)
    inp = torch.empty(mb, seq, dtype=example.dtype, device="meta") if first else hidden
    if last:  # the logits: whole, or this rank's vocabulary slice (parallelize_(..., shard_logits=True))
        shard = getattr(stage, "_boost_vocab_shard", None)
        vocab = stage.vocab_size if shard is None else -(-shard.vocab // shard.world)
        out = torch.empty(mb, seq, vocab, dtype=stage.hidden_dtype, device="meta", requires_grad=True)
    else:
        out = hidden
    return inp, out


class VocabParallelLoss:
    """The schedule's ``loss_fn`` for a last stage that returns its vocabulary slice of the logits
    (``parallelize_(stage, ..., shard_logits=True)``).

    ``loss(logits, targets)`` is ``F.cross_entropy(logits.flatten(0, 1).float(),
    targets.flatten())`` over the whole vocabulary, the micro-batch mean, computed
    from this rank's [mb, s, ceil(V/p)] slice with two all-reduces over the stage's
    TP group (a max of [N], a sum of [N, 2]) and none in backward: the [mb, s, V]
    logits are never gathered. Make it with :func:`vocab_parallel_loss`.
    """

    def __init__(self, shard: Any) -> None:
        self.shard = shard

    def __call__(self, logits: Tensor, targets: Tensor) -> Tensor:
        from boost_compile.distributed.collectives import vocab_parallel_cross_entropy

        s = self.shard
        return vocab_parallel_cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                            s.group_name, s.world, s.rank, s.vocab)


def vocab_parallel_loss(stage: nn.Module) -> VocabParallelLoss:
    """The loss of a last stage parallelized with ``shard_logits=True`` (see :class:`VocabParallelLoss`)."""
    shard = getattr(stage_module(stage), "_boost_vocab_shard", None)
    if shard is None:
        raise PipelineError(
            "vocab_parallel_loss is for a last stage that returns its vocabulary slice of the logits: "
            "parallelize it with parallelize_(stage, ..., stream_io=True, shard_logits=True)"
        )
    return VocabParallelLoss(shard)


def _check_loss(stage: LlamaStage | HFLlamaStage, loss_fn: Any) -> None:
    """A sharded-logits last stage needs the vocabulary-parallel loss, and only it does."""
    sharded = getattr(stage, "_boost_vocab_shard", None) is not None
    if sharded and not isinstance(loss_fn, VocabParallelLoss):
        raise PipelineError(
            f"stage {stage.stage_index} returns this rank's vocabulary slice of the logits (shard_logits=True): "
            "a plain loss would see a fraction of the vocabulary; pass loss_fn=vocab_parallel_loss(stage)"
        )
    if not sharded and isinstance(loss_fn, VocabParallelLoss):
        raise PipelineError(
            f"stage {stage.stage_index} returns whole logits: vocab_parallel_loss is for a last stage "
            "parallelized with shard_logits=True; pass a plain loss_fn"
        )


def build_schedule(
    stage_modules: Sequence[nn.Module],
    stage_indices: Sequence[int],
    num_stages: int,
    group: Any,
    n_microbatches: int,
    schedule: str = "1f1b",
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    example_microbatch: Tensor | None = None,
    *,
    batch_size: int | None = None,
    device: torch.device | str | None = None,
    scale_grads: bool = True,
) -> Any:
    """Wrap this rank's stage modules in ``PipelineStage`` and return the PyTorch schedule.

    ``stage_modules`` are the modules :func:`split_model` made for ``stage_indices``
    (compiled or not); stage ``i`` must live on rank ``i % pp`` of ``group``.
    ``gpipe`` and ``1f1b`` take one stage per rank (``num_stages == pp``);
    ``interleaved_1f1b`` and ``zero_bubble`` several. ``example_microbatch`` is one
    micro-batch of tokens ``[mb, s]``: the stages' input and output shapes are
    derived from it, so no shape-inference messages are exchanged (a step must then
    use micro-batches of that shape). ``batch_size``, when given, is checked to be
    ``n_microbatches`` such micro-batches. The loss ``loss_fn(logits, targets)`` is
    a micro-batch mean; gradients are divided by ``n_microbatches`` (PyTorch's
    ``scale_grads``), so they are those of the mean over the batch; ``scale_grads=False``
    leaves them summed over the micro-batches, for a caller that accumulates several
    steps and divides once. A last stage
    parallelized with ``shard_logits=True`` returns its vocabulary slice of the
    logits and takes ``loss_fn=vocab_parallel_loss(stage)`` (any other is refused).
    """
    import torch.distributed as dist
    from torch.distributed import pipelining

    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    cls_name, multi = SCHEDULES[schedule]
    modules, indices = list(stage_modules), list(stage_indices)
    if not modules or len(modules) != len(indices):
        raise PipelineError(f"got {len(modules)} stage modules for {len(indices)} stage indices")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise PipelineError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")
    if example_microbatch is None:
        raise PipelineError("build_schedule needs example_microbatch (one micro-batch of tokens [mb, s])")
    if batch_size is not None and batch_size != n_microbatches * example_microbatch.shape[0]:
        raise PipelineError(
            f"a batch of {batch_size} does not split into {n_microbatches} micro-batches of "
            f"{example_microbatch.shape[0]} (the example micro-batch's size)"
            + ("" if batch_size % n_microbatches == 0 else
               f": {batch_size} is not divisible by {n_microbatches} micro-batches")
        )
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    if multi and len(modules) < 2:
        raise PipelineError(
            f"schedule {schedule!r} interleaves virtual stages: give each rank at least 2 stages "
            f"(stage i on rank i % {pp}), or use '1f1b' / 'gpipe' with one stage per rank"
        )
    if not multi and (len(modules) != 1 or num_stages != pp):
        raise PipelineError(
            f"schedule {schedule!r} runs one stage per rank ({pp} stages on {pp} ranks); got {len(modules)} "
            f"local stage(s) of {num_stages}: use 'interleaved_1f1b' or 'zero_bubble' for virtual stages"
        )
    if num_stages % pp:
        raise PipelineError(f"{num_stages} stages do not divide evenly over {pp} pipeline ranks")
    for module, index in zip(modules, indices, strict=True):
        meta = stage_module(module)
        if meta.stage_index != index or meta.num_stages != num_stages:
            raise PipelineError(
                f"the module given for stage {index} of {num_stages} was split as stage "
                f"{meta.stage_index} of {meta.num_stages}"
            )
        if index % pp != rank:
            raise PipelineError(
                f"stage {index} belongs on rank {index % pp} (stage i lives on rank i % {pp}), not on rank {rank}"
            )
    for module, index in zip(modules, indices, strict=True):
        if index == num_stages - 1:
            _check_loss(stage_module(module), loss_fn)
    if schedule == "zero_bubble" and any(_is_compiled(m) for m in modules):
        raise PipelineError(
            "the zero_bubble schedule splits each backward into input and weight gradients, which a "
            "compiled stage (one fused backward graph) cannot do; use 'interleaved_1f1b' with compiled stages"
        )
    if device is None:
        device = next(stage_module(modules[0]).parameters()).device
    device = torch.device(device)
    stages = []
    for module, index in zip(modules, indices, strict=True):
        inp, out = _example_io(stage_module(module), example_microbatch)
        stages.append(pipelining.PipelineStage(module, index, num_stages, device,
                                               input_args=(inp,), output_args=(out,), group=group))
    cls = getattr(pipelining, cls_name)
    if multi:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def pipeline_step(schedule: Any, tokens: Tensor | None, targets: Tensor | None) -> Tensor | None:
    """One forward + backward of the whole batch; the mean micro-batch loss on the rank of the last stage.

    The rank holding stage 0 passes ``tokens``, the one holding the last stage
    ``targets`` (the others may pass them too; they are ignored there). Returns
    None on ranks without the last stage.
    """
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    n = schedule._n_microbatches
    for name, value, needed in (("tokens", tokens, first), ("targets", targets, last)):
        if needed and value is None:
            raise PipelineError(f"this rank holds the {'first' if name == 'tokens' else 'last'} stage: pass {name}")
        if needed and value.shape[0] % n:
            raise PipelineError(
                f"a batch of {value.shape[0]} is not divisible by {n} micro-batches; "
                f"use a batch that is a multiple of {n}"
            )
    losses: list[Tensor] = []
    args = (tokens,) if first else ()
    schedule.step(*args, target=targets if last else None, losses=losses if last else None, return_outputs=False)
    if not last:
        return None
    return torch.stack([loss.detach() for loss in losses]).mean()
