"""boost-train's parallel layouts refused or accepted before anything starts: pipeline
parallelism (parallel.pp, schedules, micro-batches, layers per stage) and ZeRO-1
(parallel.zero). The runs themselves are in tests/distributed/."""

from __future__ import annotations

import pytest
from conftest import cfg_of

from boost_compile.config import ConfigError
from boost_compile.train.validate import validate

FOUR_LAYERS = "+model.overrides.n_layers=4"


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["parallel.pp=2", "parallel.tp=2", "parallel.plan=vanilla"], 4,
         r"parallel.pp with parallel.tp > 1 takes parallel.plan=btp or megatron"),
        (["parallel.pp=2", "parallel.tp=2"], 2, r"parallel pp=2 x dp=1 x tp=2 = 4 ranks, but 2 processes were started"),
        (["parallel.pp=2"], 4, r"parallel pp=2 x dp=1 x tp=1 = 2 ranks, but 4 processes were started"),
        (["parallel.pp=2"], 1, r"needs 2 processes, but this is a single process; launch with: torchrun "
                               r"--nproc-per-node 2 .* parallel.pp=2"),
        (["parallel.pp=4"], 4, r"4 pipeline stages, but the model has 2 blocks: every stage needs at least one block"),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.stages_per_rank=2"], 2,
         r"4 pipeline stages, but the model has 2 blocks"),
        (["parallel.pp=2", "parallel.microbatches=3"], 2,
         r"per-rank batch of a step \(trainer.batch=16 / parallel.dp=1 = 16\) must be divisible by parallel.microbatches=3"),
        (["parallel.pp=2", "parallel.dp=2", "trainer.batch=6"], 4,
         r"per-rank batch of a step \(trainer.batch=6 / parallel.dp=2 = 3\) must be divisible by parallel.microbatches=2"),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], 2,
         r"interleaved_1f1b interleaves several stages per rank: set parallel.stages_per_rank >= 2"),
        (["parallel.pp=2", "parallel.stages_per_rank=2", FOUR_LAYERS], 2,
         r"pp_schedule=1f1b runs one stage per rank, got parallel.stages_per_rank=2"),
        (["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.stages_per_rank=2", FOUR_LAYERS], 2,
         r"zero_bubble .* compiled stage \(passes.backend=boost"),
        (["parallel.pp=2", "+model.overrides.tie_embeddings=true"], 2, r"tied to its embedding \(tie_embeddings\)"),
        (["parallel.pp=2", "parallel.microbatches=1"], 2, r"1f1b needs at least as many micro-batches as stages"),
        (["parallel.pp=2", "parallel.pp_schedule=pipedream"], 2, r"parallel.pp_schedule='pipedream' is not valid"),
        (["parallel.microbatches=2"], 1, r"configure pipeline parallelism; set parallel.pp > 1"),
        (["parallel.pp=0"], 1, r"parallel.pp must be > 0"),
        (["parallel.pp=2", "parallel.layers_per_stage=[1,2]"], 2,
         r"parallel.layers_per_stage=\[1, 2\] must give each of the 2 stages .* at least one block, 2 blocks in all"),
        (["parallel.layers_per_stage=[1,1]"], 1, r"set parallel.pp > 1"),
        (["parallel.pp=2", "model=tiny-lax"], 2,
         r"parallel.pp=2: preset 'tiny-lax' is a LaX model.*pipeline stages pass only the residual stream"),
        (["parallel.pp=2", "model=hf-tiny", "model.hf_config.model_type=gpt2"], 2,
         r"pipeline stages of Hugging Face model_type 'gpt2' are not supported"),
    ],
)
def test_pipeline_config_refusals(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_of(*overrides), world_size=world)

@pytest.mark.parametrize(
    ("overrides", "world"),
    [
        (["parallel.pp=2"], 2),
        (["parallel.pp=2", "parallel.tp=2"], 4),
        (["parallel.pp=2", "parallel.dp=2", "parallel.pp_schedule=gpipe"], 4),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.stages_per_rank=2", FOUR_LAYERS], 2),
        (["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.stages_per_rank=2", FOUR_LAYERS,
          "passes=none"], 2),
    ],
)
def test_pipeline_configs_that_validate(overrides, world):
    tc, _ = validate(cfg_of(*overrides), world_size=world)
    assert tc.parallel.pp == 2 and tc.parallel.n_microbatches == 2


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["parallel.zero=1"], 1, r"parallel.zero=1 shards the optimizer state over the data-parallel ranks, and "
                                 r"parallel.dp=1 has one"),
        (["parallel.zero=2", "parallel.dp=2"], 2, r"parallel.zero=2: 0 \(no sharding\) or 1"),
    ],
)
def test_zero_refusals(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_of(*overrides), world_size=world)


def test_ddp_bucket_size_is_a_setting(tmp_path):
    """parallel.bucket_mb reaches DDP's bucket_cap_mb; a size that is not positive is refused."""
    import torch
    import torch.distributed as dist

    from boost_compile.config import ConfigError
    from boost_compile.train.config import ParallelConfig
    from boost_compile.train.parallel import Dist, wrap_data_parallel

    assert ParallelConfig().bucket_mb == 25.0  # DDP's own default
    with pytest.raises(ConfigError, match="parallel.bucket_mb=0"):
        ParallelConfig(bucket_mb=0)
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        dev = Dist(world=1, rank=0, dp=2, tp=1, device=torch.device("cpu"))  # dp > 1: DDP wraps it
        ddp = wrap_data_parallel(model, model, dev, bucket_mb=0.5)
        assert ddp.bucket_bytes_cap == 512 * 1024
    finally:
        dist.destroy_process_group()
