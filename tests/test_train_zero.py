"""``parallel.zero=1``: the AdamW state sharded over the data-parallel ranks (ZeRO stage 1).

Two gloo ranks under torchrun (the helpers of test_train.py), the tiny preset,
the boost backend with aot_eager. Sharding the optimizer state changes where it
lives, not what it computes: the losses equal plain DDP's and the one-process
run's, the largest rank holds about half of DDP's optimizer state, and a
checkpoint (each rank saving its share) resumes exactly, with ZeRO or in one
process.
"""

from __future__ import annotations

import pytest
from test_train import FAST, _torchrun, cfg_of

from boost_compile.config import ConfigError
from boost_compile.train import run
from boost_compile.train.config import validate

BASE = (*FAST, "model=tiny", "passes=boost_aot_eager", "trainer.save_every=3", "parallel.dp=2")


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


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    return _torchrun(2, list(BASE), out)


def test_zero1_matches_ddp_with_half_the_optimizer_state(ddp, tmp_path):
    zero = _torchrun(2, [*BASE, "parallel.zero=1"], tmp_path / "zero")
    assert zero["losses"] == pytest.approx(ddp["losses"], rel=1e-6)
    single = run(cfg_of(*BASE[:-1], "checkpoint.enabled=false"), tmp_path / "one")
    assert zero["losses"] == pytest.approx(single["losses"], abs=2e-4, rel=0)
    mine, theirs = zero["state_mib"], ddp["state_mib"]
    print(f"per rank, MiB: DDP {theirs}; ZeRO-1 {mine}")
    assert mine["params"] == theirs["params"] and mine["grads"] == theirs["grads"]
    # AdamW keeps two fp32 moments per parameter (and a step count): DDP's is about 2x the parameters
    assert theirs["optimizer"] == pytest.approx(2 * theirs["params"], rel=0.01)
    # ZeRO-1 over 2 ranks: the larger share is at most 60% of the whole (parameters are not split)
    assert 0.4 * theirs["optimizer"] <= mine["optimizer"] <= 0.6 * theirs["optimizer"]


def test_zero1_checkpoint_resumes_exactly(tmp_path):
    """Each rank saves the state of its own share; resumed with ZeRO (the shares rebuilt) or in
    one process (every share read), steps 4-6 are the uninterrupted run's."""
    straight = _torchrun(2, [*BASE, "parallel.zero=1"], tmp_path / "a")
    checkpoint = tmp_path / "a" / "checkpoints" / "step_000003"
    resume = ("trainer.resume=true", f"checkpoint.resume_from={checkpoint}")
    resumed = _torchrun(2, [*BASE, "parallel.zero=1", *resume], tmp_path / "b")
    assert resumed["start_step"] == 3
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], abs=1e-6, rel=0)
    single = run(cfg_of(*BASE[:-1], *resume), tmp_path / "c")
    assert single["losses"] == pytest.approx(straight["losses"][3:], abs=2e-4, rel=0)


def test_zero1_with_tensor_parallelism(ddp, tmp_path):
    """TP2 x DP2 with zero=1: each TP rank's shards have their AdamW state split over its dp pair."""
    run4 = _torchrun(4, [*BASE, "parallel.tp=2", "parallel.zero=1", "checkpoint.enabled=false"], tmp_path / "tpdp")
    assert run4["world"] == 4
    assert run4["losses"] == pytest.approx(ddp["losses"], abs=2e-4, rel=0)
    # a TP2 rank holds half the block weights, and ZeRO-1 half of their state on each dp rank
    assert run4["state_mib"]["optimizer"] < 0.35 * ddp["state_mib"]["optimizer"]
