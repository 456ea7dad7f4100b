"""The schema of ``boost-train``: one structured config per Hydra group.

``register_configs()`` stores :class:`TrainConfig` in Hydra's ConfigStore as
``train_schema``; ``hydra_conf/train.yaml`` lists it first in its defaults, so
every group file (``hydra_conf/model/tiny.yaml``, ...) is merged into a typed
node and an unknown key or a value of the wrong type fails when the config is
composed. A field with a fixed set of values is typed with its ``Literal`` of
choices, and every group checks them when it is built (``__post_init__``, through
:func:`check_choices`), as :mod:`boost_compile.config` checks its own options.
What types cannot express (a preset that exists, a TP degree that divides the
heads, a data path that exists, ...) is :func:`boost_compile.train.validate.validate`'s.

:func:`config_dir` finds the YAML files: ``hydra_conf/`` next to the package in a
checkout or an editable install (the source of truth), else the copy that a
wheel ships inside the package as ``boost_compile/hydra_conf``.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from boost_compile.config import ConfigError

# A choice field is ``Annotated[str, Literal[...]]``: OmegaConf 2.3 refuses a ``Literal``
# annotation ("Unexpected type annotation"), and sees ``str`` here; :func:`check_choices`
# reads the ``Literal``, the one list of the field's values.


def field_choices(cls: type, name: str) -> tuple[Any, ...]:
    """The values field ``name`` of dataclass ``cls`` may take (``typing.get_args`` of its
    ``Literal``); ``()`` for a field without one."""
    return _choices_of(cls).get(name, ())


@functools.cache
def _choices_of(cls: type) -> dict[str, tuple[Any, ...]]:
    hints = typing.get_type_hints(cls, include_extras=True)
    found: dict[str, tuple[Any, ...]] = {}
    for f in dataclasses.fields(cls):
        for part in (hints[f.name], *typing.get_args(hints[f.name])):
            if typing.get_origin(part) is Literal:
                found[f.name] = typing.get_args(part)
    return found


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    """ConfigError when ``value`` is not one of ``choices``; ``name`` is the dotted key."""
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {', '.join(map(str, choices))}")


def check_choices(group: Any, prefix: str) -> None:
    """Check every ``Literal``-typed field of the dataclass ``group`` (keys ``prefix.field``)."""
    for name, choices in _choices_of(type(group)).items():
        check_choice(f"{prefix}.{name}", getattr(group, name), choices)


# ----------------------------------------------------------------------------- groups


@dataclass
class ModelConfig:
    """``model=``: a reference preset, or a Hugging Face causal LM.

    Tokens are bytes by default, so the vocabulary must hold 256 ids.
    """

    preset: str | None = "tiny"
    """A name from ``LlamaConfig.presets()`` (``tiny``, ``cola-60m``, ...)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """LlamaConfig fields to change (``{dim: 128, n_layers: 4}``)."""
    hf_path: str | None = None
    """A local folder or ``config.json`` of a Hugging Face model (built from its config,
    randomly initialised unless ``pretrained``)."""
    hf_config: dict[str, Any] | None = None
    """An inline Hugging Face config (``{model_type: llama, hidden_size: 64, ...}``)."""
    pretrained: bool = False
    """Load the weights of ``hf_path`` (else only its config)."""
    init: str = "per_parameter"
    """How the model gets its first weights. ``per_parameter``: built on the meta device, each
    rank computing only the slice it holds (its FSDP2 shard, TP shard, pipeline stages): random
    weights are a function of ``trainer.seed`` and each parameter's name, pretrained ones are read
    slice by slice from ``hf_path``'s safetensors, and ``factorize`` by SVD runs one dense weight at
    a time. Every layout starts from bitwise the same weights, and no rank ever holds the whole
    model where the layout shards it (``boost_compile/meta_init.py``, ``weight_sources.py``).
    ``global_rng``: built whole on every rank by the model's own init from torch's global RNG
    seeded with ``trainer.seed`` (pretrained: ``from_pretrained``), as plain PyTorch would."""


@dataclass
class FactorizeGroup:
    """``factorize=``: turn the dense block linears into bottlenecks before training.

    The fields are :class:`boost_compile.FactorizeConfig`'s, which checks them.
    """

    enabled: bool = False
    """``false``: the model stays as built (give one of rank, rank_ratio, param_ratio)."""
    rank: int | None = None
    """The inner width r, the same for every layer."""
    rank_ratio: float | None = None
    """r = rank_ratio * min(d_in, d_out) (CoLA's r = d/4 is 0.25)."""
    param_ratio: float | None = None
    """r chosen so the factors hold this fraction of the dense layer's parameters."""
    init: str = "svd"
    """``svd`` (truncated SVD of the dense weights) or ``random`` (CoLA initialisation)."""
    activation: str | None = None
    """None or one of silu/gelu/relu, placed between the factors."""


