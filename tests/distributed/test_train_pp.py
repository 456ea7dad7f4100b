"""boost-train with pipeline parallelism (``parallel.pp > 1``) against one process.

The runs are torchrun on 127.0.0.1 with gloo (conftest.torchrun), the tiny preset,
4 x 32 bytes per step, the boost backend with aot_eager. Each run's per-step losses,
gradient norms and val loss follow the parity rule (conftest) against one-process eager
runs of the same config in fp32 and fp64, made in this process. A checkpoint resumes in
the same layout exactly (the same computation on the same weights), and in one process
within the parity rule.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import (
    AT_START,
    FAST,
    TINY_TENSORS,
    assert_starts_like_one_process,
    assert_train_parity,
    cfg_of,
    rng_states,
    torchrun,
    train_references,
)

from boost_compile.train import find_checkpoint, run

BASE = (*FAST, "model=tiny", "passes=boost_aot_eager", "checkpoint.enabled=false")
FOUR_LAYERS = "+model.overrides.n_layers=4"
CKPT10 = ("checkpoint.enabled=true", "trainer.save_every=10", "trainer.steps=20")


@pytest.fixture(scope="module")
def references20(tmp_path_factory):
    """One process, eager, 20 steps of the tiny model (val loss at the end): fp32 and fp64."""
    return train_references((*FAST, "model=tiny", "trainer.steps=20"), tmp_path_factory.mktemp("ref20"))


@pytest.fixture(scope="module")
def references4l(tmp_path_factory):
    """One process, eager, 4 steps of a 4-block tiny model: fp32 and fp64."""
    return train_references((*FAST, "model=tiny", FOUR_LAYERS, "trainer.steps=4"), tmp_path_factory.mktemp("ref4l"))


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    """PP2, 1F1B with 4 micro-batches, 20 steps, a checkpoint at step 10."""
    out = tmp_path_factory.mktemp("pp2") / "run"
    return torchrun(2, [*BASE, *CKPT10, *AT_START, "parallel.pp=2", "parallel.microbatches=4"], out)


def test_pp2_1f1b_matches_single_process(pp2, references20):
    assert pp2["world"] == 2 and pp2["steps"] == 20
    # gradient clipping saw the global norm of both stages: the norms are checked too
    assert_train_parity(pp2, references20, "pp2 1f1b")
    # each rank built the model on meta and materialised its own stage: one process's weights
    assert "materialised" in (Path(pp2["run_dir"]) / "train.log").read_text()
    assert assert_starts_like_one_process(Path(pp2["run_dir"])) == TINY_TENSORS


@pytest.mark.extended
def test_pp2_interleaved_1f1b_matches_single_process(references4l, tmp_path):
    pp = torchrun(2, [*BASE, FOUR_LAYERS, "trainer.steps=4", "parallel.pp=2", "parallel.microbatches=4",
                      "parallel.pp_schedule=interleaved_1f1b", "parallel.stages_per_rank=2"], tmp_path / "ppi")
    assert_train_parity(pp, references4l, "pp2 interleaved_1f1b (4 stages)")


@pytest.mark.extended
def test_pp2_gradient_accumulation_matches_single_process(references4l, tmp_path):
    """PP2 1F1B: each step's 4 sequences as 2 micro-steps of 2 (trainer.local_batch), each split
    into 2 pipeline micro-batches; the gradients add up over both schedule runs."""
    pp = torchrun(2, [*BASE, FOUR_LAYERS, "trainer.steps=4", "parallel.pp=2", "parallel.microbatches=2",
                      "trainer.local_batch=2"], tmp_path / "ppacc")
    assert pp["world"] == 2 and pp["steps"] == 4
    assert_train_parity(pp, references4l, "pp2 1f1b, 2 micro-steps of 2")


@pytest.mark.extended
def test_pp2_dp2_zero1_matches_single_process(references4l, tmp_path):
    """PP2 x DP2, the optimizer state of each stage sharded over its dp pair (parallel.zero=1), the
    blocks cut unevenly by hand (1 + 3); each stage's gradients averaged over dp in buckets of 16 KiB,
    issued during the schedule's backward from the second step on (train/dp_buckets.py)."""
    pp = torchrun(4, [*BASE, FOUR_LAYERS, "trainer.steps=4", "parallel.pp=2", "parallel.dp=2", "parallel.zero=1",
                      "parallel.layers_per_stage=[1,3]", "parallel.bucket_mb=0.015625"], tmp_path / "ppdp")
    assert pp["world"] == 4
    log = (tmp_path / "ppdp" / "train.log").read_text()
    assert "pipeline stage 0/2 on pp rank 0: blocks [0] + embedding" in log
    issued = re.search(r"gradient average over dp: (\d+) of (\d+) buckets issued during the backward", log)
    assert issued and int(issued[1]) == int(issued[2]) >= 2, log[-3000:]
    assert_train_parity(pp, references4l, "pp2 x dp2, zero=1")


