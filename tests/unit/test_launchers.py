"""Sweeps beyond Hydra's basic launcher: ranks from submitit's job environment, the plugins as
optional extras, the best job of a sweep, and an optuna search over learning rate x rank ratio
that minimises the validation loss each job returns.

The multi-process jobs (submitit_local TP2 sweeps against torchrun) are in
tests/distributed/test_submitit_sweeps.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from conftest import FAST

from boost_compile.config import ConfigError
from boost_compile.train import launchers, write_sweep_summary
from boost_compile.train.app import best_row, summary_rows

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_submitit_environment_becomes_torchruns(monkeypatch):
    """Task 1 of a 2-task submitit_local job gets rank 1 of 2 and the job's rendezvous."""
    for name in (*TORCHRUN_VARS, "SUBMITIT_EXECUTOR"):
        monkeypatch.setenv(name, "")  # so that monkeypatch restores what submitit's export sets
        monkeypatch.delenv(name)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert launchers.adopt_submitit_environment() is None  # not under submitit: nothing set
    assert "RANK" not in os.environ
    job = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "4242", "SUBMITIT_LOCAL_NTASKS": "2",
           "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "1",
           "SUBMITIT_LOCAL_LOCALID": "1"}
    for name, value in job.items():
        monkeypatch.setenv(name, value)
    assert launchers.adopt_submitit_environment() == 1
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("1", "2", "1")
    port = int(os.environ["MASTER_PORT"])
    # the same job id gives every task of the job the same port; another job another one
    monkeypatch.setenv("SUBMITIT_LOCAL_GLOBALID", "0")
    monkeypatch.setenv("SUBMITIT_LOCAL_LOCALID", "0")
    assert launchers.adopt_submitit_environment() == 0 and int(os.environ["MASTER_PORT"]) == port
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "4243")
    monkeypatch.delenv("MASTER_PORT")  # a new job's process starts without it
    launchers.adopt_submitit_environment()
    assert int(os.environ["MASTER_PORT"]) != port
    monkeypatch.setenv("MASTER_PORT", "29999")  # a port the job was given (sbatch --export) is kept
    launchers.adopt_submitit_environment()
    assert os.environ["MASTER_PORT"] == "29999"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"  # LOCAL_RANK picks the GPU; every GPU stays visible


@pytest.mark.parametrize(
    "argv, named",
    [
        (["-m", "hydra/launcher=submitit_local", "parallel=tp2"], ["submitit"]),
        (["-m", "hydra/launcher=submitit_slurm"], ["submitit"]),
        (["-m", "experiment=optuna_lr_rank"], ["optuna"]),
        (["-m", "hydra/sweeper=optuna", "hydra/launcher=submitit_local"], ["submitit", "optuna"]),
        (["-m", "experiment=rank_sweep", "model=tiny"], []),
        (["run_name=submitit"], []),  # a value that is not a launcher choice
    ],
)
def test_plugins_named_by_a_command_line(argv, named):
    assert launchers.plugins_named(argv) == named


def test_a_missing_plugin_is_refused_with_the_extra_that_installs_it(monkeypatch, tmp_path):
    real = launchers.importlib.util.find_spec

    def find_spec(name, *args):
        return None if name.startswith("hydra_plugins.hydra_submitit") else real(name, *args)

    monkeypatch.setattr(launchers.importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError, match=r"hydra-submitit-launcher, which is not installed.*boost-compile\[sweep\]"):
        launchers.check_plugins(["-m", "hydra/launcher=submitit_local"])
    launchers.check_plugins(["-m", "experiment=optuna_lr_rank"])  # installed (a dev extra): accepted
    # the command line stops before Hydra loads anything
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, importlib.util as u; real = u.find_spec; "
         "u.find_spec = lambda n, *a: None if 'optuna' in n else real(n, *a); "
         "from boost_compile.train import main; main(sys.argv[1:])", "-m", "experiment=optuna_lr_rank",
         f"hydra.sweep.dir={tmp_path}/sweep"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "experiment=optuna_lr_rank needs the Hydra plugin hydra-optuna-sweeper" in proc.stderr
    assert not (tmp_path / "sweep").exists()


def test_the_best_job_is_the_lowest_val_loss_of_the_completed_ones(tmp_path):
    jobs = {"0": ("completed", 3.0), "1": ("completed", 2.5), "2": ("failed", None), "3": ("completed", None)}
    for job, (status, val) in jobs.items():
        (tmp_path / job).mkdir()
        data = {"config": f"optim.lr={job}", "status": status, "val_loss": val}
        if status == "failed":
            data["error"] = "ValueError: boom"
        (tmp_path / job / "summary.json").write_text(json.dumps(data))
    assert best_row(summary_rows(tmp_path))["job"] == "1"
    table = write_sweep_summary(tmp_path)
    assert "best val loss: 2.5000, job 1 (optim.lr=1)" in table
    assert "| 2 | optim.lr=2 | failed |" in table and "ValueError: boom |" in table


def test_optuna_sweep_of_four_trials_returns_the_best_val_loss(tmp_path):
    """experiment=optuna_lr_rank: each trial returns its val loss to the sweeper, which keeps the lowest."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "boost_compile.train", "-m", "experiment=optuna_lr_rank", "hydra.sweeper.n_trials=4",
         *FAST, "trainer.steps=4", "trainer.eval_every=2", "passes=none", "checkpoint=off", f"hydra.sweep.dir={sweep}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = summary_rows(sweep)
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"] and all(r["status"] == "completed" for r in rows)
    trials = [dict(o.split("=", 1) for o in r["config"].split() if o.startswith(("optim.lr=", "factorize.rank_ratio=")))
              for r in rows]
    assert all(set(t) == {"optim.lr", "factorize.rank_ratio"} for t in trials)
    assert len({t["optim.lr"] for t in trials}) == 4  # the sampler drew four learning rates
    assert all(1e-4 <= float(t["optim.lr"]) <= 1e-2 and t["factorize.rank_ratio"] in ("0.125", "0.25", "0.5") for t in trials)
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    best = min(rows, key=lambda r: r["val_loss"])
    assert result["best_value"] == pytest.approx(best["val_loss"], rel=1e-12)  # what the jobs returned
    assert {k: str(v) for k, v in result["best_params"].items()} == trials[rows.index(best)]
    assert f"best val loss: {best['val_loss']:.4f}, job {best['job']}" in (sweep / "summary.md").read_text()


def test_a_failed_job_shows_in_the_summary_while_the_others_complete(tmp_path):
    """Basic launcher: the job that validation refuses fails with its reason, the next one still runs, the sweep exits 1."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "boost_compile.train", "-m", *FAST, "model=tiny-dense", "factorize=svd25", "trainer.steps=3",
         "passes=none", "checkpoint=off", "factorize.rank_ratio=7,0.25", f"hydra.sweep.dir={sweep}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["job"]: r for r in summary_rows(sweep)}
    assert rows["0"]["status"] == "failed" and rows["0"]["error"] == "ConfigError: factorize.rank_ratio must be in (0, 1), got 7.0"
    assert rows["1"]["status"] == "completed" and rows["1"]["steps"] == 3
    assert "| failed |" in (sweep / "summary.md").read_text()