@dataclass
class ParallelConfig:
    """``parallel=``: the mesh, ``pp`` pipeline x ``dp`` data-parallel x ``tp`` tensor-parallel ranks.

    ``pp * dp * dp_shard * tp`` must equal the number of processes (``torchrun
    --nproc-per-node`` times nodes).

    Pipeline parallelism (``pp > 1``, :mod:`boost_compile.train.pipeline`): the
    blocks are cut into ``pp * stages_per_rank`` stages, stage ``i`` on pipeline
    rank ``i % pp``, balanced over the stages by parameter count unless
    ``layers_per_stage`` says how.
    """

    dp: int = 1
    """Data-parallel replicas (DDP; with ``dp_shard > 1`` the replicate dim of HSDP)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard the weights, gradients and optimizer state (FSDP2,
    ``torch.distributed.fsdp.fully_shard`` per block, :mod:`boost_compile.train.fsdp`). Each
    of the ``dp * dp_shard`` data-parallel ranks reads its own share of the batch; ``dp > 1``
    with it is HSDP (``dp`` replicas of a ``dp_shard``-way sharded model)."""
    reshard_after_forward: bool | None = None
    """FSDP2: free each block's gathered weights after its forward and gather them again for its
    backward (``false`` keeps them, trading memory for one all-gather per block). The root's
    weights, which the backward needs first, are kept either way. ``null``: torchtitan's default,
    true without pipeline stages and false with them (each micro-batch's forward would gather the
    stage's weights again, and PyTorch's schedule keeps them gathered through the backward anyway)."""
    tp: int = 1
    """Tensor-parallel ranks."""
    plan: Annotated[str, Literal["btp", "megatron", "vanilla", "auto"]] = "auto"
    """``parallelize_``'s plan for ``tp > 1``."""
    dist_backend: Annotated[str, Literal["auto", "gloo", "nccl"]] = "auto"
    """Process-group backend; ``auto`` is nccl on CUDA, gloo on CPU."""
    pp: int = 1
    """Pipeline ranks."""
    pp_schedule: str = "1f1b"
    """``gpipe``, ``1f1b``, ``interleaved_1f1b`` or ``zero_bubble`` (the interleaved two need
    ``stages_per_rank >= 2``); the list is :mod:`boost_compile.distributed.pipeline`'s."""
    microbatches: int | None = None
    """Micro-batches each rank's batch is split into (null: ``pp``)."""
    stages_per_rank: int = 1
    """Pipeline stages on each pipeline rank."""
    layers_per_stage: list[int] | None = None
    """Blocks per stage, one count per stage in stage order (null: balanced)."""
    ep: int = 1
    """Expert parallelism: each mixture-of-experts layer's experts sharded by expert over this many
    data-parallel ranks, every rank's tokens sent to their experts' rank by all-to-all and back
    (``boost_compile.expert_parallel_``; attention, routers and shared experts stay whole, under
    DDP). It borrows the data-parallel ranks: ``ep`` divides ``dp``, each group of ``ep`` consecutive dp
    ranks holds every expert once, and the ``dp / ep`` groups are replicas whose expert gradients are
    averaged (TP megatron composes with it; pp, dp_shard and zero do not yet). Each rank builds and
    holds only its experts; a checkpoint saves them as shards of the whole, so it resumes under any
    other ``ep`` or in one process. The model must have experts modules of transformers' form (a
    Hugging Face MoE, or the reference MoE presets ``tiny-moe``...); anything else is refused by name."""
    zero: int = 0
    """``1`` shards the AdamW state over the dp ranks (ZeRO stage 1, PyTorch's
    ``ZeroRedundancyOptimizer``); ``0`` keeps a whole copy on every rank."""
    bucket_mb: float = 25.0
    """DDP's gradient bucket in MiB (``bucket_cap_mb``), and the pipeline stages' (``pp > 1``,
    ``train/dp_buckets.py``). A bucket is all-reduced as soon as all its gradients are ready:
    compiled per block, as the blocks' backwards end one by one (with pipeline stages, in each
    stage's last micro-batch), so a smaller bucket starts earlier and a larger one pays fewer
    collective latencies."""
    layout: Annotated[str, Literal["manual", "auto"]] = "manual"
    """``auto`` (``parallel=auto``): the layout planner (:mod:`boost_compile.plan`) chooses tp, pp,
    dp, zero, microbatches, pp_schedule, stages_per_rank, plan and ``passes.options.checkpoint``
    (unless set) for the world size torchrun gives, logs its best rows and the choice; the
    config is then validated as usual. ``manual``: the fields above, as given."""
    hardware: str | None = None
    """``auto``: the planner's hardware file (``cpu``, ``a100-80gb-nvlink``, ``h200`` or a path);
    null: ``cpu`` on CPU, else the file named after the CUDA device."""
    memory_gib: float | None = None
    """``auto``: usable memory per device in GiB (null: 90% of the hardware file's ``memory_gib``)."""
    check_memory: bool = True
    """Before the model is built, price this layout's start and step with the planner's memory
    model and refuse, in one line with the layouts that would fit, when a rank's memory cannot hold
    them: a CUDA device's free memory, or on CPU the address space RLIMIT_AS (``ulimit -v``) leaves
    (no check without a limit). ``false``: try anyway."""
    timeout_s: float = 600.0
    """How long a collective waits for its peers before the run fails (the process group's
    timeout): a hung or lost rank then ends the run, naming the rank and what it waited for,
    and a launcher with restarts (``torchrun --max-restarts``) starts it again. Long enough for
    the slowest rank's first compile and a checkpoint save."""

    @property
    def reshards_after_forward(self) -> bool:
        """``reshard_after_forward``, its default resolved (see there)."""
        return self.pp == 1 if self.reshard_after_forward is None else self.reshard_after_forward

    @property
    def data_ranks(self) -> int:
        """The ranks that read different data: ``dp * dp_shard``."""
        return self.dp * self.dp_shard

    def __post_init__(self) -> None:
        check_choices(self, "parallel")
        if not self.bucket_mb > 0:
            raise ConfigError(f"parallel.bucket_mb={self.bucket_mb!r} is not valid; give a positive size in MiB")

    @property
    def n_microbatches(self) -> int:
        """``microbatches``, or ``pp`` when it is not set."""
        return self.microbatches if self.microbatches is not None else self.pp


