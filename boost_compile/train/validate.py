"""Checking and resolving a ``boost-train`` config before anything is built.

:func:`validate` checks what the schema's types cannot express (a preset that
exists, a TP degree that divides the heads, a data path that exists, the pass
options through ``BoostConfig.from_options``, a pipeline cut that can work) and
raises :class:`ConfigError` before any process group, model or data is created;
on the way it reads a Hugging Face model's config (:func:`model_shape`) and
loads the tokenizer it names (:func:`check_tokenizer`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boost_compile.config import BoostConfig, ConfigError, FactorizeConfig
from boost_compile.export_folder import BOOST_LLAMA, export_info, llama_fields, lowrank_layers
from boost_compile.train.config import (
    GROUPS,
    DataConfig,
    FactorizeGroup,
    ModelConfig,
    PassesConfig,
    TrainConfig,
    check_choice,
    check_choices,
)
from boost_compile.train.tokenizer import BYTE_VOCAB, BYTES, Tokenizer, parse_spec
from boost_compile.train.validate_data_parallel import check_ep, check_fsdp


@dataclass
class ModelShape:
    """What validation needs to know about a model without building it."""

    kind: str  # "preset" or "hf"
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    dim: int
    vocab_size: int
    dense: bool
    tie_embeddings: bool = False
    llama_config: Any = None  # LlamaConfig for presets
    hf_config: Any = None  # transformers PretrainedConfig for hf
    #: a boost-export folder's bottlenecks (module name -> shape), made when the model is built
    lowrank_layers: dict[str, Any] = dataclasses.field(default_factory=dict)


#: Root keys that are not the schema's: the node Hydra adds to a config composed with
#: ``return_hydra_config`` (a task's config does not carry it).
HYDRA_KEYS = frozenset({"hydra"})


def _schema_of(hint: Any) -> tuple[str, Any]:
    """What a field's type says about the keys beneath it: ``("schema", cls)`` for a dataclass,
    ``("items", cls)`` for a list or tuple of dataclasses, ``("free", None)`` for a dict or
    ``Any`` (keys the schema does not name: ``model.overrides``, ``passes.options``, ...),
    ``("leaf", None)`` for a value without keys."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    options = [a for a in typing.get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
    for option in options:
        origin = typing.get_origin(option) or option
        if option is Any or (isinstance(origin, type) and issubclass(origin, Mapping)):
            return "free", None
        if dataclasses.is_dataclass(option):
            return "schema", option
        if origin in (list, tuple):
            items = [a for a in typing.get_args(option) if dataclasses.is_dataclass(a)]
            if items:
                return "items", items[0]
    return "leaf", None


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _first_leaf(key: str, value: Any) -> str:
    """The dotted key of the first value under ``value`` (``foo.bar`` for ``+foo.bar=1``)."""
    while isinstance(value, Mapping) and value:
        name, value = next(iter(value.items()))
        key = f"{key}.{name}"
    return key


