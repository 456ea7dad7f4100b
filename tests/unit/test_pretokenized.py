"""``data=tokens``: pre-tokenized corpora (nanoGPT's train.bin/val.bin, .npy arrays), memory-mapped.

The files are written here with numpy from known id sequences; every expected batch is cut
from those sequences in the test, not by the code under test. Runs are tiny (preset tiny,
eager, one thread, a few steps).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import FAST, cfg_of

import boost_compile.train.data.tokens_file as tokens_mod
from boost_compile.config import ConfigError
from boost_compile.train import find_checkpoint, run
from boost_compile.train.config import DataConfig, TrainConfig
from boost_compile.train.data import load_corpus, make_loaders
from boost_compile.train.tokenizer import TOKENIZER_FILE, Tokenizer
from boost_compile.train.validate import validate

SEQ, BATCH = 16, 4
VOCAB = 1000  # the word-level tokenizer's: ids above 255 use both bytes of a uint16


def fake_dev() -> SimpleNamespace:
    return SimpleNamespace(world=1, dp=1, dp_rank=0, is_main=True)


def known_ids(n: int, high: int = VOCAB, seed: int = 0) -> np.ndarray:
    """``n`` random ids below ``high`` (every window of SEQ of them is different)."""
    return np.random.default_rng(seed).integers(0, high, n)


@pytest.fixture
def word_tokenizer(tmp_path: Path) -> Path:
    """A ``tokenizer.json`` of VOCAB words ``w0 .. w999``, id i for ``wi``."""
    tk = pytest.importorskip("tokenizers")
    backend = tk.Tokenizer(tk.models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    path = Tokenizer(backend).save(tmp_path / "tok")
    assert path is not None
    return path


@pytest.fixture
def bin_folder(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """nanoGPT's layout: train.bin and val.bin, flat uint16 ids."""
    folder = tmp_path / "owt"
    folder.mkdir()
    train, val = known_ids(6000, seed=1), known_ids(700, seed=2)
    train.astype(np.uint16).tofile(folder / "train.bin")
    val.astype(np.uint16).tofile(folder / "val.bin")
    return folder, train, val


def loaders(data: DataConfig, seq: int = SEQ):
    tc = TrainConfig()
    tc.trainer.batch, tc.trainer.seq = BATCH, seq
    tc.data = data
    corpus = load_corpus(data)
    return corpus, *make_loaders(tc, corpus, fake_dev())


