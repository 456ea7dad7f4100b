"""boost-train ``metrics.wandb``: an offline Weights & Biases run in the run folder that holds the
rows of ``metrics.jsonl``, the Hydra config and a name from the overrides; the mode chosen from
the environment; clear config errors before anything starts.

Runs are tiny, as in test_tensorboard.py. wandb never sees the home folder or the network: every
test gets its own WANDB_* folders, no credentials, and runs offline. The offline run's
``run-<id>.wandb`` file is read back with :func:`wandb_records` (a LevelDB-style log of protobuf
records, which wandb 0.31 ships no reader for).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import METRICS_RUN
from hydra import compose, initialize_config_dir

from boost_compile.config import ConfigError
from boost_compile.train import metrics, run
from boost_compile.train.config import config_dir, register_configs
from boost_compile.train.metrics import (
    TENSORBOARD_TAGS,
    WANDB_DIR,
    WANDB_ID_FILE,
    WandbRun,
    WandbWriter,
    read_metrics,
    wandb_mode,
    wandb_run,
)
from boost_compile.train.validate import to_train_config, validate

pytestmark = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="pip install 'boost-compile[wandb]'")

OFFLINE = ("metrics.wandb=true", "metrics.wandb_mode=offline")
MISSING = r"metrics.wandb=true needs the `wandb` package.*pip install 'boost-compile\[wandb\]' or set metrics.wandb=false"


@pytest.fixture(autouse=True)
def isolated_wandb(tmp_path_factory, monkeypatch):
    """wandb's folders in a temporary place, no credentials, no mode from the environment."""
    home = tmp_path_factory.mktemp("wandb-home")
    for name in ("DIR", "CONFIG_DIR", "CACHE_DIR", "DATA_DIR", "ARTIFACT_DIR"):
        monkeypatch.setenv(f"WANDB_{name}", str(home / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("NETRC", str(home / "netrc"))  # none there
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    return home


def cfg_of(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file: a 7-byte ``:W&B`` header, then 32 KiB blocks of chunks
    (crc32, length, type: full, first, middle, last), each record a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeros to the block's end
            pos += block - pos % block
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def offline_run(path: Path) -> dict[str, Any]:
    """An offline run's id, name, group, project, config and history ({tag: [(step, value)]})."""
    out: dict[str, Any] = {"config": {}, "history": {}}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            out.update(id=r.run_id, name=r.display_name, group=r.run_group, project=r.project)
            out["config"] = {i.key: json.loads(i.value_json) for i in r.config.update if i.key != "_wandb"}
        elif kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            for tag, value in items.items():
                if not tag.startswith("_"):
                    out["history"].setdefault(tag, []).append((items["_step"], value))
    return out


def wandb_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob(f"{WANDB_DIR}/offline-run-*/run-*.wandb"))


def expected_history(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    rows = read_metrics(run_dir / "metrics.jsonl")
    points = {tag: [(r["step"], r[key]) for r in rows if key in r] for key, tag in TENSORBOARD_TAGS.items()}
    return {tag: p for tag, p in points.items() if p}


# ----------------------------------------------------------------------------- runs


def test_offline_run_holds_the_rows_the_config_and_the_name(tmp_path):
    cfg = cfg_of(*METRICS_RUN, *OFFLINE)
    result = run(cfg, tmp_path, overrides=["optim.lr=0.003", "trainer.steps=4"])
    assert result["status"] == "completed" and result["steps"] == 4
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    [path] = wandb_files(tmp_path)
    assert path.name == f"run-{run_id}.wandb" and path.parent.name.endswith(f"-{run_id}")
    got = offline_run(path)
    assert got["id"] == run_id and got["project"] == "boost-compile" and got["group"] == ""
    assert got["name"] == "optim.lr=0.003,trainer.steps=4"  # the overrides, as Hydra's override_dirname
    assert got["config"] == json.loads(json.dumps(dataclasses.asdict(to_train_config(cfg))))
    assert got["config"]["metrics"]["wandb"] is True and got["config"]["trainer"]["steps"] == 4
    expected = expected_history(tmp_path)
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/grad_norm", "val/loss"} <= expected.keys()
    assert [s for s, _ in expected["val/loss"]] == [2, 4]
    assert got["history"] == expected  # the same values, full precision


def test_a_restart_in_the_folder_continues_the_wandb_run(tmp_path):
    cfg = cfg_of(*METRICS_RUN, *OFFLINE, "trainer.steps=2", "trainer.eval_every=0")
    run(cfg, tmp_path)
    again = run(cfg, tmp_path)
    assert again["restarts"] == 1
    first, second = wandb_files(tmp_path)  # offline: one folder per start, the same run id
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert first.name == second.name == f"run-{run_id}.wandb"
    assert offline_run(second)["name"] == tmp_path.name  # no overrides: the run folder's name
    assert offline_run(second)["history"] == expected_history(tmp_path)  # the redone steps, as jsonl


def test_a_wandb_failure_never_hides_the_training_error(tmp_path, monkeypatch):
    import wandb.sdk.wandb_run

    codes = []

    def failing_finish(self, exit_code=None, quiet=None):
        codes.append(exit_code)
        finish(self, exit_code=exit_code)
        raise OSError("wandb is broken")

    def write_then_fail(self, row):
        write(self, row)
        if row["step"] == 2:
            raise RuntimeError("the training step failed")

    finish, write = wandb.sdk.wandb_run.Run.finish, metrics.MetricsWriter.write
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "finish", failing_finish)
    monkeypatch.setattr(metrics.MetricsWriter, "write", write_then_fail)
    with pytest.raises(RuntimeError, match="the training step failed"):
        run(cfg_of(*METRICS_RUN, *OFFLINE, "trainer.eval_every=0"), tmp_path)
    assert codes == [1]  # marked failed
    assert offline_run(wandb_files(tmp_path)[0])["history"]["train/loss"] == expected_history(tmp_path)["train/loss"]


def test_an_online_resume_skips_the_steps_wandb_has(tmp_path, monkeypatch):
    """wandb cannot take back logged steps: the redone ones are skipped, the later ones logged."""
    import wandb

    class FakeRun:
        id, step = "abc", 4  # the resumed run holds steps 0-3
        logged: list[tuple[dict[str, float], int]] = []

        def log(self, values, step):
            self.logged.append((values, step))

        def finish(self, exit_code=0):
            self.exit_code = exit_code

    monkeypatch.setattr(wandb, "init", lambda **kwargs: FakeRun())
    writer = WandbWriter(tmp_path, WandbRun(project="p", mode="online", name="n", config={}))
    for step in range(2, 6):
        writer.write({"step": step, "loss": float(step), "tokens": 1})
    writer.write({"event": "restart", "step": 3})
    writer.close()
    assert FakeRun.logged == [({"train/loss": 4.0}, 4), ({"train/loss": 5.0}, 5)]


def test_other_ranks_and_mode_disabled_write_nothing(tmp_path):
    spec = WandbRun(project="p", mode="offline", name="n", config={})
    for writer in (WandbWriter(tmp_path, spec, enabled=False),
                   WandbWriter(tmp_path, dataclasses.replace(spec, mode="disabled"))):
        writer.write({"step": 1, "loss": 1.0})
        writer.close()
        assert writer.run is None
    assert not (tmp_path / WANDB_DIR).exists()


# ----------------------------------------------------------------------------- name, group, mode


def test_off_by_default():
    tc = to_train_config(cfg_of())
    assert tc.metrics.wandb is False and tc.metrics.wandb_mode is None
    assert tc.metrics.wandb_project == "boost-compile"
    assert wandb_run(tc, Path("runs/x"), ["a=1"]) is None


@pytest.mark.parametrize("multirun", [False, True])
def test_name_and_group_from_hydra(tmp_path, multirun):
    from hydra.core.hydra_config import HydraConfig

    overrides = ["trainer.steps=4", "optim.lr=0.001"]
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, *OFFLINE], return_hydra_config=True)
    cfg.hydra.runtime.output_dir = str(tmp_path / "0")
    cfg.hydra.mode = "MULTIRUN" if multirun else "RUN"
    cfg.hydra.sweep.dir = str(tmp_path)
    tc, instance = to_train_config(cfg_of(*overrides, *OFFLINE)), HydraConfig.instance()
    try:
        instance.set_config(cfg)
        spec = wandb_run(tc, tmp_path / "0", overrides)
        elsewhere = wandb_run(tc, tmp_path / "1", [])  # a stale Hydra config is not used
    finally:
        instance.cfg = None
    expected = "metrics.wandb=true,metrics.wandb_mode=offline,optim.lr=0.001,trainer.steps=4"  # sorted, as Hydra
    assert spec.name == expected and spec.mode == "offline"
    assert spec.group == (str(tmp_path) if multirun else None)
    assert elsewhere.name == "1" and elsewhere.group is None