def _unknown_key(node: Mapping, cls: type, prefix: str) -> str | None:
    """The refusal of the first key of ``node`` (and below) that dataclass ``cls`` does not
    declare; None when every key is declared. Dict-typed fields take any key."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = sorted(f.name for f in dataclasses.fields(cls))
    for name, value in node.items():
        key = f"{prefix}{name}"
        if name not in fields:
            if not prefix and name in HYDRA_KEYS:
                continue
            return _refusal(key, _first_leaf(key, value), fields, prefix)
        kind, inner = _schema_of(hints[name])
        children: list[tuple[str, Any]] = []
        if kind == "schema":
            children = [(f"{key}.", value)]
        elif kind == "items" and isinstance(value, (list, tuple)):
            children = [(f"{key}[{i}].", item) for i, item in enumerate(value)]
        for child_prefix, child in children:
            found = _unknown_key(child, inner, child_prefix) if isinstance(child, Mapping) else None
            if found:
                return found
    return None


def _refusal(key: str, leaf: str, fields: list[str], prefix: str) -> str:
    """One line: the unknown key as given, the declared keys nearest to it, all its siblings."""
    name = key.removeprefix(prefix)
    lowered = {f.lower(): f for f in fields}
    near = [lowered[n] for n in difflib.get_close_matches(name.lower(), list(lowered), n=3)]
    rest = leaf.removeprefix(key)  # foo.bar: the keys given below the unknown one
    where = prefix.rstrip(".") or "the config"
    notes = [f"{where} has no key {name}"] if rest else []
    if near:
        notes.append(f"did you mean {' or '.join(prefix + n + rest for n in near)}?")
    message = f"unknown config key {leaf}" + (f" ({'; '.join(notes)})" if notes else "")
    message += f"; the keys of {where}: {', '.join(fields)}; "
    if near:
        return message + "the fix is the spelling, not leaving out the +"
    return message + "boost-train has no such setting, and leaving out the + does not add one"


def check_known_keys(cfg: Any) -> None:
    """ConfigError naming the first key of ``cfg`` that :class:`TrainConfig` does not declare.

    Hydra's ``+key=value`` adds a key past the schema's struct check (``+optim.lrr=0.5``), and
    converting the config to :class:`TrainConfig` would then drop it without a word: the run
    would train with the default. The free-form fields (dict-typed: ``model.overrides``,
    ``model.hf_config``, ``passes.options``) take any key; their own checks read them.
    """
    from omegaconf import DictConfig, OmegaConf

    node = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    if isinstance(node, Mapping):
        refusal = _unknown_key(node, TrainConfig, "")
        if refusal:
            raise ConfigError(refusal)


def to_train_config(cfg: Any) -> TrainConfig:
    """A :class:`TrainConfig` from a DictConfig (as Hydra gives it), a dict or itself; a key
    the schema does not declare is refused (:func:`check_known_keys`)."""
    if isinstance(cfg, TrainConfig):
        return cfg
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(cfg, (dict, DictConfig)):
        raise ConfigError(f"expected a config, got {type(cfg).__name__}")
    check_known_keys(cfg)
    if any(key in cfg for key in HYDRA_KEYS):  # Hydra's own settings, not the run's
        keys = [k for k in cfg if k not in HYDRA_KEYS]
        cfg = {k: cfg[k] for k in keys} if isinstance(cfg, dict) else OmegaConf.masked_copy(cfg, keys)
    try:
        if isinstance(cfg, dict) or OmegaConf.get_type(cfg) is not TrainConfig:
            cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(str(exc)) from exc
    assert isinstance(obj, TrainConfig)
    return obj


def _positive(name: str, value: int | float, *, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{name} must be {bound}, got {value}")


#: ``model.init``'s choices (train/config.py says what each does)
MODEL_INITS = ("per_parameter", "global_rng")


def model_shape(model: ModelConfig, seq: int) -> ModelShape:
    """Resolve the model's shape from the config alone (no weights are built)."""
    if model.hf_path and model.hf_config is not None:
        raise ConfigError("model: give hf_path or hf_config, not both")
    if model.init not in MODEL_INITS:
        raise ConfigError(f"model.init={model.init!r}; valid choices: {', '.join(MODEL_INITS)}")
    if model.hf_path and export_info(model.hf_path) is not None:
        return _export_shape(model)
    if model.hf_path or model.hf_config is not None:
        return _hf_shape(model)
    if model.preset is None:
        raise ConfigError("model: give a preset, an hf_path or an hf_config")
    from boost_compile.models import LlamaConfig

    presets = LlamaConfig.presets()
    if model.preset not in presets:
        raise ConfigError(f"unknown preset {model.preset!r}; valid presets: {', '.join(presets)}")
    base = LlamaConfig.preset(model.preset)
    overrides = {"vocab_size": BYTE_VOCAB, "max_seq_len": max(seq, base.max_seq_len), **model.overrides}
    try:
        config = LlamaConfig.preset(model.preset, **overrides)
    except ValueError as exc:
        raise ConfigError(f"model.overrides: {exc}") from exc
    return ModelShape(
        kind="preset",
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        ffn_dim=config.ffn_dim,
        dim=config.dim,
        vocab_size=config.vocab_size,
        dense=config.projection == "dense",
        tie_embeddings=config.tie_embeddings,
        llama_config=config,
    )


