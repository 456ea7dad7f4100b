"""Gradient accumulation (``trainer.local_batch``) under DDP: the micro-steps before the last run
in ``no_sync``, so a step all-reduces its gradient buckets once, as a step without accumulation
does, whatever the number of micro-steps. Counted with a DDP comm hook on boost-train's own
DP2 step (tests/workers/accumulation_worker.py); the parity of accumulated steps with whole-batch
steps is checked by the boost-train runs of test_train_parallel.py and test_train_pp.py."""

from __future__ import annotations

import pytest
from conftest import FAST

#: small buckets: the tiny model's gradients fill several, so a count per micro-step would show
BASE = (*FAST, "model=tiny", "passes=boost_aot_eager", "checkpoint.enabled=false", "parallel=dp2",
        "trainer.batch=16", "parallel.bucket_mb=0.05")
SCENARIOS = [
    {"name": "whole", "overrides": BASE, "steps": 2},
    {"name": "accumulate4", "overrides": (*BASE, "trainer.local_batch=2"), "steps": 2},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from accumulation_worker import worker
    from scenario_runner import spawn_scenarios

    return spawn_scenarios(worker, 2, SCENARIOS, tmp_path_factory.mktemp("accumulation"))


def test_one_gradient_reduction_per_step(results):
    for rank in results:
        whole, accumulated = rank["whole"], rank["accumulate4"]
        assert "error" not in whole and "error" not in accumulated, (whole.get("error"), accumulated.get("error"))
        assert accumulated["micro_steps"] == 4 and whole["micro_steps"] == 1
        # several buckets once DDP has rebuilt them after its first step: a reduction per micro-step would be 4x
        assert whole["buckets_per_step"][-1] > 1, whole
        assert accumulated["buckets_per_step"] == whole["buckets_per_step"]
        # the same steps: the two runs' losses agree (their parity is the boost-train tests')
        assert accumulated["losses"] == pytest.approx(whole["losses"], rel=1e-5)
