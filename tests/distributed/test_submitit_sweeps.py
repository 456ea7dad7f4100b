"""A sweep of multi-process jobs on Hydra's submitit launcher (``hydra/launcher=submitit_local``):
each job is its own set of ``tasks_per_node`` processes that take their ranks and rendezvous
from submitit's job environment. Two TP2 jobs (the dense tiny model factorized at two rank
ratios, btp, 2 gloo ranks each) follow, step for step, the losses of the same runs started by
torchrun; a job that fails is listed in the sweep's summary with its error, and the other job
still completes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import FAST, torchrun

from boost_compile.train.app import summary_rows
from boost_compile.train.validate import tp_available

pytestmark = pytest.mark.extended  # make test-extended (CI runs it after make test)

TP2 = (*FAST, "model=tiny-dense", "factorize=svd25", "parallel=tp2", "passes=boost_aot_eager", "trainer.steps=4",
       "checkpoint=off")
RATIOS = ("0.125", "0.25")


def submitit_sweep(overrides: list[str], sweep_dir, tasks: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "boost_compile.train", "-m", "hydra/launcher=submitit_local",
         f"hydra.launcher.tasks_per_node={tasks}", "hydra.launcher.timeout_min=5", *overrides,
         f"hydra.sweep.dir={sweep_dir}"],
        capture_output=True, text=True, timeout=400, env=env,
    )


@pytest.fixture(scope="module")
def tp2_sweep(tmp_path_factory):
    if not tp_available():
        pytest.skip("boost_compile.parallelize_ is not in this build")
    sweep = tmp_path_factory.mktemp("submitit") / "sweep"
    proc = submitit_sweep([*TP2, f"factorize.rank_ratio={','.join(RATIOS)}"], sweep, tasks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return sweep


def test_submitit_tp2_jobs_equal_their_torchrun_runs(tp2_sweep, tmp_path):
    from boost_compile.train.metrics import read_summary

    rows = summary_rows(tp2_sweep)
    assert [r["job"] for r in rows] == ["0", "1"] and all(r["status"] == "completed" for r in rows)
    jobs = [read_summary(tp2_sweep / job / "summary.json") for job in ("0", "1")]
    assert all(job["world"] == 2 and job["steps"] == 4 for job in jobs)  # two processes each, in a (1, 2) mesh
    for job, ratio in zip(jobs, RATIOS, strict=True):
        assert f"factorize.rank_ratio={ratio}" in job["config"]
        reference = torchrun(2, [*TP2, f"factorize.rank_ratio={ratio}"], tmp_path / ratio)
        assert job["losses"] == pytest.approx(reference["losses"], abs=1e-6, rel=0), ratio
        assert job["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-6, rel=0), ratio
    assert abs(jobs[0]["losses"][-1] - jobs[1]["losses"][-1]) > 1e-3  # the ratios are different models
    # rank 0 alone writes the log; rank 1 printed nothing into it
    log = (tp2_sweep / "0" / "train.log").read_text()
    assert log.count("done: steps=4") == 1 and "[rank 1]" not in log


def test_a_failed_submitit_job_shows_in_the_summary_while_the_other_completes(tmp_path):
    sweep = tmp_path / "sweep"
    one = [o for o in TP2 if o != "parallel=tp2"]
    proc = submitit_sweep([*one, "factorize.rank_ratio=0.25,7"], sweep, tasks=1)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["job"]: r for r in summary_rows(sweep)}
    assert rows["0"]["status"] == "completed" and rows["0"]["steps"] == 4
    assert rows["1"]["status"] == "failed"
    assert rows["1"]["error"] == "ConfigError: factorize.rank_ratio must be in (0, 1), got 7.0"
    table = (sweep / "summary.md").read_text()
    assert "| failed |" in table and "best val loss" in table