def _export_shape(model: ModelConfig) -> ModelShape:
    """A ``boost-export`` folder as ``model.hf_path``: its model, bottlenecks included (a reference
    model's from its ``config.json``, a Hugging Face model's from its config and ``boost_export.json``)."""
    info = export_info(model.hf_path) or {}
    if not model.pretrained and info.get("format") != "hf":
        raise ConfigError(f"model.hf_path={model.hf_path} is a boost-export folder ({info.get('format')}): "
                          "set model.pretrained=true to start from its weights")
    if info.get("format") != BOOST_LLAMA:
        return dataclasses.replace(_hf_shape(model), dense=not lowrank_layers(model.hf_path),
                                   lowrank_layers=lowrank_layers(model.hf_path))
    from boost_compile.models import LlamaConfig

    if model.overrides:
        raise ConfigError("model.overrides: a pretrained reference model keeps the config of its folder")
    fields, layers = llama_fields(model.hf_path)
    try:
        config = LlamaConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model.hf_path={model.hf_path}: its config.json is not a LlamaConfig ({exc})") from exc
    return ModelShape(
        kind="preset", n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, ffn_dim=config.ffn_dim, dim=config.dim,
        vocab_size=config.vocab_size, dense=config.projection == "dense" and not layers,
        tie_embeddings=config.tie_embeddings, llama_config=config, lowrank_layers=layers,
    )


def _hf_shape(model: ModelConfig) -> ModelShape:
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("a Hugging Face model needs the `transformers` package; it is not installed")
    import transformers

    if model.overrides:
        raise ConfigError("model.overrides applies to presets; put Hugging Face fields in hf_config")
    if model.hf_path:
        path = Path(model.hf_path).expanduser()
        if not path.exists():
            raise ConfigError(f"model.hf_path={model.hf_path!r} does not exist (a local folder or config.json)")
        try:
            config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.hf_path={model.hf_path!r}: {exc}") from exc
    else:
        values = dict(model.hf_config or {})
        model_type = values.pop("model_type", None)
        if not model_type:
            raise ConfigError("model.hf_config needs a model_type (e.g. llama)")
        try:
            config = transformers.AutoConfig.for_model(model_type, **values)
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"model.hf_config: {exc}") from exc
        if model.pretrained:
            raise ConfigError("model.pretrained needs weights: give hf_path, not hf_config")
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < BYTE_VOCAB:
        raise ConfigError(f"the Hugging Face model's vocab_size ({vocab}) must be >= {BYTE_VOCAB} (byte tokens)")
    heads = int(getattr(config, "num_attention_heads", 1))
    return ModelShape(
        kind="hf",
        n_heads=heads,
        n_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        ffn_dim=int(getattr(config, "intermediate_size", 0) or 0),
        dim=int(getattr(config, "hidden_size", 0) or 0),
        vocab_size=vocab,
        dense=True,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        hf_config=config,
    )


def factorize_config(group: FactorizeGroup) -> FactorizeConfig | None:
    """The library's FactorizeConfig, or None when the group is off."""
    if not group.enabled:
        return None
    values = {f.name: getattr(group, f.name) for f in dataclasses.fields(group) if f.name != "enabled"}
    return FactorizeConfig(**values)


def boost_options(passes: PassesConfig) -> BoostConfig | None:
    """The checked BoostConfig for ``backend=boost``; None for other backends."""
    if passes.backend != "boost":
        return None
    try:
        return BoostConfig.from_options(dict(passes.options))
    except ConfigError as exc:
        raise ConfigError(f"passes.options: {exc}") from exc


def text_files(data: DataConfig) -> list[Path]:
    """The files ``data=text`` reads: each path that is a file, and the files matching
    ``data.pattern`` under each folder (recursively, sorted); ConfigError when none exist."""
    if not data.paths:
        raise ConfigError("data=text needs data.paths=[file_or_folder, ...]")
    missing = [p for p in data.paths if not Path(p).expanduser().exists()]
    if missing:
        raise ConfigError(f"data path(s) not found: {', '.join(missing)}")
    files: list[Path] = []
    for entry in data.paths:
        path = Path(entry).expanduser()
        files.extend([path] if path.is_file() else sorted(p for p in path.rglob(data.pattern) if p.is_file()))
    if not files:
        raise ConfigError(f"data=text: no files match {data.pattern!r} under {', '.join(data.paths)}")
    return files