@dataclass
class PassesConfig:
    """``passes=``: how the model is compiled."""

    backend: Annotated[str, Literal["boost", "inductor", "aot_eager", "eager", "none"]] = "boost"
    """``boost`` (this project), ``inductor`` / ``aot_eager`` / ``eager`` (plain torch.compile
    backends, for comparison), or ``none`` (no torch.compile)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The ``options=`` dict of the boost backend, checked by ``BoostConfig.from_options``
    (``{inner: aot_eager, group: {enabled: false}}``)."""
    fullgraph: bool = False
    """torch.compile's ``fullgraph``: a graph break is an error."""
    unit: Annotated[str, Literal["block", "model"]] = "block"
    """What one compiled graph holds. ``block``: each repeated block is compiled on its own and
    identical blocks share one compiled artifact (the cold compile does not grow with depth;
    under dp each block's gradients are all-reduced while the blocks below run their backward);
    the embedding, final norm, head and loss run eagerly (under tp on the shards, gathered where
    the whole program would gather). ``model``: the whole model as one graph. A tensor-parallel
    model whose code around the blocks cannot run eagerly on its shards is compiled whole (logged
    with the construct)."""

    def __post_init__(self) -> None:
        check_choices(self, "passes")


@dataclass
class CheckpointConfig:
    """``checkpoint=``: torch.distributed.checkpoint (DCP) folders ``step_000100/``.

    How often to save is ``trainer.save_every``.
    """

    enabled: bool = True
    """Save checkpoints at all."""
    dir: str | None = None
    """Where they go (default: ``<run folder>/checkpoints``)."""
    keep: int = 2
    """How many to keep."""
    on_signal: bool = True
    """Save when SIGTERM/SIGINT arrives."""
    at_end: bool = True
    """Save after the last step."""
    at_start: bool = False
    """Save the starting weights as ``step_000000`` before the first step (a fresh run only): the
    seed checkpoint, bitwise the same in every layout under ``model.init=per_parameter``."""
    resume_from: str | None = None
    """The checkpoint ``trainer.resume`` loads (a ``step_*`` folder, or a folder of them: the
    newest complete one); default ``dir``."""
    async_save: bool = False
    """Write checkpoints in a background thread (``torch.distributed.checkpoint.async_save``):
    the step loop waits only for the state's copy in memory, not for the disk."""


