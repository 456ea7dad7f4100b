"""The schema of ``boost-train``: one structured config per Hydra group.

``register_configs()`` stores :class:`TrainConfig` in Hydra's ConfigStore as
``train_schema``; ``hydra_conf/train.yaml`` lists it first in its defaults, so
every group file (``hydra_conf/model/tiny.yaml``, ...) is merged into a typed
node and an unknown key or a value of the wrong type fails when the config is
composed. :func:`validate` then checks what types cannot express (a preset that
exists, a TP degree that divides the heads, a data path that exists, the pass
options through ``BoostConfig.from_options``) and raises :class:`ConfigError`
before any process group, model or data is created.

:func:`config_dir` finds the YAML files: ``hydra_conf/`` next to the package in a
checkout or an editable install (the source of truth), else the copy that a
wheel ships inside the package as ``boost_compile/hydra_conf``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boost_compile.config import BoostConfig, ConfigError, FactorizeConfig

BACKENDS = ("boost", "inductor", "aot_eager", "eager", "none")
PLANS = ("btp", "megatron", "vanilla", "auto")
PRECISIONS = ("fp32", "bf16-mixed", "bf16-true", "fp64")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULES = ("cosine", "linear", "constant")
DATA_SOURCES = ("stdlib", "text", "hf")
PROGRESS = ("auto", "bar", "lines", "none")
DIST_BACKENDS = ("auto", "gloo", "nccl")
BYTE_VOCAB = 256


# ----------------------------------------------------------------------------- groups


@dataclass
class ModelConfig:
    """``model=``: a reference preset, or a Hugging Face causal LM.

    ``preset``: a name from ``LlamaConfig.presets()`` (``tiny``, ``cola-60m``, ...);
    ``overrides``: LlamaConfig fields to change (``{dim: 128, n_layers: 4}``).
    ``hf_path``: a local folder or ``config.json`` of a Hugging Face model (built
    from its config, randomly initialised unless ``pretrained``); ``hf_config``:
    an inline Hugging Face config (``{model_type: llama, hidden_size: 64, ...}``).
    Tokens are bytes, so the vocabulary must hold 256 ids.
    """

    preset: str | None = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)
    hf_path: str | None = None
    hf_config: dict[str, Any] | None = None
    pretrained: bool = False


@dataclass
class FactorizeGroup:
    """``factorize=``: turn the dense block linears into bottlenecks before training.

    The fields are :class:`boost_compile.FactorizeConfig`'s; ``enabled=false`` is off.
    """

    enabled: bool = False
    rank: int | None = None
    rank_ratio: float | None = None
    param_ratio: float | None = None
    init: str = "svd"
    activation: str | None = None


@dataclass
class ParallelConfig:
    """``parallel=``: the mesh, ``pp`` pipeline x ``dp`` data-parallel x ``tp`` tensor-parallel ranks.

    ``pp * dp * tp`` must equal the number of processes (``torchrun
    --nproc-per-node`` times nodes). ``plan`` is ``parallelize_``'s plan for ``tp > 1``.
    ``dist_backend``: process-group backend; ``auto`` is nccl on CUDA, gloo on CPU.

    Pipeline parallelism (``pp > 1``, :mod:`boost_compile.train.pipeline`): the
    blocks are cut into ``pp * stages_per_rank`` stages, stage ``i`` on pipeline
    rank ``i % pp``; ``pp_schedule`` is ``gpipe``, ``1f1b``, ``interleaved_1f1b``
    or ``zero_bubble`` (the interleaved two need ``stages_per_rank >= 2``);
    ``microbatches`` splits each rank's batch (null: ``pp``). The blocks are
    balanced over the stages by parameter count, or cut as ``layers_per_stage``
    says (one count per stage, in stage order).

    ``zero=1`` shards the AdamW state over the dp ranks (ZeRO stage 1, PyTorch's
    ``ZeroRedundancyOptimizer``); ``0`` keeps a whole copy on every rank.
    """

    dp: int = 1
    tp: int = 1
    plan: str = "auto"
    dist_backend: str = "auto"
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int = 1
    layers_per_stage: list[int] | None = None
    zero: int = 0

    @property
    def n_microbatches(self) -> int:
        """``microbatches``, or ``pp`` when it is not set."""
        return self.microbatches if self.microbatches is not None else self.pp


@dataclass
class PassesConfig:
    """``passes=``: how the model is compiled.

    ``backend``: ``boost`` (this project), ``inductor`` / ``aot_eager`` / ``eager``
    (plain torch.compile backends, for comparison), or ``none`` (no torch.compile).
    ``options``: the ``options=`` dict of the boost backend, checked by
    ``BoostConfig.from_options`` (``{inner: aot_eager, group: {enabled: false}}``).
    """

    backend: str = "boost"
    options: dict[str, Any] = field(default_factory=dict)
    fullgraph: bool = False


@dataclass
class CheckpointConfig:
    """``checkpoint=``: torch.distributed.checkpoint (DCP) folders ``step_000100/``.

    ``dir``: where they go (default: ``<run folder>/checkpoints``); ``keep``: how
    many to keep; ``on_signal``: save when SIGTERM/SIGINT arrives; ``at_end``:
    save after the last step; ``resume_from``: the checkpoint ``trainer.resume``
    loads (a ``step_*`` folder, or a folder of them: the newest complete one);
    default ``dir``. How often to save is ``trainer.save_every``.
    """

    enabled: bool = True
    dir: str | None = None
    keep: int = 2
    on_signal: bool = True
    at_end: bool = True
    resume_from: str | None = None


@dataclass
class OptimConfig:
    """``optim=``: AdamW (matrices decayed, norms and biases not), warmup + decay.

    ``warmup_steps``: linear warmup (null: 10% of the steps); then ``schedule``
    (cosine, linear or constant) from ``lr`` down to ``min_lr_ratio * lr``.
    ``grad_clip``: global gradient-norm clip (0 = off).
    """

    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int | None = None
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0


@dataclass
class DataConfig:
    """``data=``: a tokenized text stream, packed into windows of ``trainer.seq``.

    ``source``: ``stdlib`` (the installed Python standard library's source, no
    download), ``text`` (local files: ``paths`` lists files or folders; folders are
    read recursively for ``pattern``), ``hf`` (``datasets.load_dataset(dataset,
    subset, split=split)`` offline, column ``text_field``). At most ``max_bytes``
    are read; the last ``val_fraction`` is held out.
    ``tokenizer``: ``bytes`` (vocab 256), a local ``tokenizer.json`` or a folder
    holding one, or ``bpe:<vocab>`` (a byte-level BPE trained on the training
    split, saved as the run folder's ``tokenizer.json``); see
    :mod:`boost_compile.train.tokenizer`. The model's vocabulary follows it.
    ``cache_dir``: the token cache (null: ``$BOOST_COMPILE_CACHE``, else
    ``~/.cache/boost_compile/tokens``); every tokenizer but bytes goes through it.
    """

    source: str = "stdlib"
    max_bytes: int = 4_000_000
    val_fraction: float = 0.01
    paths: list[str] = field(default_factory=list)
    pattern: str = "*.txt"
    dataset: str | None = None
    subset: str | None = None
    split: str = "train"
    text_field: str = "text"
    tokenizer: str = "bytes"
    cache_dir: str | None = None


@dataclass
class TrainerConfig:
    """``trainer=``: the loop.

    ``batch`` is the global batch (split over the ``dp`` ranks), ``seq`` the
    sequence length. ``precision``: fp32, bf16-mixed (autocast), bf16-true
    (bf16 weights) or fp64 (float64 weights and compute: the reference a parity
    check measures fp32 runs against). ``log_every``/``save_every``/``eval_every`` are in steps
    (0 = off; the last step always logs and evaluates). ``eval_batches``: val
    batches per evaluation (null = the whole val split). ``resume``: continue from
    the newest checkpoint (see ``checkpoint.resume_from``). ``progress``: a tqdm
    bar when stderr is a terminal (``auto``), else periodic lines. ``threads``:
    CPU intra-op threads per process (null: PyTorch's default; torchrun sets 1).
    """

    steps: int = 200
    batch: int = 16
    seq: int = 128
    precision: str = "fp32"
    seed: int = 0
    device: str = "auto"
    threads: int | None = None
    log_every: int = 10
    save_every: int = 100
    eval_every: int = 0
    eval_batches: int | None = None
    resume: bool = False
    progress: str = "auto"
    plot: bool = True


@dataclass
class MetricsConfig:
    """``metrics=``: what a run writes besides ``metrics.jsonl``, ``summary.json`` and the plot.

    ``tensorboard``: also write the metric rows as TensorBoard event files into
    ``<run folder>/tensorboard`` (rank 0); needs the ``tensorboard`` package
    (``pip install 'boost-compile[tensorboard]'``).
    """

    tensorboard: bool = False


@dataclass
class TrainConfig:
    """The whole ``boost-train`` config (``train.yaml`` composes one option per group)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    factorize: FactorizeGroup = field(default_factory=FactorizeGroup)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    passes: PassesConfig = field(default_factory=PassesConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


GROUPS = tuple(f.name for f in dataclasses.fields(TrainConfig))


def register_configs() -> None:
    """Store the schema in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def config_dir() -> Path:
    """The folder of ``train.yaml``: the checkout's ``hydra_conf/``, else the packaged copy."""
    package = Path(__file__).resolve().parent.parent  # boost_compile/, above boost_compile/train/
    for candidate in (package.parent / "hydra_conf", package / "hydra_conf"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"no hydra_conf/train.yaml next to {package} (checkout) or inside it (installed wheel)"
    )


# ----------------------------------------------------------------------------- validation


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


def to_train_config(cfg: Any) -> TrainConfig:
    """A :class:`TrainConfig` from a DictConfig (as Hydra gives it), a dict or itself."""
    if isinstance(cfg, TrainConfig):
        return cfg
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(cfg, (dict, DictConfig)):
        raise ConfigError(f"expected a config, got {type(cfg).__name__}")
    try:
        if isinstance(cfg, dict) or OmegaConf.get_type(cfg) is not TrainConfig:
            cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(str(exc)) from exc
    assert isinstance(obj, TrainConfig)
    return obj


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {', '.join(choices)}")


def _positive(name: str, value: int | float, *, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{name} must be {bound}, got {value}")


def model_shape(model: ModelConfig, seq: int) -> ModelShape:
    """Resolve the model's shape from the config alone (no weights are built)."""
    if model.hf_path and model.hf_config is not None:
        raise ConfigError("model: give hf_path or hf_config, not both")
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
    from boost_compile.train.tokenizer import BYTES, parse_spec

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
        from boost_compile.train.tokenizer import Tokenizer

        try:
            size = Tokenizer.from_file(value).vocab_size
        except Exception as exc:  # tokenizers raises its own Exception type for a bad file
            raise ConfigError(f"data.tokenizer={data.tokenizer!r} does not load: {exc}") from exc
        what = str(size)
    fixed = None
    if shape.kind == "hf" and model.pretrained:
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
    _choice("parallel.pp_schedule", par.pp_schedule, tuple(PP_SCHEDULES))
    if par.pp == 1:
        if par.stages_per_rank != 1 or par.microbatches is not None or par.layers_per_stage is not None:
            raise ConfigError(
                "parallel.stages_per_rank, parallel.microbatches and parallel.layers_per_stage configure pipeline "
                f"parallelism; set parallel.pp > 1 (got pp=1, stages_per_rank={par.stages_per_rank}, "
                f"microbatches={par.microbatches}, layers_per_stage={par.layers_per_stage})"
            )
        return
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
    if tr.batch % par.dp == 0 and (tr.batch // par.dp) % n_mb:
        local = tr.batch // par.dp
        raise ConfigError(
            f"the per-rank batch (trainer.batch={tr.batch} / parallel.dp={par.dp} = {local}) must be divisible "
            f"by parallel.microbatches={n_mb}"
        )
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
    _choice("trainer.precision", tr.precision, PRECISIONS)
    _choice("trainer.device", tr.device, DEVICES)
    _choice("trainer.progress", tr.progress, PROGRESS)
    if tr.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu")

    # parallel
    _positive("parallel.dp", par.dp)
    _positive("parallel.tp", par.tp)
    _choice("parallel.plan", par.plan, PLANS)
    _choice("parallel.dist_backend", par.dist_backend, DIST_BACKENDS)
    if tr.batch % par.dp:
        raise ConfigError(f"trainer.batch={tr.batch} (the global batch) must be divisible by parallel.dp={par.dp}")

    # model, factorize, passes
    shape = model_shape(tc.model, tr.seq)
    factorize = factorize_config(tc.factorize)
    if factorize is not None and not shape.dense:
        raise ConfigError(
            f"factorize turns dense linears into bottlenecks, but preset {tc.model.preset!r} is already low-rank; "
            "use a dense model (model=tiny-dense, llama-*, a Hugging Face model) or factorize=none"
        )
    _choice("passes.backend", passes.backend, BACKENDS)
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
    world = par.pp * par.dp * par.tp
    started = env_world_size() if world_size is None else world_size
    if world != started:
        mesh = f"dp={par.dp} x tp={par.tp}" if par.pp == 1 else f"pp={par.pp} x dp={par.dp} x tp={par.tp}"
        flags = f"parallel.dp={par.dp} parallel.tp={par.tp}" + (f" parallel.pp={par.pp}" if par.pp > 1 else "")
        product = "dp * tp" if par.pp == 1 else "pp * dp * tp"
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
    _choice("optim.name", opt.name, ("adamw",))
    _choice("optim.schedule", opt.schedule, SCHEDULES)
    if len(opt.betas) != 2 or not all(0.0 <= b < 1.0 for b in opt.betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(opt.betas)}")
    if not 0.0 <= opt.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {opt.min_lr_ratio}")
    if opt.warmup_steps is not None:
        _positive("optim.warmup_steps", opt.warmup_steps, zero_ok=True)

    # data
    _choice("data.source", data.source, DATA_SOURCES)
    _positive("data.max_bytes", data.max_bytes)
    if not 0.0 < data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {data.val_fraction}")
    if data.source == "text":
        text_files(data)
    if data.source == "hf":
        if importlib.util.find_spec("datasets") is None:
            raise ConfigError(
                "data=hf needs the `datasets` package (pip install datasets), which is not installed; "
                "use data=stdlib or data=text"
            )
        if not data.dataset:
            raise ConfigError("data=hf needs data.dataset (a dataset name in the local cache, or a path)")
    check_tokenizer(data, tc.model, shape)

    # checkpoint
    _positive("checkpoint.keep", ck.keep)
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
    return tc, shape
