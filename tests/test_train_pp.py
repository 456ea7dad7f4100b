"""boost-train with pipeline parallelism (``parallel.pp > 1``) against one process.

The runs are torchrun on 127.0.0.1 with gloo (the helpers of test_train.py), the
tiny preset, 4 x 32 bytes per step, the boost backend with aot_eager; the
one-process references run in this process. fp32 losses of a pipeline run equal
the one-process run's to 1e-5 relative.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train import FAST, _torchrun, cfg_of

from boost_compile.config import ConfigError
from boost_compile.train import find_checkpoint, run
from boost_compile.train.config import validate

BASE = (*FAST, "model=tiny", "passes=boost_aot_eager", "checkpoint.enabled=false")
FOUR_LAYERS = "+model.overrides.n_layers=4"
REL = 1e-5


def grad_norms(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in rows if "grad_norm" in r]


def rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# ----------------------------------------------------------------------------- config


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
         r"per-rank batch \(trainer.batch=16 / parallel.dp=1 = 16\) must be divisible by parallel.microbatches=3"),
        (["parallel.pp=2", "parallel.dp=2", "trainer.batch=6"], 4,
         r"per-rank batch \(trainer.batch=6 / parallel.dp=2 = 3\) must be divisible by parallel.microbatches=2"),
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


# ----------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def reference20(tmp_path_factory):
    """One process, 20 steps of the tiny model (val loss at the end)."""
    return run(cfg_of(*BASE, "trainer.steps=20"), tmp_path_factory.mktemp("ref20"))


@pytest.fixture(scope="module")
def reference4l(tmp_path_factory):
    """One process, 4 steps of a 4-block tiny model."""
    return run(cfg_of(*BASE, FOUR_LAYERS, "trainer.steps=4"), tmp_path_factory.mktemp("ref4l"))


def test_pp2_1f1b_matches_single_process(reference20, tmp_path):
    pp = _torchrun(2, [*BASE, "parallel.pp=2", "parallel.microbatches=4", "trainer.steps=20"], tmp_path / "pp2")
    assert pp["world"] == 2 and pp["steps"] == 20
    diff = rel_diff(pp["losses"], reference20["losses"])
    print(f"pp2 1f1b: max relative loss difference over 20 steps {diff:.2e}")
    assert diff <= REL
    assert pp["val_loss"] == pytest.approx(reference20["val_loss"], rel=REL)
    # gradient clipping saw the global norm of both stages
    norms = [grad_norms(Path(r["run_dir"])) for r in (pp, reference20)]
    assert len(norms[0]) == 20 and norms[0] == pytest.approx(norms[1], rel=REL)


def test_pp2_interleaved_1f1b_matches_single_process(reference4l, tmp_path):
    pp = _torchrun(2, [*BASE, FOUR_LAYERS, "trainer.steps=4", "parallel.pp=2", "parallel.microbatches=4",
                       "parallel.pp_schedule=interleaved_1f1b", "parallel.stages_per_rank=2"], tmp_path / "ppi")
    diff = rel_diff(pp["losses"], reference4l["losses"])
    print(f"pp2 interleaved_1f1b (4 stages): max relative loss difference {diff:.2e}")
    assert diff <= REL
    assert pp["val_loss"] == pytest.approx(reference4l["val_loss"], rel=REL)


def test_pp2_dp2_zero1_matches_single_process(reference4l, tmp_path):
    """PP2 x DP2, the optimizer state of each stage sharded over its dp pair (parallel.zero=1), the
    blocks cut unevenly by hand (1 + 3)."""
    pp = _torchrun(4, [*BASE, FOUR_LAYERS, "trainer.steps=4", "parallel.pp=2", "parallel.dp=2", "parallel.zero=1",
                       "parallel.layers_per_stage=[1,3]"], tmp_path / "ppdp")
    assert pp["world"] == 4
    assert "pipeline stage 0/2 on pp rank 0: blocks [0] + embedding" in (tmp_path / "ppdp" / "train.log").read_text()
    diff = rel_diff(pp["losses"], reference4l["losses"])
    print(f"pp2 x dp2, zero=1: max relative loss difference {diff:.2e}")
    assert diff <= REL
    assert pp["val_loss"] == pytest.approx(reference4l["val_loss"], rel=REL)


def test_pp2_checkpoint_resumes_exactly(tmp_path):
    """Each stage saves its own parameters under the whole model's names: a pipeline run and a
    one-process run both continue from the pipeline's checkpoint as the uninterrupted run does."""
    import torch.distributed.checkpoint as dcp

    ckpt = ("checkpoint.enabled=true", "trainer.steps=6", "trainer.save_every=3")
    straight = _torchrun(2, [*BASE, *ckpt, "parallel.pp=2"], tmp_path / "a")
    checkpoint = tmp_path / "a" / "checkpoints" / "step_000003"
    assert find_checkpoint(checkpoint) == checkpoint
    keys = set(dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    for name in ("tok_embeddings.weight", "layers.0.attention_norm.weight", "layers.1.attention_norm.weight",
                 "norm.weight", "output.weight"):
        assert f"model.{name}" in keys and f"optim.state.{name}.exp_avg" in keys, name
        assert f"optim.param_groups.{name}.lr" in keys, name
    resume = ("trainer.resume=true", f"checkpoint.resume_from={checkpoint}")
    resumed = _torchrun(2, [*BASE, *ckpt, "parallel.pp=2", *resume], tmp_path / "b")
    assert resumed["start_step"] == 3 and resumed["steps"] == 6
    print(f"pp2 resumed at step 3: max relative loss difference {rel_diff(resumed['losses'], straight['losses'][3:]):.2e}")
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], abs=1e-6, rel=0)
    single = run(cfg_of(*BASE, *ckpt, *resume), tmp_path / "c")
    assert single["losses"] == pytest.approx(straight["losses"][3:], rel=REL)


