"""``parallel=auto``: the layout planner's choice, put into the config before it is validated.

:func:`choose_layout` runs :func:`boost_compile.plan.search` for the processes the
launcher started (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` per node), the model and the
global batch of the config, the hardware file (``parallel.hardware``) and the memory
per device, logs the best rows and the choice, and returns the config with the
chosen ``parallel.*`` fields (``dp_shard`` and ``reshard_after_forward`` for FSDP2, whose
layouts it leaves out where boost-train would refuse them: :func:`fsdp_allowed`; ``ep`` for
expert parallelism of a mixture of experts, under DDP or FSDP2, likewise: :func:`ep_allowed`) and
``passes.options.checkpoint``. boost-train then validates it like any other.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from boost_compile.config import ConfigError
from boost_compile.plan.cli import table
from boost_compile.plan.model import ModelSpec, factorized, from_hf_config, from_preset
from boost_compile.plan.search import CHECKPOINTS, Job, PlanError, Row, best, search, usable_memory
from boost_compile.train.config import TrainConfig

log = logging.getLogger("boost_compile.train")

#: CUDA device names -> the bundled hardware file
CUDA_HARDWARE = {"H200": "h200", "A100": "a100-80gb-nvlink"}


def default_hardware(device_type: str) -> str:
    """``cpu`` on CPU; on CUDA the bundled file named by the device, else a ConfigError asking for one."""
    if device_type != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name()
    for key, hardware in CUDA_HARDWARE.items():
        if key in name:
            return hardware
    raise ConfigError(f"parallel=auto: no bundled hardware file for {name!r}; set parallel.hardware to a file's path")


def planned_vocab(tc: TrainConfig, model_vocab: int) -> int:
    """The vocabulary the run will train with: the tokenizer's (padded), as boost-train fits it."""
    from boost_compile.train.tokenizer import BYTE_VOCAB, BYTES, padded_vocab, parse_spec

    if "vocab_size" in tc.model.overrides or tc.model.pretrained:
        return model_vocab
    kind, value = parse_spec(tc.data.tokenizer)
    if kind == BYTES:
        return padded_vocab(BYTE_VOCAB)
    if kind == "bpe":
        return padded_vocab(int(value))
    return model_vocab  # a tokenizer file: its size is known once loaded; the model's is the estimate


def model_spec(tc: TrainConfig) -> ModelSpec:
    """The planner's view of ``model=`` (and ``factorize=``)."""
    m = tc.model
    try:
        if m.hf_path:  # it names the model whatever the preset (model_shape's order)
            spec = from_hf_config(m.hf_path)
        elif m.preset:
            spec = from_preset(m.preset, **{k: v for k, v in m.overrides.items() if k != "vocab_size"})
        elif m.hf_config:
            spec = from_hf_config(dict(m.hf_config))
        else:
            raise ConfigError("parallel=auto needs model.preset, model.hf_path or model.hf_config")
    except (ValueError, OSError) as exc:  # a model the planner cannot price: say so, name the way out
        raise ConfigError(f"parallel=auto: {exc}; give the layout instead (parallel=tp2, parallel.dp=..., ...)") from exc
    spec = spec.with_vocab(planned_vocab(tc, int(m.overrides.get("vocab_size", spec.vocab_size))))
    f = tc.factorize
    if f.enabled:
        if f.rank is not None:
            rank = f.rank
        elif f.rank_ratio is not None:
            rank = max(1, int(f.rank_ratio * spec.dim))
        else:
            raise ConfigError("parallel=auto plans factorize.rank or factorize.rank_ratio; with param_ratio give the layout")
        spec = factorized(spec, rank, "cola" if f.activation else "lowrank")
    return spec


def fsdp_allowed(tc: TrainConfig) -> bool:
    """Whether boost-train runs FSDP2 with the rest of ``tc``: blocks compiled one by one (a memory report
    keeps them so under FSDP2)."""
    return tc.passes.backend == "none" or tc.passes.unit == "block"


