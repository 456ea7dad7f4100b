"""``boost-train``: Hydra training runs and sweeps for bottleneck LLMs.

    boost-train                                        # tiny CoLA model, boost backend, CPU
    boost-train model=cola-60m trainer.steps=1000 passes=inductor
    boost-train -m passes=boost,inductor factorize.rank_ratio=0.125,0.25   # a sweep
    torchrun --nproc-per-node 2 -m boost_compile.train parallel=dp2       # data parallel
    boost-train -m hydra/launcher=submitit_local hydra.launcher.tasks_per_node=2 parallel=tp2 \
        factorize.rank_ratio=0.125,0.25                                  # a sweep of TP2 jobs
    boost-train -m experiment=optuna_lr_rank                             # a search (optuna)

The config is ``hydra_conf/train.yaml`` over the schema in
:mod:`boost_compile.train.config`. Each run gets a folder (``runs/<date>/<time>``,
or ``runs/multirun/<date>/<time>/<job>`` in a sweep) with the composed config
(``.hydra/``), ``train.log``, ``metrics.jsonl`` (one JSON object per step and per
evaluation), ``loss.png``, ``summary.json`` and ``checkpoints/step_*`` (DCP). A
sweep ends with ``summary.csv`` and ``summary.md`` in its folder.

Parallelism: ``torchrun`` starts ``pp * dp * tp`` processes; they form the
DeviceMesh ``(dp, tp)``, or ``(pp, dp, tp)`` with pipeline parallelism
(``parallel.pp``, :mod:`~boost_compile.train.pipeline`). Tensor parallelism
shards the model with ``boost_compile.parallelize_`` over the ``tp`` dimension; data parallelism wraps
the compiled model in DDP over the ``dp`` dimension (README: why DDP).

One job per module:

- :mod:`~boost_compile.train.app`: the Hydra app (:func:`main`), :func:`run`, sweep summaries
- :mod:`~boost_compile.train.launchers`: jobs of Hydra's submitit launcher (ranks from its job environment), optional plugins
- :mod:`~boost_compile.train.config`: the config schema (its choices checked as it is built)
- :mod:`~boost_compile.train.validate`: the checks the schema cannot express, before anything starts
- :mod:`~boost_compile.train.data`: the corpus (``sources``), the token cache (``cache``), per-rank loaders (``packing``)
- :mod:`~boost_compile.train.tokenizer`: bytes, a local tokenizer or a trained BPE
- :mod:`~boost_compile.train.model`: building (and factorizing) the model
- :mod:`~boost_compile.train.parallel`: processes, the device mesh, tp, compile, DDP
- :mod:`~boost_compile.train.pipeline`: pipeline parallelism (``parallel.pp``): stages, step, evaluation
- :mod:`~boost_compile.train.optim`: the optimizer and learning-rate schedule
- :mod:`~boost_compile.train.step`: what both step functions share: gradient clipping, the optimizer tail
- :mod:`~boost_compile.train.loop`: the trainer: the step, evaluation, logging, checkpoints
- :mod:`~boost_compile.train.checkpoint`: DCP checkpoints, resuming, signals
- :mod:`~boost_compile.train.checkpoint_shards`: tensor-parallel shards in a layout-free checkpoint
- :mod:`~boost_compile.train.metrics`: progress, peak memory, ``metrics.jsonl``, plots
"""

from boost_compile.train.app import (
    SUMMARY_COLUMNS,
    SweepSummary,
    main,
    run,
    summary_rows,
    write_sweep_summary,
)
from boost_compile.train.checkpoint import (
    Checkpointer,
    StopOnSignal,
    checkpoint_dir,
    checkpoint_step,
    find_checkpoint,
    resume_candidates,
)
from boost_compile.train.data import load_tokens, make_loaders
from boost_compile.train.loop import Trainer, evaluate, make_train_step
from boost_compile.train.metrics import (
    METRICS_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    JsonlWriter,
    PeakMemory,
    Progress,
    plot_losses,
)
from boost_compile.train.model import HFCausalLM, build_model
from boost_compile.train.optim import lr_multiplier, make_optimizer
from boost_compile.train.parallel import (
    Dist,
    ModelParts,
    build_mesh,
    build_model_parts,
    compile_model,
    global_numel,
    is_dtensor,
    parallelize,
    setup_distributed,
    wrap_data_parallel,
)
from boost_compile.train.step import StepOutput, clip_grad_norm

__all__ = [
    "METRICS_FILE",
    "PLOT_FILE",
    "SUMMARY_COLUMNS",
    "SUMMARY_FILE",
    "Checkpointer",
    "Dist",
    "HFCausalLM",
    "JsonlWriter",
    "ModelParts",
    "PeakMemory",
    "Progress",
    "StepOutput",
    "StopOnSignal",
    "SweepSummary",
    "Trainer",
    "build_mesh",
    "build_model",
    "build_model_parts",
    "checkpoint_dir",
    "checkpoint_step",
    "clip_grad_norm",
    "compile_model",
    "evaluate",
    "find_checkpoint",
    "global_numel",
    "is_dtensor",
    "load_tokens",
    "lr_multiplier",
    "main",
    "make_loaders",
    "make_optimizer",
    "make_train_step",
    "parallelize",
    "plot_losses",
    "resume_candidates",
    "run",
    "setup_distributed",
    "summary_rows",
    "wrap_data_parallel",
    "write_sweep_summary",
]