def check_tokenizer(data: DataConfig, model: ModelConfig, shape: ModelShape) -> None:
    """``data.tokenizer`` names a tokenizer that loads, and a model whose vocabulary is
    fixed (pretrained weights, ``model.overrides.vocab_size``) holds its ids."""
    try:
        kind, value = parse_spec(data.tokenizer)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if kind == BYTES:
        return
    if importlib.util.find_spec("tokenizers") is None:
        raise ConfigError(
            f"data.tokenizer={data.tokenizer} needs the `tokenizers` package (pip install tokenizers); "
            "use data.tokenizer=bytes"
        )
    if kind == "bpe":
        size, what = value, f"up to {value}"
    else:
        try:
            size = Tokenizer.from_file(value).vocab_size
        except Exception as exc:  # tokenizers raises its own Exception type for a bad file
            raise ConfigError(f"data.tokenizer={data.tokenizer!r} does not load: {exc}") from exc
        what = str(size)
    fixed = None
    if model.pretrained:
        fixed = ("the pretrained model's vocab_size", shape.vocab_size)
    elif shape.kind == "preset" and "vocab_size" in model.overrides:
        fixed = ("model.overrides.vocab_size", shape.vocab_size)
    if fixed is not None and fixed[1] < size:
        raise ConfigError(
            f"data.tokenizer={data.tokenizer} has {what} tokens but {fixed[0]} is {fixed[1]}; "
            "drop the override (the vocabulary follows the tokenizer) or use a smaller tokenizer"
        )


def tp_available() -> bool:
    import boost_compile

    return hasattr(boost_compile, "parallelize_")