def test_pp2_tp2_matches_single_process_and_resumes(reference20, tmp_path):
    """PP2 x TP2 (btp stages, the stream between them d-sharded) is the one-process run: losses,
    clipped gradient norms and val loss; its checkpoint (TP shards as DTensors, each stage its own)
    resumes exactly, in the same layout and in one process."""
    import torch.distributed.checkpoint as dcp

    ckpt = ("checkpoint.enabled=true", "trainer.save_every=10", "trainer.steps=20", "parallel.microbatches=4")
    straight = _torchrun(4, [*BASE, *ckpt, "parallel.pp=2", "parallel.tp=2"], tmp_path / "a")
    assert straight["world"] == 4 and straight["steps"] == 20
    diff = rel_diff(straight["losses"], reference20["losses"])
    print(f"pp2 x tp2 1f1b: max relative loss difference over 20 steps {diff:.2e}")
    assert diff <= REL
    assert straight["val_loss"] == pytest.approx(reference20["val_loss"], rel=REL)
    norms = [grad_norms(Path(r["run_dir"])) for r in (straight, reference20)]
    assert len(norms[0]) == 20 and norms[0] == pytest.approx(norms[1], rel=REL)
    checkpoint = tmp_path / "a" / "checkpoints" / "step_000010"
    meta = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    # the whole tensors, written as two TP shards each
    for name in ("layers.1.attention.q_proj.up.weight", "layers.0.mlp.down_proj.down.weight"):
        for key in (f"model.{name}", f"optim.state.{name}.exp_avg"):
            assert len(meta[key].chunks) == 2, key
    assert tuple(meta["model.layers.1.mlp.gate_proj.up.weight"].size) == (176, 16)
    resume = ("trainer.resume=true", f"checkpoint.resume_from={checkpoint}")
    resumed = _torchrun(4, [*BASE, *ckpt, "parallel.pp=2", "parallel.tp=2", *resume], tmp_path / "b")
    assert resumed["start_step"] == 10 and resumed["steps"] == 20
    print(f"pp2 x tp2 resumed at step 10: max relative loss difference "
          f"{rel_diff(resumed['losses'], straight['losses'][10:]):.2e}")
    assert resumed["losses"] == pytest.approx(straight["losses"][10:], abs=1e-6, rel=0)
    single = run(cfg_of(*BASE, *ckpt[:-1], *resume), tmp_path / "c")  # no micro-batches in one process
    assert single["losses"] == pytest.approx(straight["losses"][10:], rel=REL)
