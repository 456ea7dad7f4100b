"""The checksums in a checkpoint's ``complete.json``, in one process: every file's digest recorded
(synchronous and asynchronous saves), checked against hashlib read independently; a shard with
one flipped byte (its size unchanged) skipped under ``trainer.resume=auto`` for the checkpoint
before it, and named in a one-line error under an explicit ``checkpoint.resume_from``; a record
of sizes only (a save from before checksums) still resumed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FAST, cfg_of

from boost_compile.config import ConfigError
from boost_compile.train import run
from boost_compile.train.checkpoint import COMPLETE_FILE, ChecksumWriter, checkpoint_problem

# eager, 4 steps, checkpoints at steps 2 and 4, both kept
BASE = (*FAST, "passes=none", "trainer.steps=4", "trainer.save_every=2", "checkpoint.keep=2")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved")
    return run(cfg_of(*BASE), out), out


def sha256_of(path: Path) -> str:
    """The file's sha256, read whole (not as the checkpointer reads it)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy_run(source: Path, dest: Path) -> Path:
    shutil.copytree(source / "checkpoints", dest / "checkpoints")
    return dest


def flip_a_byte(path: Path) -> None:
    """One bit changed in the middle of the file; its size stays the same."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def assert_every_file_digested(folder: Path) -> None:
    record = json.loads((folder / COMPLETE_FILE).read_text())
    on_disk = {f.name for f in folder.iterdir() if f.is_file() and f.name != COMPLETE_FILE}
    assert record["checksum_algorithm"] == "sha256"
    assert set(record["checksums"]) == set(record["files"]) == on_disk
    assert {".metadata", "__0_0.distcp"} <= on_disk
    for name in on_disk:
        assert record["checksums"][name] == sha256_of(folder / name), name


def test_every_file_of_a_checkpoint_has_its_checksum(saved):
    _, out = saved
    folders = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in folders] == ["step_000002", "step_000004"]
    for folder in folders:
        assert_every_file_digested(folder)
        assert checkpoint_problem(folder, verify_checksums=True) is None


def test_the_writer_digests_the_shard_it_wrote(tmp_path):
    """The digests come from the rank that wrote each shard (through DCP's gather), not from
    reading the folder afterwards: the writer holds them once the save returns."""
    import torch.distributed.checkpoint as dcp

    writer = ChecksumWriter(str(tmp_path / "ckpt"))
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3)}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save(state, storage_writer=writer, no_dist=True)
    shards = sorted(p.name for p in (tmp_path / "ckpt").glob("*.distcp"))
    assert shards and sorted(writer.checksums) == shards
    for name in shards:
        assert writer.checksums[name] == sha256_of(tmp_path / "ckpt" / name)


def test_an_asynchronous_save_records_the_checksums_too(tmp_path):
    run(cfg_of(*BASE, "trainer.steps=2", "checkpoint.async_save=true"), tmp_path)
    assert_every_file_digested(tmp_path / "checkpoints" / "step_000002")


def test_a_flipped_byte_falls_back_to_the_previous_checkpoint(saved, tmp_path, caplog):
    summary, source = saved
    out = copy_run(source, tmp_path / "run")
    newest = out / "checkpoints" / "step_000004"
    flip_a_byte(newest / "__0_0.distcp")
    assert checkpoint_problem(newest) is None  # sizes and .metadata alone do not tell
    assert "__0_0.distcp: checksum mismatch" in checkpoint_problem(newest, verify_checksums=True)
    with caplog.at_level(logging.WARNING, logger="boost_compile.train"):
        resumed = run(cfg_of(*BASE, "trainer.resume=auto"), out)
    assert f"trainer.resume=auto: skipping {newest}: __0_0.distcp: checksum mismatch" in caplog.text
    assert resumed["start_step"] == 2 and resumed["resumed_from"] == str(out / "checkpoints" / "step_000002")
    assert resumed["losses"] == pytest.approx(summary["losses"][2:], abs=1e-6, rel=0)
    assert_every_file_digested(newest)  # step 4 saved anew


def test_an_explicit_damaged_checkpoint_names_the_file(saved, tmp_path):
    _, source = saved
    damaged = copy_run(source, tmp_path / "run") / "checkpoints" / "step_000004"
    flip_a_byte(damaged / "__0_0.distcp")
    with pytest.raises(ConfigError) as error:
        run(cfg_of(*BASE, "trainer.resume=true", f"checkpoint.resume_from={damaged}"), tmp_path / "explicit")
    text = str(error.value)
    assert text.startswith(f"checkpoint {damaged}: __0_0.distcp: checksum mismatch") and "\n" not in text
    assert not (tmp_path / "explicit" / "metrics.jsonl").exists()


def test_a_record_of_sizes_only_still_resumes(saved, tmp_path, caplog):
    _, source = saved
    out = copy_run(source, tmp_path / "run")
    newest = out / "checkpoints" / "step_000004"
    record = json.loads((newest / COMPLETE_FILE).read_text())
    old = {"step": record["step"], "files": record["files"]}  # as saved before checksums
    (newest / COMPLETE_FILE).write_text(json.dumps(old))
    with caplog.at_level(logging.INFO, logger="boost_compile.train"):
        resumed = run(cfg_of(*BASE, "trainer.steps=6", "trainer.resume=true", f"checkpoint.resume_from={newest}"),
                      tmp_path / "resumed")
    assert resumed["start_step"] == 4
    assert f"checkpoint {newest}: no checksums recorded" in caplog.text
    # the sizes are still checked: a truncated shard is refused
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(ConfigError, match="__0_0.distcp holds"):
        run(cfg_of(*BASE, "trainer.resume=true", f"checkpoint.resume_from={newest}"), tmp_path / "truncated")