@pytest.mark.extended
def test_pp2_checkpoint_resumes_exactly(pp2, references20, tmp_path):
    """Each stage saves its own parameters under the whole model's names: a pipeline run and a
    one-process run both continue from the pipeline's checkpoint as the uninterrupted run does."""
    import torch.distributed.checkpoint as dcp

    checkpoint = Path(pp2["run_dir"]) / "checkpoints" / "step_000010"
    assert find_checkpoint(checkpoint) == checkpoint
    keys = set(dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    for name in ("tok_embeddings.weight", "layers.0.attention_norm.weight", "layers.1.attention_norm.weight",
                 "norm.weight", "output.weight"):
        assert f"model.{name}" in keys and f"optim.state.{name}.exp_avg" in keys, name
        assert f"optim.param_groups.{name}.lr" in keys, name
    resume = ("trainer.resume=true", f"checkpoint.resume_from={checkpoint}")
    resumed = torchrun(2, [*BASE, *CKPT10, "parallel.pp=2", "parallel.microbatches=4", *resume], tmp_path / "b")
    assert resumed["start_step"] == 10 and resumed["steps"] == 20
    assert resumed["losses"] == pytest.approx(pp2["losses"][10:], abs=1e-6, rel=0)
    single = run(cfg_of(*BASE, *CKPT10, *resume), tmp_path / "c")  # no micro-batches in one process
    assert_train_parity(single, references20, "one process from the pp2 checkpoint", first=10)


@pytest.mark.extended  # PP2 and TP2 are each checked in make test; this product (4 ranks, 80 s) in the extended tier
def test_pp2_tp2_matches_single_process_and_resumes(references20, tmp_path):
    """PP2 x TP2 (btp stages, the stream between them d-sharded) is the one-process run: losses,
    clipped gradient norms and val loss; its checkpoint (TP shards as DTensors, each stage its own)
    resumes exactly, in the same layout and in one process."""
    import torch.distributed.checkpoint as dcp

    ckpt = (*CKPT10, "parallel.microbatches=4")
    straight = torchrun(4, [*BASE, *ckpt, "parallel.pp=2", "parallel.tp=2"], tmp_path / "a")
    assert straight["world"] == 4 and straight["steps"] == 20
    assert_train_parity(straight, references20, "pp2 x tp2 1f1b")
    checkpoint = tmp_path / "a" / "checkpoints" / "step_000010"
    meta = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    # the whole tensors, written as two TP shards each
    for name in ("layers.1.attention.q_proj.up.weight", "layers.0.mlp.down_proj.down.weight"):
        for key in (f"model.{name}", f"optim.state.{name}.exp_avg"):
            assert len(meta[key].chunks) == 2, key
    assert tuple(meta["model.layers.1.mlp.gate_proj.up.weight"].size) == (176, 16)
    # ranks 0, 1 (stage 0) draw from one stream, ranks 2, 3 (stage 1) from another: a stage's
    # dropout masks are not the stage before it's
    states = rng_states(checkpoint)
    assert torch.equal(states[0], states[1]) and torch.equal(states[2], states[3])
    assert not torch.equal(states[0], states[2])
    resume = ("trainer.resume=true", f"checkpoint.resume_from={checkpoint}")
    resumed = torchrun(4, [*BASE, *ckpt, "parallel.pp=2", "parallel.tp=2", *resume], tmp_path / "b")
    assert resumed["start_step"] == 10 and resumed["steps"] == 20
    assert resumed["losses"] == pytest.approx(straight["losses"][10:], abs=1e-6, rel=0)
    single = run(cfg_of(*BASE, *ckpt[:-1], *resume), tmp_path / "c")  # no micro-batches in one process
    assert_train_parity(single, references20, "one process from the pp2 x tp2 checkpoint", first=10)