def test_a_sweep_groups_its_jobs_by_the_sweep_folder(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "boost_compile.train", "-m", *METRICS_RUN, *OFFLINE, "trainer.steps=2", "trainer.eval_every=0",
         "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [offline_run(path) for job in ("0", "1") for path in wandb_files(sweep / job)]
    assert [r["group"] for r in runs] == [str(sweep)] * 2
    assert len({r["id"] for r in runs}) == 2
    from omegaconf import OmegaConf

    dirnames = [OmegaConf.load(sweep / job / ".hydra" / "hydra.yaml").hydra.job.override_dirname for job in ("0", "1")]
    assert [r["name"] for r in runs] == dirnames  # Hydra's job override string: sorted key=value,...
    assert "optim.lr=0.001," in dirnames[0] and "optim.lr=0.003," in dirnames[1]


def test_an_explicit_group_wins():
    tc = to_train_config(cfg_of("metrics.wandb=true", "metrics.wandb_group=ablation", "metrics.wandb_entity=team"))
    spec = wandb_run(tc, Path("/tmp/runs/7"), [])
    assert (spec.group, spec.entity, spec.name) == ("ablation", "team", "7")


@pytest.mark.parametrize(
    ("configured", "env", "netrc", "mode"),
    [
        (None, {}, None, "offline"),  # no key: nothing to log in with, and no network needed
        (None, {"WANDB_API_KEY": "k" * 40}, None, "online"),
        (None, {}, "machine api.wandb.ai\n  login user\n  password secret\n", "online"),
        (None, {}, "machine example.com login user password secret\n", "offline"),
        (None, {"WANDB_BASE_URL": "https://wandb.example.com"}, "machine wandb.example.com password s\n", "online"),
        (None, {"WANDB_MODE": "disabled", "WANDB_API_KEY": "k" * 40}, None, "disabled"),
        (None, {"WANDB_MODE": "offline", "WANDB_API_KEY": "k" * 40}, None, "offline"),
        (None, {"WANDB_MODE": "dryrun"}, None, "offline"),
        ("online", {"WANDB_MODE": "offline"}, None, "online"),  # the config wins
        ("offline", {"WANDB_API_KEY": "k" * 40}, None, "offline"),
    ],
)
def test_mode_resolution(tmp_path, configured, env, netrc, mode):
    path = tmp_path / "netrc"
    if netrc is not None:
        path.write_text(netrc)
    assert wandb_mode(configured, {"NETRC": str(path), **env}) == mode


def test_mode_resolution_reads_the_environment(monkeypatch):
    assert wandb_mode(None) == "offline"  # the fixture: no key, no WANDB_MODE
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode(None) == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode(None) == "offline"


# ----------------------------------------------------------------------------- config errors


def test_without_wandb_the_config_is_refused(monkeypatch):
    cfg = cfg_of("metrics.wandb=true")
    validate(cfg, world_size=1)  # installed: fine
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails
    with pytest.raises(ConfigError, match=MISSING):
        validate(cfg, world_size=1)
    validate(cfg_of(), world_size=1)  # off: the package is not needed


def test_a_bad_mode_is_refused(monkeypatch):
    with pytest.raises(ConfigError, match=r"metrics.wandb_mode='cloud' is not valid; choose one of online, offline, disabled"):
        validate(cfg_of("metrics.wandb=true", "metrics.wandb_mode=cloud"), world_size=1)
    monkeypatch.setenv("WANDB_MODE", "cloud")
    with pytest.raises(ConfigError, match=r"WANDB_MODE='cloud' is not valid.*online, offline, disabled"):
        validate(cfg_of("metrics.wandb=true"), world_size=1)
    validate(cfg_of("metrics.wandb=true", "metrics.wandb_mode=offline"), world_size=1)  # the config wins
    validate(cfg_of(), world_size=1)  # wandb off: WANDB_MODE is not boost-train's business
