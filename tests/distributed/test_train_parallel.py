"""boost-train on several processes (torchrun on 127.0.0.1, gloo) against one process: data
parallelism (DP2), tensor parallelism (TP2, btp) and ZeRO-1 (``parallel.zero=1``, the AdamW
state sharded over the dp ranks, alone and under TP2 x DP2).

Every run's per-step losses, gradient norms and val loss follow the parity rule (conftest)
against one-process eager runs of the same config in fp32 and fp64. Sharding the optimizer
state changes where it lives, not what it computes: the largest rank holds about half of
DDP's optimizer state. A checkpoint resumes in the same layout exactly (the same computation
on the same weights), and in one process within the parity rule.
"""

from __future__ import annotations

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

from boost_compile.config import ConfigError
from boost_compile.train import find_checkpoint, run
from boost_compile.train.validate import tp_available, validate

ONE = (*FAST, "model=tiny", "passes=boost_aot_eager", "trainer.save_every=3")
DP2 = (*ONE, "parallel=dp2")
#: DP2 with zero=1, and low-rank checkpointing: each block compiled on its own, DDP's bucket cuts
#: off (train/parallel.py ddp_compile_settings), which must not change what it computes; and
#: gradient accumulation: each rank's 2 sequences as 2 micro-steps of 1 (trainer.local_batch)
ZERO = (*DP2, "parallel.zero=1", "++passes.options.checkpoint=lowrank", "trainer.local_batch=1")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return train_references((*FAST, "model=tiny"), tmp_path_factory.mktemp("references"))


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """DP2 (DDP), checkpoints at steps 0 (the starting weights), 3 and 6."""
    return torchrun(2, [*DP2, *AT_START], tmp_path_factory.mktemp("ddp") / "run")


@pytest.fixture(scope="module")
def zero(tmp_path_factory):
    """DP2 with zero=1 and checkpoint=lowrank, checkpoints at steps 3 and 6."""
    return torchrun(2, list(ZERO), tmp_path_factory.mktemp("zero") / "run")


def test_dp2_matches_single_process(ddp, references):
    """Two gloo ranks with half of the same global batch each follow the single-process losses."""
    assert ddp["world"] == 2 and ddp["steps"] == 6
    assert_train_parity(ddp, references, "dp2")
    assert "compiled 2 blocks one by one" in (Path(ddp["run_dir"]) / "train.log").read_text()  # passes.unit=block
    # one DCP checkpoint, written by both ranks
    checkpoint = find_checkpoint(Path(ddp["run_dir"]) / "checkpoints")
    assert checkpoint.name == "step_000006"
    # each replica draws its own random numbers (its own dropout masks): two generator states
    states = rng_states(checkpoint)
    assert sorted(states) == [0, 1] and not torch.equal(states[0], states[1])
    # both replicas built on meta and materialised by the per-parameter scheme: one process's weights
    assert assert_starts_like_one_process(Path(ddp["run_dir"])) == TINY_TENSORS


@pytest.mark.extended
def test_dp2_whole_model_matches_single_process(references, tmp_path):
    """passes.unit=model with low-rank checkpointing: the whole model as one graph under DDP (no
    bucket cuts, the all-reduces after the backward) computes the same steps, its 2 sequences a
    rank as 2 micro-steps of gradient accumulation."""
    run_ = torchrun(2, [*DP2, "passes.unit=model", "++passes.options.checkpoint=lowrank", "trainer.save_every=0",
                        "trainer.local_batch=1"], tmp_path / "whole")
    assert run_["world"] == 2 and run_["steps"] == 6
    assert_train_parity(run_, references, "dp2 whole model")
    assert "one by one" not in (tmp_path / "whole" / "train.log").read_text()


def test_tp2_matches_single_process_and_resumes(references, tmp_path):
    if not tp_available():
        with pytest.raises(ConfigError, match="tensor parallelism is not available in this build"):
            validate(cfg_of("parallel=tp2"), world_size=2)
        pytest.skip("boost_compile.parallelize_ is not in this build (checked the error instead)")
    tp2 = torchrun(2, [*ONE, "parallel=tp2", *AT_START], tmp_path / "tp2")
    assert_train_parity(tp2, references, "tp2")
    assert assert_starts_like_one_process(tmp_path / "tp2") == TINY_TENSORS
    # the sharded checkpoint of step 3 (one DTensor shard per rank) resumes exactly
    checkpoint = tmp_path / "tp2" / "checkpoints" / "step_000003"
    resumed = torchrun(
        2, [*ONE, "parallel=tp2", "trainer.resume=true", f"checkpoint.resume_from={checkpoint}"],
        tmp_path / "tp2b",
    )
    assert resumed["losses"] == pytest.approx(tp2["losses"][3:], abs=1e-6, rel=0)
    # the two TP ranks of one replica draw from one stream (one mask for a replicated activation)
    states = rng_states(checkpoint)
    assert sorted(states) == [0, 1] and torch.equal(states[0], states[1])


@pytest.mark.extended
def test_zero1_matches_ddp_with_half_the_optimizer_state(ddp, zero, references):
    assert_train_parity(zero, references, "dp2, zero=1, checkpoint=lowrank")
    mine, theirs = zero["state_mib"], ddp["state_mib"]
    print(f"per rank, MiB: DDP {theirs}; ZeRO-1 {mine}")
    assert mine["params"] == theirs["params"] and mine["grads"] == theirs["grads"]
    # AdamW keeps two fp32 moments per parameter (and a step count): DDP's is about 2x the parameters
    assert theirs["optimizer"] == pytest.approx(2 * theirs["params"], rel=0.01)
    # ZeRO-1 over 2 ranks: the larger share is at most 60% of the whole (parameters are not split)
    assert 0.4 * theirs["optimizer"] <= mine["optimizer"] <= 0.6 * theirs["optimizer"]


@pytest.mark.extended
def test_zero1_checkpoint_resumes_exactly(zero, references, tmp_path):
    """Each rank saves the state of its own share; resumed with ZeRO (the shares rebuilt) steps
    4-6 are the uninterrupted run's; in one process (every share read), within the parity rule."""
    checkpoint = Path(zero["run_dir"]) / "checkpoints" / "step_000003"
    resume = ("trainer.resume=true", f"checkpoint.resume_from={checkpoint}")
    resumed = torchrun(2, [*ZERO, *resume], tmp_path / "b")
    assert resumed["start_step"] == 3
    assert resumed["losses"] == pytest.approx(zero["losses"][3:], abs=1e-6, rel=0)
    single = run(cfg_of(*ONE, *resume), tmp_path / "c")
    assert_train_parity(single, references, "one process from the zero=1 checkpoint", first=3)


@pytest.mark.extended
def test_zero1_with_tensor_parallelism(ddp, references, tmp_path):
    """TP2 x DP2 with zero=1: each TP rank's shards have their AdamW state split over its dp pair;
    each rank's 2 sequences as 2 micro-steps of gradient accumulation (the TP graph traced and
    compiled for one sequence, reused)."""
    run4 = torchrun(4, [*ONE, "parallel.dp=2", "parallel.tp=2", "parallel.zero=1", "checkpoint.enabled=false",
                        "trainer.local_batch=1"], tmp_path / "tpdp")
    assert run4["world"] == 4
    assert_train_parity(run4, references, "tp2 x dp2, zero=1")
    # a TP2 rank holds half the block weights, and ZeRO-1 half of their state on each dp rank
    assert run4["state_mib"]["optimizer"] < 0.35 * ddp["state_mib"]["optimizer"]
