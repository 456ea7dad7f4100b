"""Gradient accumulation in one process (``trainer.local_batch``): a global batch of 16 run as 4
micro-steps of 4 follows the whole-batch eager runs (fp32 and fp64) under the parity rule, with
the compiled step reused across micro-steps, and a local batch that cannot work is refused
before any step. The layouts (DP2, TP2 x DP2 with ZeRO-1, PP2) are checked in tests/distributed.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FAST, assert_train_parity, cfg_of, train_references

from boost_compile.config import ConfigError
from boost_compile.train import run
from boost_compile.train.validate import validate

BATCH16 = (*FAST, "model=tiny", "trainer.steps=3", "trainer.batch=16", "trainer.eval_every=0")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return train_references(BATCH16, tmp_path_factory.mktemp("references"))


def compiled_graphs(overrides, folder) -> tuple[dict, int]:
    """A boost run's summary and the number of Dynamo graphs it compiled."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    torch._dynamo.reset()
    summary = run(cfg_of(*overrides), folder)
    return summary, counters["stats"]["unique_graphs"]


def test_four_micro_steps_match_the_whole_batch(references, tmp_path):
    boost = (*BATCH16, "passes=boost_aot_eager", "checkpoint.enabled=false")
    accumulated, graphs = compiled_graphs((*boost, "trainer.local_batch=4"), tmp_path / "acc")
    assert accumulated["steps"] == 3
    assert_train_parity(accumulated, references, "16 as 4 micro-steps of 4")
    # the micro-steps reuse the compiled step: as many graphs as the run without accumulation
    _, whole_graphs = compiled_graphs(boost, tmp_path / "whole")
    assert graphs == whole_graphs >= 1


def test_eager_accumulation_with_evaluation(references, tmp_path):
    """passes=none, the val loss over batches of 16 computed in slices of 4 (weighted by rows)."""
    accumulated = run(cfg_of(*BATCH16, "passes=none", "checkpoint.enabled=false", "trainer.local_batch=4"), tmp_path)
    assert accumulated["val_loss"] is not None
    assert_train_parity(accumulated, references, "eager, 16 as 4 x 4, val in slices")


@pytest.mark.parametrize(("world", "overrides", "message"), [
    (1, ("trainer.batch=16", "trainer.local_batch=3"), r"trainer.local_batch=3 must divide each rank's share .*= 16\)"),
    (2, ("trainer.batch=16", "parallel=dp2", "trainer.local_batch=3"), r"trainer.local_batch=3 must divide .*= 8\)"),
    (1, ("trainer.local_batch=0",), r"trainer.local_batch must be > 0, got 0"),
    (2, ("trainer.batch=16", "trainer.local_batch=2", "parallel.pp=2", "parallel.microbatches=4"),
     r"the per-rank batch of a step \(trainer.local_batch=2\) must be divisible by parallel.microbatches=4"),
])
def test_a_local_batch_that_cannot_work_is_refused(world, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_of(*FAST, "model=tiny", *overrides), world_size=world)


def test_parallel_auto_accumulates_when_memory_binds(tmp_path, caplog):
    """Without the boost backend no checkpoint mode is on offer: under a memory cap below the
    whole batch's, the planner's layout accumulates, and the run takes it."""
    from boost_compile.train.auto_layout import choose_layout
    from boost_compile.train.validate import to_train_config

    base = (*FAST, "model=tiny", "passes=none", "parallel=auto", "checkpoint.enabled=false", "trainer.steps=2",
            "trainer.batch=8", "trainer.seq=64")
    _, rows = choose_layout(to_train_config(cfg_of(*base)), world=1, device_type="cpu")
    whole = next(r for r in rows if r.layout.local_batch is None)
    cap = f"parallel.memory_gib={whole.memory_gib * 0.999}"
    with caplog.at_level("INFO", logger="boost_compile.train"):
        summary = run(cfg_of(*base, cap), tmp_path)
    assert summary["status"] == "completed"
    chosen = next(line for line in caplog.text.splitlines() if "parallel=auto: chose" in line)
    assert " local" in chosen, chosen