def check_train_batches(train_loader, ids: np.ndarray, n_batches: int) -> None:
    """Every row is a window ids[k*SEQ : k*SEQ + SEQ] (k found by its content), its targets the
    next ids; no window is served twice within the epoch."""
    windows = {tuple(ids[k * SEQ : k * SEQ + SEQ].tolist()): k for k in range((len(ids) - 1) // SEQ)}
    seen = set()
    for _ in range(n_batches):
        inputs, targets = next(train_loader)
        assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == (BATCH, SEQ)
        for row, target in zip(inputs.tolist(), targets.tolist(), strict=True):
            k = windows[tuple(row)]
            assert target == ids[k * SEQ + 1 : k * SEQ + SEQ + 1].tolist()
            assert k not in seen
            seen.add(k)


def check_val_batches(val_loader, ids: np.ndarray) -> None:
    """The validation split in file order: batch i holds windows i*b .. i*b + b - 1."""
    b = val_loader.batch_size
    for i in range(len(val_loader)):
        inputs, targets = val_loader.batch(0, i)
        for j in range(b):
            start = (i * b + j) * SEQ
            assert inputs[j].tolist() == ids[start : start + SEQ].tolist()
            assert targets[j].tolist() == ids[start + 1 : start + SEQ + 1].tolist()


# ----------------------------------------------------------------------------- the batches


def test_nanogpt_folder_batches_are_the_file_ids(bin_folder, word_tokenizer):
    folder, train_ids, val_ids = bin_folder
    corpus, train, val = loaders(DataConfig(source="tokens", paths=[str(folder)], tokenizer=str(word_tokenizer)))
    assert corpus.tokenizer.vocab_size == VOCAB
    assert corpus.train.dtype == torch.uint16 and len(corpus.train) == 6000 and len(corpus.val) == 700
    check_train_batches(train, train_ids, len(train))
    assert len(val) == 10 and val.batch_size == BATCH  # 43 windows of 16 in 700 ids: 10 batches of 4
    check_val_batches(val, val_ids)


@pytest.mark.parametrize("dtype", ["int32", "uint16", "int64"])
def test_npy_file_holds_out_its_tail(tmp_path, dtype):
    ids = known_ids(5000, high=256, seed=3)
    path = tmp_path / "ids.npy"
    np.save(path, ids.astype(dtype))
    corpus, train, val = loaders(DataConfig(source="tokens", paths=[str(path)], val_fraction=0.1))
    assert corpus.tokens.dtype == getattr(torch, dtype)
    assert corpus.train.tolist() == ids[:4500].tolist() and corpus.val.tolist() == ids[4500:].tolist()
    check_train_batches(train, ids[:4500], len(train))
    check_val_batches(val, ids[4500:])


def test_two_files_and_int32_bin(tmp_path):
    train_ids, val_ids = known_ids(3000, high=256, seed=4), known_ids(400, high=256, seed=5)
    train_ids.astype("<i4").tofile(tmp_path / "a.bin")
    val_ids.astype("<i4").tofile(tmp_path / "b.bin")
    data = DataConfig(source="tokens", paths=[str(tmp_path / "a.bin"), str(tmp_path / "b.bin")], token_dtype="int32")
    corpus, train, val = loaders(data)
    assert corpus.train.dtype == torch.int32 and corpus.val.tolist() == val_ids.tolist()
    check_train_batches(train, train_ids, 3)
    check_val_batches(val, val_ids)


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _anon_kib() -> int:
    """Resident private memory (a copy of the corpus would land here; the map's pages are the
    file's, counted apart as RssFile, and the kernel maps several MiB around each one touched)."""
    match = re.search(r"^RssAnon:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match
    return int(match.group(1))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc")
def test_batches_come_from_the_map_without_a_copy(tmp_path, monkeypatch):
    """A 128 MiB file: the tensor lies in the file's mapping, and loading it, checking every id
    and taking batches leave the private resident memory far below the file's size."""
    monkeypatch.setattr(tokens_mod, "SCAN_IDS", 1 << 20)
    n = 64 << 20
    path = tmp_path / "big.bin"
    (np.arange(n, dtype=np.uint32) % 251).astype(np.uint16).tofile(path)
    before = _anon_kib()
    corpus, train, _ = loaders(DataConfig(source="tokens", paths=[str(path)]), seq=1024)
    for _ in range(8):
        next(train)
    grown_mib = (_anon_kib() - before) / 1024
    pointer = corpus.tokens.data_ptr()
    assert any(start <= pointer < end for start, end in _file_mappings(path))
    assert len(corpus.tokens) == n
    assert grown_mib < 32, f"private resident memory grew {grown_mib:.0f} MiB for a 128 MiB file"


# ----------------------------------------------------------------------------- a run


def test_a_run_on_the_bin_folder_trains_and_resumes(bin_folder, word_tokenizer, tmp_path, caplog):
    folder, train_ids, _ = bin_folder
    base = (*FAST, "data=tokens", f"data.paths=[{folder}]", f"data.tokenizer={word_tokenizer}",
            "trainer.steps=4", "trainer.batch=4", "trainer.seq=16", "trainer.save_every=2")
    with caplog.at_level(logging.INFO, logger="boost_compile.train"):
        straight = run(cfg_of(*base), tmp_path / "a")
    assert straight["status"] == "completed" and len(straight["losses"]) == 4
    assert all(0 < loss < 2 * np.log(1024) for loss in straight["losses"])
    assert "padded to 1,024" in caplog.text  # the model's vocabulary follows the tokenizer
    saved = Tokenizer.from_file(tmp_path / "a" / TOKENIZER_FILE)  # what export and generation decode with
    assert saved.vocab_size == VOCAB
    assert saved.decode(train_ids[:3].tolist()) == " ".join(f"w{i}" for i in train_ids[:3])

    checkpoint = tmp_path / "a" / "checkpoints" / "step_000002"
    assert find_checkpoint(checkpoint) == checkpoint
    resumed = run(cfg_of(*base, "trainer.resume=true", f"checkpoint.resume_from={checkpoint}"), tmp_path / "b")
    assert resumed["start_step"] == 2 and resumed["steps"] == 4
    assert resumed["losses"] == pytest.approx(straight["losses"][2:], abs=1e-6, rel=0)


# ----------------------------------------------------------------------------- refusals


def test_an_id_outside_the_vocabulary_is_refused_in_one_line(bin_folder, tmp_path, monkeypatch):
    folder, train_ids, val_ids = bin_folder
    monkeypatch.setattr(tokens_mod, "SCAN_IDS", 100)  # the largest id sits in a later chunk
    bad = (val_ids % 256).astype(np.uint16)
    bad[150], bad[650] = 300, 4000
    bad.tofile(folder / "val.bin")
    (train_ids % 256).astype(np.uint16).tofile(folder / "train.bin")
    data = DataConfig(source="tokens", paths=[str(folder)])
    validate({"data": {"source": "tokens", "paths": [str(folder)]}, "trainer": {"batch": 4, "seq": 16}}, world_size=1)
    with pytest.raises(ConfigError) as info:
        load_corpus(data)
    message = str(info.value)
    assert "\n" not in message
    assert str(folder / "val.bin") in message and "token id 4000" in message and "vocabulary of 256" in message
    with pytest.raises(ConfigError, match=r"holds token id 4000"):  # a run stops before training
        run(cfg_of(*FAST, "data=tokens", f"data.paths=[{folder}]"), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_negative_id_is_refused(tmp_path):
    ids = known_ids(2000, high=256, seed=6).astype(np.int32)
    ids[1234] = -7
    np.save(tmp_path / "ids.npy", ids)
    with pytest.raises(ConfigError, match=r"ids.npy holds token id -7; ids are 0 or more"):
        load_corpus(DataConfig(source="tokens", paths=[str(tmp_path / "ids.npy")]))


def _write(path: Path, payload: bytes | np.ndarray) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(payload, bytes):
        path.write_bytes(payload)
    elif path.suffix == ".npy":
        np.save(path, payload)
    else:
        payload.tofile(path)
    return str(path)


@pytest.mark.parametrize(
    ("files", "overrides", "message"),
    [
        # a .bin whose size is not a whole number of ids
        ({"odd.bin": b"\x01" * 2001}, {}, r"odd.bin is 2001 bytes, not a whole number of uint16 ids \(2 bytes each\)"),
        ({"odd.bin": b"\x01" * 4002}, {"token_dtype": "int32"}, r"odd.bin is 4002 bytes, not a whole number of int32"),
        # missing files
        ({}, {"paths": ["{tmp}/nothing.bin"]}, r"data path\(s\) not found: .*nothing.bin"),
        ({"f/train.bin": np.zeros(4000, np.uint16)}, {"paths": ["{tmp}/f"]}, r"has train.bin but no val.bin"),
        ({"f/notes.txt": b"hi"}, {"paths": ["{tmp}/f"]}, r"holds neither train.bin and val.bin or train.npy"),
        ({"notes.txt": b"hi"}, {"paths": ["{tmp}/notes.txt"]}, r"reads .bin \(raw ids\) and .npy files"),
        ({}, {"paths": []}, r"data=tokens needs data.paths"),
        # wrong types
        ({"ids.npy": np.zeros(4000, np.float32)}, {}, r"ids.npy holds float32 values"),
        ({"ids.npy": np.zeros((100, 40), np.int32)}, {}, r"ids.npy holds an array of shape \(100, 40\)"),
        ({"ids.bin": b"\x01\x00" * 4000}, {"token_dtype": "float32"}, r"data.token_dtype='float32' is not valid"),
        # empty splits
        ({"f/train.bin": np.zeros(4000, np.uint16), "f/val.bin": b""}, {"paths": ["{tmp}/f"]}, r"val.bin holds no token ids"),
        ({"f/train.bin": np.zeros(4000, np.uint16), "f/val.bin": np.zeros(10, np.uint16)}, {"paths": ["{tmp}/f"]},
         r"validation split \(.*val.bin\) holds 10 tokens, fewer than one window of trainer.seq=16"),
        ({"ids.bin": np.zeros(1000, np.uint16)}, {},
         r"the last data.val_fraction=0.01 of .*ids.bin\) holds 10 tokens.*a larger data.val_fraction"),
        ({"ids.bin": np.zeros(40, np.uint16)}, {"val_fraction": 0.5}, r"training split .* holds 20 tokens"),
        # a tokenizer that cannot have made the ids
        ({"ids.bin": np.zeros(4000, np.uint16)}, {"tokenizer": "bpe:512"}, r"data.tokenizer=bpe:512 trains one on text"),
    ],
)
def test_bad_token_files_are_refused_before_the_run(tmp_path, files, overrides, message):
    written = [_write(tmp_path / name, payload) for name, payload in files.items()]
    data = {"source": "tokens", "paths": written[:1], **overrides}
    data["paths"] = [p.replace("{tmp}", str(tmp_path)) for p in data["paths"]]
    with pytest.raises(ConfigError, match=message):
        validate({"data": data, "trainer": {"batch": 4, "seq": 16}}, world_size=1)