def ep_allowed(tc: TrainConfig, spec: ModelSpec, dp_shard: int = 1) -> bool:
    """Whether boost-train runs expert parallelism for ``tc``'s model (``spec``, a mixture of experts):
    its ``check_ep`` accepts an EP2 layout of it, over two DDP ranks or (``dp_shard=2``) two FSDP2
    ranks. A preset's experts are read off the built model there, here off ``spec``."""
    from boost_compile.train.validate import check_ep

    if not spec.moe:
        return False
    probe = dataclasses.replace(tc.parallel, ep=2, dp=2 // dp_shard, tp=1, pp=1, dp_shard=dp_shard, zero=0)
    try:
        check_ep(dataclasses.replace(tc, parallel=probe))
    except ConfigError:
        return tc.model.hf_path is None and tc.model.hf_config is None  # a preset whose config has n_experts
    return True


def choose_layout(tc: TrainConfig, world: int | None = None, per_node: int | None = None,
                  device_type: str | None = None) -> tuple[TrainConfig, list[Row]]:
    """``tc`` with the planner's layout for ``world`` processes (default: the launcher's)."""
    import torch

    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    per_node = per_node or int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if device_type is None:
        device_type = tc.trainer.device if tc.trainer.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    from boost_compile.costmodel.hardware import load_hardware

    par = tc.parallel
    try:
        hw = load_hardware(par.hardware or default_hardware(device_type))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"parallel.hardware={par.hardware!r}: {exc}") from exc
    try:
        memory = usable_memory(hw, par.memory_gib)
    except ValueError as exc:
        raise ConfigError(f"parallel=auto: {exc} (parallel.memory_gib)") from exc
    spec = model_spec(tc)
    job = Job(spec, tc.trainer.batch, tc.trainer.seq, world, per_node, hw, memory, tc.trainer.precision)
    boost = tc.passes.backend == "boost"
    asked = tc.passes.options.get("checkpoint") if boost else None
    checkpoints = (asked,) if asked in CHECKPOINTS else (CHECKPOINTS if boost else ("none",))
    ep = ep_allowed(tc, spec)
    rows = search(job, checkpoints=checkpoints, local_batch=tc.trainer.local_batch, fsdp=fsdp_allowed(tc), ep=ep)
    if ep and not ep_allowed(tc, spec, dp_shard=2):  # EP under FSDP2 / HSDP refused: only EP with DDP
        rows = [r for r in rows if r.layout.ep == 1 or r.layout.dp_shard == 1]
    if not boost:  # btp and megatron insert their collectives in the boost backend
        rows = [r for r in rows if r.layout.tp == 1]
    try:
        choice = best(rows, job).layout
    except PlanError as exc:
        raise ConfigError(f"parallel=auto: {exc}") from exc
    log.info("parallel=auto: the planner's best layouts\n%s", table(rows, job, 5))
    log.info("parallel=auto: chose %s (predicted step %.3f s)", choice.label(), next(r.step_s for r in rows if r.layout == choice))
    parallel = dataclasses.replace(
        par, layout="manual", tp=choice.tp, pp=choice.pp, dp=choice.dp, zero=choice.zero, plan=choice.plan if choice.tp > 1 else par.plan,
        dp_shard=choice.dp_shard, reshard_after_forward=choice.reshard_after_forward, ep=choice.ep,
        microbatches=choice.microbatches if choice.pp > 1 else None, pp_schedule=choice.schedule,
        stages_per_rank=choice.stages_per_rank, layers_per_stage=None,
    )
    options: dict[str, Any] = dict(tc.passes.options)
    if boost:
        options["checkpoint"] = choice.checkpoint
    trainer = dataclasses.replace(tc.trainer, local_batch=choice.local_batch)  # gradient accumulation when memory binds
    return dataclasses.replace(tc, parallel=parallel, trainer=trainer,
                               passes=dataclasses.replace(tc.passes, options=options)), rows
