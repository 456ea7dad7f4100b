"""boost-train ``metrics.tensorboard``: event files that match ``metrics.jsonl``, off by
default, and a clear config error (before anything starts) without the package.

Runs are tiny, as in test_train.py: preset tiny, a few steps of 4 x 32 bytes, eager.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import METRICS_RUN
from hydra import compose, initialize_config_dir

from boost_compile.config import ConfigError
from boost_compile.train import run
from boost_compile.train.config import config_dir, register_configs
from boost_compile.train.metrics import TENSORBOARD_DIR, TENSORBOARD_TAGS, TensorBoardWriter
from boost_compile.train.validate import validate

needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None, reason="pip install 'boost-compile[tensorboard]'"
)
MISSING = r"metrics.tensorboard=true needs the `tensorboard` package.*pip install 'boost-compile\[tensorboard\]'"


def cfg_of(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files in ``log_dir``: [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def f32(value: float) -> float:
    return float(np.float32(value))  # TensorBoard stores scalars as float32


@needs_tensorboard
def test_event_files_hold_the_rows_of_metrics_jsonl(tmp_path):
    result = run(cfg_of(*METRICS_RUN, "metrics.tensorboard=true"), tmp_path)
    assert result["status"] == "completed" and result["steps"] == 4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    got = scalars(tmp_path / TENSORBOARD_DIR)
    expected = {
        tag: [(r["step"], f32(r[key])) for r in rows if key in r]
        for key, tag in TENSORBOARD_TAGS.items()
    }
    expected = {tag: points for tag, points in expected.items() if points}
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/grad_norm", "val/loss"} <= expected.keys()
    assert [s for s, _ in expected["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in expected["val/loss"]] == [2, 4]
    assert got == expected


@needs_tensorboard
def test_sigterm_stops_with_the_event_files_closed(tmp_path, monkeypatch):
    from boost_compile.train import metrics

    write, closed = metrics.MetricsWriter.write, []

    def write_then_signal(self, row):
        write(self, row)
        if row["step"] == 2 and "loss" in row:
            os.kill(os.getpid(), signal.SIGTERM)  # the run stops after this step

    monkeypatch.setattr(metrics.MetricsWriter, "write", write_then_signal)
    close = metrics.TensorBoardWriter.close
    monkeypatch.setattr(metrics.TensorBoardWriter, "close", lambda self: (closed.append(self.writer), close(self)))
    result = run(cfg_of(*METRICS_RUN, "trainer.steps=50", "trainer.eval_every=0", "metrics.tensorboard=true"), tmp_path)
    assert result["status"] == "stopped" and result["signal"] == "SIGTERM" and result["steps"] == 2
    assert len(closed) == 1 and closed[0] is not None
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert scalars(tmp_path / TENSORBOARD_DIR)["train/loss"] == [(r["step"], f32(r["loss"])) for r in rows]


def test_off_by_default_writes_no_event_files(tmp_path):
    cfg = cfg_of(*METRICS_RUN, "trainer.steps=2", "trainer.eval_every=0")
    assert cfg.metrics.tensorboard is False
    result = run(cfg, tmp_path)
    assert result["status"] == "completed"
    assert (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    assert not list(tmp_path.rglob("events.out.tfevents.*"))


def test_without_tensorboard_the_config_is_refused(monkeypatch):
    cfg = cfg_of("metrics.tensorboard=true")
    if importlib.util.find_spec("tensorboard") is not None:
        validate(cfg, world_size=1)  # installed: fine
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now fails
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=MISSING):
        validate(cfg, world_size=1)
    validate(cfg_of(), world_size=1)  # off: the package is not needed


def test_cli_refuses_before_starting(tmp_path):
    out = tmp_path / "run"
    script = (
        "import sys; sys.modules['tensorboard'] = None; sys.modules['torch.utils.tensorboard'] = None\n"
        "from boost_compile.train import main\n"
        f"main(['metrics.tensorboard=true', 'hydra.run.dir={out}'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "boost-train: error: metrics.tensorboard=true needs the `tensorboard` package" in proc.stderr
    assert "pip install 'boost-compile[tensorboard]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "metrics.jsonl").exists() and not (out / TENSORBOARD_DIR).exists()


@needs_tensorboard
def test_resumed_run_hides_the_steps_it_redoes(tmp_path):
    first = TensorBoardWriter(tmp_path)
    for step in range(1, 6):  # interrupted after step 5, last checkpoint at step 3
        first.write({"step": step, "loss": float(step)})
    first.close()
    second = TensorBoardWriter(tmp_path, purge_step=4)
    for step in range(4, 7):
        second.write({"step": step, "loss": 10.0 * step})
    second.close()
    assert scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    assert not TensorBoardWriter(tmp_path / "rank1", enabled=False).writer  # other ranks write nothing
    assert not (tmp_path / "rank1").exists()


@needs_tensorboard
def test_a_restart_in_the_same_folder_keeps_one_value_per_step(tmp_path):
    """boost-train started again in its folder (trainer.resume=auto, as after a fault): the
    event files hold the history of metrics.jsonl without the redone steps' first values."""
    import shutil

    from boost_compile.train.metrics import read_metrics

    cfg = cfg_of(*METRICS_RUN, "checkpoint=default", "trainer.steps=4", "trainer.eval_every=0", "trainer.save_every=2",
                 "trainer.resume=auto",
                 "metrics.tensorboard=true")
    run(cfg, tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "step_000004")  # the last save lost: steps 3-4 are redone
    again = run(cfg, tmp_path)
    assert again["restarts"] == 1 and again["start_step"] == 2
    history = [(r["step"], f32(r["loss"])) for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [s for s, _ in history] == [1, 2, 3, 4]
    assert scalars(tmp_path / TENSORBOARD_DIR)["train/loss"] == history
