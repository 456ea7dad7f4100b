"""Checkpoints that a run can trust, in one process: complete or not used, damaged ones skipped
under ``trainer.resume=auto`` and named under an explicit ``resume_from``, asynchronous saves
equal to synchronous ones, and the pieces a restart leans on (the restart row of
``metrics.jsonl``, injected faults, collective errors). The multi-process restarts are in
tests/distributed/test_faults.py.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FAST, cfg_of
from omegaconf import OmegaConf

from boost_compile.config import ConfigError
from boost_compile.train import find_checkpoint, run
from boost_compile.train.app import _check_rerun_finds_the_run
from boost_compile.train.checkpoint import COMPLETE_FILE, checkpoint_problem
from boost_compile.train.collective_errors import CollectiveError, reported_collectives
from boost_compile.train.faults import Fault, faults_from_env, parse_faults
from boost_compile.train.metrics import count_restarts, read_metrics
from boost_compile.train.parallel import Dist

# eager, checkpoints at steps 2, 4 and 6, all kept
BASE = (*FAST, "passes=none", "trainer.save_every=2", "checkpoint.keep=3")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    return run(cfg_of(*BASE), out), out


def copy_run(source: Path, dest: Path) -> Path:
    """The checkpoints of ``source`` in a fresh run folder ``dest`` (no metrics: a new run)."""
    shutil.copytree(source / "checkpoints", dest / "checkpoints")
    return dest


def damage(path: Path, how: str) -> str:
    """Damage the checkpoint folder ``path``; returns the words its problem is reported with."""
    shard = path / "__0_0.distcp"
    if how == "metadata":
        size = (path / ".metadata").stat().st_size
        (path / ".metadata").write_bytes(b"\x00" * size)  # same size: only reading it tells
        return "its .metadata cannot be read (UnpicklingError"
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
        return "__0_0.distcp holds 100 bytes"
    if how == "missing":
        shard.unlink()
        return "__0_0.distcp is missing"
    (path / COMPLETE_FILE).unlink()  # a save cut short after .metadata
    return f"incomplete: no {COMPLETE_FILE}"


def test_every_checkpoint_has_a_record_of_its_files(straight):
    _, out = straight
    folders = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in folders] == ["step_000002", "step_000004", "step_000006"]
    for path in folders:
        record = json.loads((path / COMPLETE_FILE).read_text())
        assert record["files"] == {f.name: f.stat().st_size for f in path.iterdir() if f.name != COMPLETE_FILE}
        assert {".metadata", "__0_0.distcp"} <= record["files"].keys()
        assert checkpoint_problem(path) is None


@pytest.mark.parametrize("how", ["metadata", "truncated", "missing", "no-record"])
def test_resume_auto_skips_a_damaged_newest_checkpoint(straight, tmp_path, caplog, how):
    summary, source = straight
    out = copy_run(source, tmp_path / "run")
    newest = out / "checkpoints" / "step_000006"
    words = damage(newest, how)
    assert words in checkpoint_problem(newest)
    assert find_checkpoint(out / "checkpoints") == (newest if how != "no-record" else out / "checkpoints" / "step_000004")
    # named explicitly: one line that names the folder and what is wrong, before anything runs
    with pytest.raises(ConfigError) as error:
        run(cfg_of(*BASE, "trainer.resume=true", f"checkpoint.resume_from={newest}"), tmp_path / "explicit")
    assert str(error.value).startswith(f"checkpoint {newest}: ") and words in str(error.value)
    assert "\n" not in str(error.value) and not (tmp_path / "explicit" / "metrics.jsonl").exists()
    # resume=auto: reported, and the previous one resumes (the run then saves step 6 anew)
    with caplog.at_level(logging.WARNING, logger="boost_compile.train"):
        resumed = run(cfg_of(*BASE, "trainer.resume=auto", "trainer.steps=6"), out)
    assert f"skipping {newest}: {words}" in caplog.text
    assert resumed["start_step"] == 4 and resumed["resumed_from"] == str(out / "checkpoints" / "step_000004")
    assert resumed["losses"] == pytest.approx(summary["losses"][4:], abs=1e-6, rel=0)
    assert checkpoint_problem(newest) is None


def test_a_checkpoint_that_fails_to_load_falls_back_to_the_previous(straight, tmp_path, caplog):
    """Complete and readable, but of another model (the loading itself fails): resume=auto
    reports it and loads the one before; an explicit resume names it."""
    summary, source = straight
    out = copy_run(source, tmp_path / "run")
    other = run(cfg_of(*BASE, "trainer.steps=2", "+model.overrides.ffn_dim=96"), tmp_path / "other")
    newest = out / "checkpoints" / "step_000006"
    shutil.rmtree(newest)
    shutil.copytree(Path(other["checkpoint"]), newest)
    assert checkpoint_problem(newest) is None
    with pytest.raises(ConfigError, match=f"checkpoint {newest} cannot be loaded: ValueError: Size mismatch"):
        run(cfg_of(*BASE, "trainer.resume=true", f"checkpoint.resume_from={newest}"), tmp_path / "explicit")
    with caplog.at_level(logging.WARNING, logger="boost_compile.train"):
        resumed = run(cfg_of(*BASE, "trainer.resume=auto"), out)
    assert f"skipping checkpoint {newest}, which cannot be loaded" in caplog.text
    assert resumed["start_step"] == 4
    assert resumed["losses"] == pytest.approx(summary["losses"][4:], abs=1e-6, rel=0)


def test_resume_auto_starts_fresh_when_there_is_nothing(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="boost_compile.train"):
        result = run(cfg_of(*BASE, "trainer.resume=auto", "trainer.steps=2"), tmp_path)
    assert result["start_step"] == 0 and result["restarts"] == 0 and result["resumed_from"] is None
    assert "trainer.resume=auto: no complete checkpoint in" in caplog.text and "starting at step 1" in caplog.text


def test_a_restart_in_the_same_folder_is_recorded(tmp_path):
    """A second start of the same command (as after a fault): a restart row, the redone steps
    dropped from the history, the restart counted."""
    cfg = cfg_of(*BASE, "trainer.resume=auto", "trainer.steps=3")
    first = run(cfg, tmp_path)  # checkpoints at steps 2 and 3 (the end)
    shutil.rmtree(tmp_path / "checkpoints" / "step_000003")  # as if step 3's save had been lost
    second = run(cfg, tmp_path)
    assert second["restarts"] == 1 and second["start_step"] == 2
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert [r for r in rows if r.get("event") == "restart"][0]["step"] == 2
    assert [r["loss"] for r in rows if "loss" in r] == pytest.approx(first["losses"], abs=1e-6, rel=0)
    assert count_restarts(tmp_path / "metrics.jsonl") == (len(rows) - 1, 1)


def test_read_metrics_drops_the_steps_a_restart_redid(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 1.0},
            {"event": "restart", "step": 1}, {"step": 2, "loss": 2.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_metrics(path) == [rows[0], rows[3], rows[4]]
    assert count_restarts(path) == (2, 1) and count_restarts(tmp_path / "none.jsonl") == (0, 0)


def test_async_save_equals_a_synchronous_one(straight, tmp_path):
    _, sync_dir = straight
    result = run(cfg_of(*BASE, "checkpoint.async_save=true"), tmp_path)
    assert result["checkpoint"] == str(tmp_path / "checkpoints" / "step_000006")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for step in (2, 4, 6):
        name = f"step_{step:06d}"
        assert checkpoint_problem(tmp_path / "checkpoints" / name) is None
        loaded = []
        for folder in (sync_dir, tmp_path):
            dcp_to_torch_save(folder / "checkpoints" / name, tmp_path / f"{name}-{len(loaded)}.pt")
            loaded.append(torch.load(tmp_path / f"{name}-{len(loaded)}.pt", weights_only=False))
        assert_equal_trees(*loaded, name)


def assert_equal_trees(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal_trees(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_resume_auto_refuses_a_run_folder_named_after_the_clock():
    cfg = cfg_of("trainer.resume=auto")
    timed = OmegaConf.create({"mode": "RunMode.RUN", "run": {"dir": "runs/${now:%Y-%m-%d}/${now:%H-%M-%S}"}})
    with pytest.raises(ConfigError, match=r"hydra.run.dir=runs/\$\{now:%Y-%m-%d\}/\$\{now:%H-%M-%S\} is named after"):
        _check_rerun_finds_the_run(cfg, timed)
    sweep = OmegaConf.create({"mode": "RunMode.MULTIRUN", "sweep": {"dir": "multirun/${now:%H}"}})
    with pytest.raises(ConfigError, match=r"set hydra.sweep.dir=runs/<name>"):
        _check_rerun_finds_the_run(cfg, sweep)
    _check_rerun_finds_the_run(cfg, OmegaConf.create({"mode": "RunMode.RUN", "run": {"dir": "runs/exp1"}}))
    _check_rerun_finds_the_run(cfg_of("trainer.resume=auto", "checkpoint.dir=/tmp/ckpts"), timed)
    _check_rerun_finds_the_run(cfg_of("trainer.resume=true"), timed)


def test_faults_come_from_the_environment_on_the_first_attempt_only(monkeypatch):
    assert parse_faults("kill:1:4, hang:0:2") == (Fault("kill", 1, 4), Fault("hang", 0, 2))
    with pytest.raises(ConfigError, match=r"expected <kind>:<rank>:<step>"):
        parse_faults("explode:0:1")
    monkeypatch.setenv("BOOST_COMPILE_FAULT", "kill:1:4,kill-in-save:0:6")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert faults_from_env(1).faults == (Fault("kill", 1, 4),) and faults_from_env(0).in_saves
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults_from_env(1).faults == ()


def test_a_failed_collective_names_the_rank_the_phase_and_the_step():
    dev = Dist(world=4, rank=3, dp=2, tp=2, device=torch.device("cpu"))
    with pytest.raises(CollectiveError) as error:
        with reported_collectives(dev, "the stop check (an all-reduce over every rank)", 7, 5.0):
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")
    text = str(error.value)
    assert text.startswith("rank 3 of 4 (pp 0, dp 1, tp 1): the stop check (an all-reduce over every rank) at step 7")
    assert "parallel.timeout_s=5 passed" in text and "Timed out waiting 5000ms" in text
    with pytest.raises(ValueError, match="not a collective"):  # other errors pass unchanged
        with reported_collectives(dev, "the training step", 7, 5.0):
            raise ValueError("not a collective")


def test_the_starting_weights_checkpoint_changes_nothing_and_resumes_exactly(straight, tmp_path):
    """checkpoint.at_start saves step_000000 before the first step. Saving the optimizer state
    makes it (DCP steps AdamW once with zero gradients): the run must go on as if it had not, and
    resuming from step 0 must equal the fresh run, step for step."""
    fresh, _ = straight
    seeded = run(cfg_of(*BASE, "checkpoint.at_start=true", "checkpoint.keep=4"), tmp_path / "seeded")
    assert seeded["losses"] == fresh["losses"]
    start = tmp_path / "seeded" / "checkpoints" / "step_000000"
    assert (start / COMPLETE_FILE).exists()
    resumed = run(cfg_of(*BASE, "trainer.resume=true", f"checkpoint.resume_from={start}"), tmp_path / "resumed")
    assert resumed["start_step"] == 0 and resumed["losses"] == fresh["losses"]