def env_world_size() -> int:
    """Processes started by the launcher (torchrun sets WORLD_SIZE); 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def model_layers(shape: ModelShape) -> int:
    """The number of decoder blocks of the model ``shape`` describes."""
    if shape.kind == "preset":
        return int(shape.llama_config.n_layers)
    return int(getattr(shape.hf_config, "num_hidden_layers", 0) or 0)


def check_pipeline(tc: TrainConfig, shape: ModelShape) -> None:
    """The ``parallel.pp*`` options: a cut, a schedule and micro-batches that can work."""
    from boost_compile.distributed.pipeline import SCHEDULES as PP_SCHEDULES

    par, tr = tc.parallel, tc.trainer
    _positive("parallel.pp", par.pp)
    _positive("parallel.stages_per_rank", par.stages_per_rank)
    if par.microbatches is not None:
        _positive("parallel.microbatches", par.microbatches)
    check_choice("parallel.pp_schedule", par.pp_schedule, tuple(PP_SCHEDULES))
    if par.pp == 1:
        if par.stages_per_rank != 1 or par.microbatches is not None or par.layers_per_stage is not None:
            raise ConfigError(
                "parallel.stages_per_rank, parallel.microbatches and parallel.layers_per_stage configure pipeline "
                f"parallelism; set parallel.pp > 1 (got pp=1, stages_per_rank={par.stages_per_rank}, "
                f"microbatches={par.microbatches}, layers_per_stage={par.layers_per_stage})"
            )
        return
    if shape.kind == "preset" and shape.llama_config.projection == "lax":
        raise ConfigError(
            f"parallel.pp={par.pp}: preset {tc.model.preset!r} is a LaX model, whose every projection adds the same "
            "projection's latent of the previous block, and pipeline stages pass only the residual stream between "
            "them (a block's latents cannot reach the next stage); use parallel.pp=1"
        )
    if shape.kind == "preset" and shape.llama_config.router_aux_loss_coef > 0:
        raise ConfigError(f"parallel.pp={par.pp}: model.overrides.router_aux_loss_coef adds every block's balance loss "
                          "to the loss, which only the last stage computes; use parallel.pp=1 or router_aux_loss_coef=0")
    if par.tp > 1 and par.plan == "vanilla":
        raise ConfigError(
            "parallel.pp with parallel.tp > 1 takes parallel.plan=btp or megatron (their stages pass the stream "
            "between ranks as plain tensors); plan=vanilla's DTensor stages are not supported with pp"
        )
    if shape.kind == "hf":
        from boost_compile.distributed.pipeline import HF_MODEL_TYPES

        model_type = getattr(shape.hf_config, "model_type", None)
        if model_type not in HF_MODEL_TYPES:
            raise ConfigError(
                f"parallel.pp={par.pp}: pipeline stages of Hugging Face model_type {model_type!r} are not supported "
                f"(checked: {', '.join(HF_MODEL_TYPES)}); use parallel.pp=1"
            )
    if shape.tie_embeddings:
        raise ConfigError(
            f"parallel.pp={par.pp}: the model's output head is tied to its embedding (tie_embeddings), and "
            "the embedding is on the first pipeline stage while the head is on the last; use an untied model "
            "(model.overrides.tie_embeddings=false / hf_config tie_word_embeddings=false) or parallel.pp=1"
        )
    virtual = PP_SCHEDULES[par.pp_schedule][1]
    if virtual and par.stages_per_rank < 2:
        raise ConfigError(
            f"parallel.pp_schedule={par.pp_schedule} interleaves several stages per rank: set "
            "parallel.stages_per_rank >= 2 (or use pp_schedule=1f1b / gpipe)"
        )
    if not virtual and par.stages_per_rank != 1:
        raise ConfigError(
            f"parallel.pp_schedule={par.pp_schedule} runs one stage per rank, got parallel.stages_per_rank="
            f"{par.stages_per_rank}; use pp_schedule=interleaved_1f1b for several stages per rank"
        )
    if par.pp_schedule == "zero_bubble" and tc.passes.backend != "none":
        raise ConfigError(
            "parallel.pp_schedule=zero_bubble splits each backward into input and weight gradients, which a "
            f"compiled stage (passes.backend={tc.passes.backend}: one fused backward graph) cannot do "
            "(PyTorch refuses it); use pp_schedule=interleaved_1f1b, or passes=none for uncompiled stages"
        )
    stages = par.pp * par.stages_per_rank
    n_layers = model_layers(shape)
    if n_layers < stages:
        raise ConfigError(
            f"parallel.pp={par.pp} x stages_per_rank={par.stages_per_rank} = {stages} pipeline stages, but the "
            f"model has {n_layers} blocks: every stage needs at least one block; use fewer stages or more layers "
            "(model.overrides.n_layers=...)"
        )
    if par.layers_per_stage is not None:
        counts = list(par.layers_per_stage)
        if len(counts) != stages or any(not isinstance(c, int) or c < 1 for c in counts) or sum(counts) != n_layers:
            raise ConfigError(
                f"parallel.layers_per_stage={counts} must give each of the {stages} stages (pp={par.pp} x "
                f"stages_per_rank={par.stages_per_rank}) at least one block, {n_layers} blocks in all"
            )
    n_mb = par.n_microbatches
    if tr.batch % par.dp == 0 and tr.rank_batch(par.dp) % n_mb:
        local = tr.rank_batch(par.dp)
        what = (f"trainer.batch={tr.batch} / parallel.dp={par.dp} = {local}" if tr.local_batch is None
                else f"trainer.local_batch={local}")
        raise ConfigError(f"the per-rank batch of a step ({what}) must be divisible by parallel.microbatches={n_mb}")
    if par.pp_schedule == "1f1b" and n_mb < par.pp:
        raise ConfigError(
            f"parallel.pp_schedule=1f1b needs at least as many micro-batches as stages: "
            f"parallel.microbatches={n_mb} < parallel.pp={par.pp}"
        )
    if virtual:
        rounds = max(1, n_mb // par.pp)
        if n_mb % rounds:
            raise ConfigError(
                f"parallel.pp_schedule={par.pp_schedule} needs parallel.microbatches ({n_mb}) to be a multiple "
                f"of the rounds microbatches // pp = {rounds}; use a multiple of parallel.pp={par.pp}"
            )


def validate(cfg: Any, world_size: int | None = None) -> tuple[TrainConfig, ModelShape]:
    """Check every group; raise :class:`ConfigError` with a message naming the fix.

    ``world_size``: the number of processes that will run the config (default:
    ``WORLD_SIZE`` from the environment, 1 without torchrun).
    """
    tc = to_train_config(cfg)
    for name in GROUPS:  # the choices: each group checked them when built; again, in case they changed since
        check_choices(getattr(tc, name), name)
    tr, par, opt, data, ck, passes = tc.trainer, tc.parallel, tc.optim, tc.data, tc.checkpoint, tc.passes

    # trainer
    for name in ("steps", "batch", "seq", "log_every"):
        _positive(f"trainer.{name}", getattr(tr, name))
    if tr.threads is not None:
        _positive("trainer.threads", tr.threads)
    for name in ("save_every", "eval_every"):
        _positive(f"trainer.{name}", getattr(tr, name), zero_ok=True)
    if tr.eval_batches is not None:
        _positive("trainer.eval_batches", tr.eval_batches, zero_ok=True)
    if tr.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu")

    # parallel
    _positive("parallel.dp", par.dp)
    _positive("parallel.dp_shard", par.dp_shard)
    _positive("parallel.tp", par.tp)
    ranks, named = par.data_ranks, f"parallel.dp={par.dp}" if par.dp_shard == 1 else f"parallel.dp x dp_shard={par.data_ranks}"
    if tr.batch % ranks:
        raise ConfigError(f"trainer.batch={tr.batch} (the global batch) must be divisible by {named}")
    if tr.local_batch is not None:
        _positive("trainer.local_batch", tr.local_batch)
        if (tr.batch // ranks) % tr.local_batch:
            raise ConfigError(
                f"trainer.local_batch={tr.local_batch} must divide each rank's share of the global batch "
                f"(trainer.batch={tr.batch} / {named} = {tr.batch // ranks}): the micro-steps of "
                "gradient accumulation are equal"
            )
    check_fsdp(tc)

    # model, factorize, passes
    shape = model_shape(tc.model, tr.seq)
    check_ep(tc, shape)
    factorize = factorize_config(tc.factorize)
    if factorize is not None and not shape.dense:
        what = f"model.hf_path={tc.model.hf_path}" if tc.model.hf_path else f"preset {tc.model.preset!r}"
        raise ConfigError(
            f"factorize turns dense linears into bottlenecks, but {what} is already low-rank; "
            "use a dense model (model=tiny-dense, llama-*, a Hugging Face model) or factorize=none"
        )
    if passes.backend != "boost" and passes.options:
        raise ConfigError(f"passes.options configures backend=boost; passes.backend is {passes.backend!r}")
    boost_options(passes)
    if par.tp > 1:
        if not tp_available():
            raise ConfigError(
                "tensor parallelism is not available in this build (boost_compile.parallelize_ is missing); "
                "use parallel.tp=1"
            )
        bad = [
            f"{what} ({value})"
            for what, value in (("heads", shape.n_heads), ("kv-heads", shape.n_kv_heads), ("ffn", shape.ffn_dim), ("dim", shape.dim))
            if value % par.tp
        ]
        if bad:
            raise ConfigError(f"parallel.tp={par.tp} must divide the model's {', '.join(bad)}")
        moe = shape.llama_config if shape.kind == "preset" else None
        if moe is not None and moe.n_experts and moe.projection != "dense":
            raise ConfigError(f"parallel.tp={par.tp}: preset {tc.model.preset!r} is a low-rank mixture of experts, and btp "
                              "shards the stream its routers and experts read whole; use a dense MoE under megatron "
                              "(model=tiny-moe-dense) or parallel.tp=1")
        if par.plan != "vanilla" and passes.backend != "boost":
            raise ConfigError(
                f"parallel.plan={par.plan} inserts its collectives in the boost backend; use passes.backend=boost "
                f"(got {passes.backend!r})"
            )
        if par.plan == "vanilla" and par.dp > 1:
            # DDP's DTensor transform swaps vanilla's DTensor parameters for new local ones after the
            # optimizer holds the old ones: they would never be updated, and checkpoints cannot name them
            raise ConfigError(
                f"parallel.plan=vanilla (DTensor parameters) supports parallel.dp=1 only (got dp={par.dp}); "
                "use parallel.plan=btp or megatron with data parallelism"
            )

    check_pipeline(tc, shape)
    if par.zero not in (0, 1):
        raise ConfigError(f"parallel.zero={par.zero!r}: 0 (no sharding) or 1 (optimizer state sharded over dp)")
    if par.zero and par.dp == 1:
        raise ConfigError(
            "parallel.zero=1 shards the optimizer state over the data-parallel ranks, and parallel.dp=1 has "
            "one; set parallel.dp > 1 or parallel.zero=0"
        )

    # processes (after the model checks: a TP degree that cannot work is the first thing to fix)
    world = par.pp * par.data_ranks * par.tp
    started = env_world_size() if world_size is None else world_size
    if world != started:
        shard = f" x dp_shard={par.dp_shard}" if par.dp_shard > 1 else ""
        mesh = f"dp={par.dp}{shard} x tp={par.tp}" if par.pp == 1 else f"pp={par.pp} x dp={par.dp} x tp={par.tp}"
        flags = (f"parallel.dp={par.dp} parallel.tp={par.tp}" + (f" parallel.pp={par.pp}" if par.pp > 1 else "")
                 + (f" parallel.dp_shard={par.dp_shard}" if par.dp_shard > 1 else ""))
        data = "dp * dp_shard" if par.dp_shard > 1 else "dp"
        product = f"{data} * tp" if par.pp == 1 else f"pp * {data} * tp"
        if started == 1:
            raise ConfigError(
                f"parallel {mesh} needs {world} processes, but this is a single process; "
                f"launch with: torchrun --nproc-per-node {world} -m boost_compile.train {flags} ..."
            )
        raise ConfigError(
            f"parallel {mesh} = {world} ranks, but {started} processes were started "
            f"(WORLD_SIZE); make {product} equal the number of processes"
        )

    # optim
    _positive("optim.lr", opt.lr)
    _positive("optim.weight_decay", opt.weight_decay, zero_ok=True)
    _positive("optim.grad_clip", opt.grad_clip, zero_ok=True)
    if len(opt.betas) != 2 or not all(0.0 <= b < 1.0 for b in opt.betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(opt.betas)}")
    if not 0.0 <= opt.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {opt.min_lr_ratio}")
    if opt.warmup_steps is not None:
        _positive("optim.warmup_steps", opt.warmup_steps, zero_ok=True)

    # data
    _positive("data.max_bytes", data.max_bytes)
    if not 0.0 < data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {data.val_fraction}")
    if data.source == "text":
        text_files(data)
    if data.source == "tokens":
        from boost_compile.train.data.tokens_file import check_token_files  # imports data, which imports us

        check_token_files(data, tr.seq, tr.batch, par.dp)
    if data.source == "hf":
        if importlib.util.find_spec("datasets") is None:
            raise ConfigError(
                "data=hf needs the `datasets` package (pip install datasets), which is not installed; "
                "use data=stdlib or data=text"
            )
        if not data.dataset:
            raise ConfigError("data=hf needs data.dataset (a dataset name in the local cache, or a path)")
    check_tokenizer(data, tc.model, shape)

    # checkpoint, and what a run does when it fails
    _positive("checkpoint.keep", ck.keep)
    _positive("parallel.timeout_s", tc.parallel.timeout_s)
    if ck.resume_from is not None and not Path(ck.resume_from).expanduser().exists():
        raise ConfigError(f"checkpoint.resume_from={ck.resume_from!r} does not exist")

    # metrics
    if tc.metrics.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401  (imports the tensorboard package)
        except Exception as exc:  # not installed, or too old / broken to import
            raise ConfigError(
                f"metrics.tensorboard=true needs the `tensorboard` package, which cannot be imported "
                f"({type(exc).__name__}: {exc}); install it with pip install 'boost-compile[tensorboard]' "
                "or set metrics.tensorboard=false"
            ) from exc
    if tc.metrics.wandb:
        try:
            import wandb  # noqa: F401
        except Exception as exc:  # not installed, or broken
            raise ConfigError(
                f"metrics.wandb=true needs the `wandb` package, which cannot be imported "
                f"({type(exc).__name__}: {exc}); install it with pip install 'boost-compile[wandb]' "
                "or set metrics.wandb=false"
            ) from exc
        from boost_compile.train.metrics import wandb_mode

        wandb_mode(tc.metrics.wandb_mode)  # a bad WANDB_MODE fails here, before the run starts
    return tc, shape
