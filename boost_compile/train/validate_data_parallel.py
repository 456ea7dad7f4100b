"""The data-parallel layouts' checks of :func:`~boost_compile.train.validate.validate`: FSDP2
(``parallel.dp_shard``) and expert parallelism (``parallel.ep``), what each composes with in this
build, refused in one line that names the fix."""

from __future__ import annotations

from typing import Any

from boost_compile.config import ConfigError
from boost_compile.train.config import TrainConfig


def check_fsdp(tc: TrainConfig) -> None:
    """``parallel.dp_shard > 1`` (FSDP2): what it composes with in this build."""
    par = tc.parallel
    if par.dp_shard == 1:
        return
    if par.pp > 1 and par.pp_schedule == "zero_bubble":
        raise ConfigError(
            "parallel.pp_schedule=zero_bubble computes each stage's weight gradients apart from its input gradients, "
            "and FSDP2 (parallel.dp_shard > 1) then reduces other gradients than the whole model's (measured: wrong "
            "gradients from the first step); use pp_schedule=1f1b, gpipe or interleaved_1f1b with FSDP2"
        )
    if par.tp > 1 and par.plan == "vanilla":
        raise ConfigError("parallel.dp_shard > 1 (FSDP2) shards btp's and megatron's TP shards; parallel.plan=vanilla's "
                          "DTensor parameters are not supported with it: use plan=btp or megatron")
    if par.zero:
        raise ConfigError(
            "parallel.zero=1 shards the optimizer state over the DDP replicas, and parallel.dp_shard > 1 (FSDP2) "
            "already shards it with the weights and gradients; set parallel.zero=0"
        )
    if tc.passes.backend != "none" and tc.passes.unit != "block":
        raise ConfigError(
            f"parallel.dp_shard={par.dp_shard} (FSDP2) shards the model block by block around blocks compiled one "
            "by one; use passes.unit=block (got passes.unit=model)"
        )
    # trainer.memory_report runs here with the blocks compiled one by one (train/parallel.py compiles_per_block)


def check_ep(tc: TrainConfig, shape: Any = None) -> None:
    """``parallel.ep > 1``: the experts sharded over groups of ep DDP ranks (and TP on the rest), and what it
    composes with yet. ``shape``: validate's ModelShape of the model (None: not known yet)."""
    par = tc.parallel
    if par.ep < 1:
        raise ConfigError(f"parallel.ep must be > 0, got {par.ep}")
    if par.ep == 1:
        return
    if par.zero:
        raise ConfigError(f"parallel.ep={par.ep} shards the experts over data-parallel ranks (DDP or FSDP2 / HSDP, with "
                          "TP and pipeline stages or not) for now: not with parallel.zero=1; use parallel.ep=1 with it")
    if par.data_ranks % par.ep:
        data = f"parallel.dp={par.dp}" + (f" x dp_shard={par.dp_shard}" if par.dp_shard > 1 else "")
        raise ConfigError(f"parallel.ep={par.ep} shards the experts over groups of ep data-parallel ranks: it must divide "
                          f"the {par.data_ranks} of {data}")
    reference = shape.llama_config if shape is not None else None
    if tc.model.hf_path is None and tc.model.hf_config is None and not getattr(reference, "n_experts", 0):
        raise ConfigError(f"parallel.ep={par.ep} shards mixture-of-experts layers, and preset {tc.model.preset!r} has none; "
                          "use an MoE preset (model=tiny-moe, or model.overrides.n_experts=N) or a Hugging Face MoE "
                          "(model=hf with hf_path, or hf_config with a model_type such as qwen3_moe)")