@dataclass
class OptimConfig:
    """``optim=``: AdamW (matrices decayed, norms and biases not), warmup + decay."""

    name: Annotated[str, Literal["adamw"]] = "adamw"
    """The optimizer."""
    lr: float = 3e-3
    """The peak learning rate."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay (matrices only)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's two betas, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    warmup_steps: int | None = None
    """Linear warmup (null: 10% of the steps)."""
    schedule: Annotated[str, Literal["cosine", "linear", "constant"]] = "cosine"
    """The decay after warmup, from ``lr`` down to ``min_lr_ratio * lr``."""
    min_lr_ratio: float = 0.1
    """The last learning rate as a fraction of ``lr``."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""

    def __post_init__(self) -> None:
        check_choices(self, "optim")


@dataclass
class DataConfig:
    """``data=``: a tokenized text stream, packed into windows of ``trainer.seq``.

    At most ``max_bytes`` are read; the last ``val_fraction`` is held out.
    """

    source: Annotated[str, Literal["stdlib", "text", "hf", "tokens"]] = "stdlib"
    """``stdlib`` (the installed Python standard library's source, no download), ``text``
    (local files: ``paths``), ``hf`` (``datasets.load_dataset(dataset, subset, split=split)``
    offline, column ``text_field``), ``tokens`` (token ids already on disk, memory-mapped:
    ``paths``; see :mod:`boost_compile.train.data.tokens_file`)."""
    max_bytes: int = 4_000_000
    """How many bytes of text are read at most (``tokens`` reads its files whole)."""
    val_fraction: float = 0.01
    """The held-out tail of the stream, in (0, 1) (``tokens``: of a single file; a folder's
    ``val.bin`` is the validation split)."""
    paths: list[str] = field(default_factory=list)
    """``text``: files or folders; folders are read recursively for ``pattern``. ``tokens``: a
    folder holding ``train.bin`` and ``val.bin`` (nanoGPT's layout; or ``train.npy`` and
    ``val.npy``), one ``.bin`` / ``.npy`` file (its last ``val_fraction`` held out), or two files
    (train, then val)."""
    token_dtype: Annotated[str, Literal["uint16", "int32"]] = "uint16"
    """``tokens``: the type of the ids in a ``.bin`` file (flat, little-endian; nanoGPT writes
    uint16). A ``.npy`` file names its own type in its header."""
    pattern: str = "*.txt"
    """``text``: the file names read in a folder."""
    dataset: str | None = None
    """``hf``: a dataset name in the local cache, or a path."""
    subset: str | None = None
    """``hf``: the dataset's configuration."""
    split: str = "train"
    """``hf``: the dataset's split."""
    text_field: str = "text"
    """``hf``: the column of text."""
    tokenizer: str = "bytes"
    """``bytes`` (vocab 256), a local ``tokenizer.json`` or a folder holding one, or
    ``bpe:<vocab>`` (a byte-level BPE trained on the training split, saved as the run
    folder's ``tokenizer.json``); see :mod:`boost_compile.train.tokenizer`. The model's
    vocabulary follows it. ``tokens``: the tokenizer that made the ids (bytes or a
    ``tokenizer.json``), so the vocabulary and the decoding after training agree with them."""
    cache_dir: str | None = None
    """The token cache (null: ``$BOOST_COMPILE_CACHE``, else ``~/.cache/boost_compile/tokens``);
    every tokenizer but bytes goes through it."""

    def __post_init__(self) -> None:
        check_choices(self, "data")


@dataclass
class TrainerConfig:
    """``trainer=``: the loop. Steps are counted from 1; intervals in steps (0 = off; the
    last step always logs and evaluates)."""

    steps: int = 200
    """Optimizer steps of the run."""
    batch: int = 16
    """The global batch: sequences per optimizer step, split over the ``dp`` ranks. The one
    number a sweep changes; ``local_batch`` only says how a rank gets through its share."""
    local_batch: int | None = None
    """Sequences one rank runs per forward and backward (a micro-step of gradient accumulation;
    under ``pp`` the schedule splits it further into ``parallel.microbatches``). null: the rank's
    whole share, ``batch / dp``, in one pass. Otherwise ``batch / (dp * local_batch)`` micro-steps
    add up their gradients before one optimizer step (one gradient all-reduce over ``dp``): the
    step's loss and gradients are those of the whole batch, with the activations of
    ``local_batch`` sequences."""
    seq: int = 128
    """The sequence length."""
    precision: Annotated[str, Literal["fp32", "bf16-mixed", "bf16-true", "fp64"]] = "fp32"
    """fp32, bf16-mixed (autocast), bf16-true (bf16 weights) or fp64 (float64 weights and
    compute: the reference a parity check measures fp32 runs against)."""
    seed: int = 0
    """Seeds the weights and the data order (the same on every rank), and, derived per data-parallel
    replica and pipeline stage, their dropout (train/replica_streams.py)."""
    device: Annotated[str, Literal["auto", "cpu", "cuda"]] = "auto"
    """Where to train (``auto``: CUDA when there is one)."""
    threads: int | None = None
    """CPU intra-op threads per process (null: PyTorch's default; torchrun sets 1)."""
    log_every: int = 10
    """Log a step line every this many steps."""
    save_every: int = 100
    """Save a checkpoint every this many steps."""
    eval_every: int = 0
    """Evaluate every this many steps."""
    eval_batches: int | None = None
    """Val batches per evaluation (null = the whole val split)."""
    resume: Annotated[bool | str, Literal[False, True, "auto"]] = False
    """``true``: continue from the newest complete checkpoint (see ``checkpoint.resume_from``),
    an error when there is none. ``auto``: continue from it when there is one, start at step 1
    when there is none, skip one that is damaged: the setting for a command that a launcher or
    scheduler reruns after a fault (``torchrun --max-restarts``, ``sbatch --requeue``)."""
    progress: Annotated[str, Literal["auto", "bar", "lines", "none"]] = "auto"
    """A tqdm bar when stderr is a terminal (``auto``), else periodic lines."""
    plot: bool = True
    """Draw ``loss.png`` at the end."""
    memory_report: bool = False
    """Every rank writes ``memory_rank{R}.json`` into the run folder: its measured bytes of
    params, grads, optimizer state, DDP buckets, the activations its compiled graphs save per
    micro-batch (``passes=boost``; compiles skip the caches), and the peak of the last step
    (a memory profile): :mod:`boost_compile.train.memory_report`."""

    def __post_init__(self) -> None:
        check_choices(self, "trainer")

    def micro_steps(self, dp: int) -> int:
        """Forward-and-backward passes per optimizer step on each of ``dp`` ranks (1: no accumulation)."""
        return 1 if self.local_batch is None else self.batch // (dp * self.local_batch)

    def rank_batch(self, dp: int) -> int:
        """Sequences in one forward and backward on a rank: ``local_batch``, else ``batch / dp``."""
        return self.batch // dp if self.local_batch is None else self.local_batch


@dataclass
class MetricsConfig:
    """``metrics=``: what a run writes besides ``metrics.jsonl``, ``summary.json`` and the plot."""

    tensorboard: bool = False
    """Also write the metric rows as TensorBoard event files into ``<run folder>/tensorboard``
    (rank 0); needs the ``tensorboard`` package (``pip install 'boost-compile[tensorboard]'``)."""
    wandb: bool = False
    """Also log the metric rows to a Weights & Biases run (rank 0), its files in
    ``<run folder>/wandb``; needs the ``wandb`` package (``pip install 'boost-compile[wandb]'``)."""
    wandb_project: str = "boost-compile"
    """The wandb project the run goes to."""
    wandb_entity: str | None = None
    """The wandb user or team (null: the account's default entity)."""
    wandb_group: str | None = None
    """The wandb group (null: the sweep folder in a ``-m`` sweep, so its jobs show together; none
    for a single run)."""
    wandb_mode: Annotated[str | None, Literal["online", "offline", "disabled", None]] = None
    """``online``, ``offline`` (files only, ``wandb sync`` uploads them later) or ``disabled``;
    null: ``WANDB_MODE`` when set, else ``offline`` without an API key (``WANDB_API_KEY`` or a
    ``.netrc`` entry, as ``wandb login`` writes), else ``online``."""

    def __post_init__(self) -> None:
        check_choices(self, "metrics")


@dataclass
class TrainConfig:
    """The whole ``boost-train`` config (``train.yaml`` composes one option per group)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """``model=``"""
    factorize: FactorizeGroup = field(default_factory=FactorizeGroup)
    """``factorize=``"""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """``parallel=``"""
    passes: PassesConfig = field(default_factory=PassesConfig)
    """``passes=``"""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """``checkpoint=``"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """``optim=``"""
    data: DataConfig = field(default_factory=DataConfig)
    """``data=``"""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """``trainer=``"""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """``metrics=``"""


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
