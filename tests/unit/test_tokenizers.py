"""Tokenizers (bytes, a local tokenizer.json, trained BPE) and the memory-mapped token cache.

Every test keeps its cache in a tmp folder (``BOOST_COMPILE_CACHE`` or
``data.cache_dir``); BPEs are tiny (a few hundred tokens over ~100 kB of text).
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")

import boost_compile.train.data.cache as data_mod
import boost_compile.train.tokenizer as tok_mod
from boost_compile.config import ConfigError
from boost_compile.train.config import DataConfig, TrainConfig
from boost_compile.train.data import (
    CACHE_ENV,
    Corpus,
    cache_root,
    load_corpus,
    make_loaders,
    split,
    stdlib_tokens,
    token_dtype,
)
from boost_compile.train.model import fit_vocab
from boost_compile.train.tokenizer import (
    TOKENIZER_FILE,
    Tokenizer,
    load_tokenizer,
    padded_vocab,
    parse_spec,
    tokenizer_for_run,
    train_bpe,
)
from boost_compile.train.validate import to_train_config, validate

SAMPLE = "def f(x):\n    return x ** 2  # ünïcødé ✓ 日本語\n\n\tend\r\n"


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    """No test writes to ~/.cache: the default cache folder is a tmp one."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env-cache"))


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):
        lines = (f"line {j} of part {i}: the quick brown fox, café №{j % 7} → {j * i}\n" for j in range(600))
        (folder / f"part{i}.txt").write_text("".join(lines), encoding="utf-8")
    return folder


def text_data(corpus_dir: Path, tokenizer: str, cache: Path, **kw) -> DataConfig:
    return DataConfig(source="text", paths=[str(corpus_dir)], tokenizer=tokenizer, cache_dir=str(cache), **kw)


def fake_dev(dp: int = 1, dp_rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(world=1, dp=dp, dp_rank=dp_rank, is_main=True)


# ----------------------------------------------------------------------------- tokenizers


def test_padded_vocab():
    assert padded_vocab(256) == 256
    assert padded_vocab(257) == 320
    assert padded_vocab(2048) == 2048
    assert padded_vocab(50257) == 50304
    assert padded_vocab(1) == 64
    assert padded_vocab(100, multiple=8) == 104
    with pytest.raises(ValueError):
        padded_vocab(0)


def test_bytes_round_trip(tmp_path):
    tok = load_tokenizer("bytes", tmp_path)
    assert tok.vocab_size == 256 and tok.name == "bytes" and tok.is_bytes
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8"))
    assert tok.decode(ids) == SAMPLE
    assert tok.encode_batch([SAMPLE, ""]) == [ids, []]
    assert tok.save(tmp_path) is None and not (tmp_path / TOKENIZER_FILE).exists()  # nothing to save
    assert tok.fingerprint() == Tokenizer.bytes().fingerprint()
    with pytest.raises(ValueError, match="token ids"):
        tok.decode([256])


def test_local_tokenizer_json_round_trip(tmp_path):
    trained = train_bpe([SAMPLE * 20, "hello world " * 50], 300)
    folder = tmp_path / "tok"
    path = trained.save(folder)
    assert path == folder / TOKENIZER_FILE
    for spec in (str(path), str(folder)):  # the file, or a folder holding one
        tok = load_tokenizer(spec)
        assert tok.vocab_size == trained.vocab_size and tok.fingerprint() == trained.fingerprint()
        for text in (SAMPLE, "", "zzz unseen ⌘ text\n"):
            assert tok.decode(tok.encode(text)) == text
    run = tmp_path / "run"
    load_tokenizer(str(path), run)  # a copy for export and generation
    assert Tokenizer.from_file(run / TOKENIZER_FILE).fingerprint() == trained.fingerprint()
    with pytest.raises(ValueError, match="token ids"):
        tok.decode([tok.vocab_size])  # a padding id


def test_bpe_spec_trains_saves_and_resume_reuses(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    tok = load_tokenizer("bpe:320", run, train_text=lambda: iter([SAMPLE * 30, "abc abd abe " * 100]))
    assert 256 < tok.vocab_size <= 320
    assert (run / TOKENIZER_FILE).is_file()
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    ids = tok.encode("abc abd abe")
    assert len(ids) < len("abc abd abe")  # merges were learnt

    def no_training(*args, **kwargs):
        raise AssertionError("a resumed run retrained its BPE")

    monkeypatch.setattr(tok_mod, "train_bpe", no_training)
    again = load_tokenizer("bpe:320", run, train_text=lambda: iter(["other text"]))
    assert again.fingerprint() == tok.fingerprint() and again.encode("abc abd abe") == ids


@pytest.mark.parametrize(
    "spec, message",
    [("bpe:abc", "integer"), ("bpe:100", "more than 256"), ("/no/such/tokenizer.json", "not 'bytes'")],
)
def test_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)
    with pytest.raises(ConfigError, match=message):
        validate({"data": {"tokenizer": spec}}, world_size=1)


def test_validate_checks_a_fixed_vocabulary(tmp_path):
    validate({"data": {"tokenizer": "bpe:2048"}}, world_size=1)
    with pytest.raises(ConfigError, match="model.overrides.vocab_size is 256"):
        validate({"data": {"tokenizer": "bpe:2048"}, "model": {"overrides": {"vocab_size": 256}}}, world_size=1)


def test_tokenizer_for_run(tmp_path):
    assert tokenizer_for_run(tmp_path).is_bytes  # no config: an older (bytes) run
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("data:\n  tokenizer: bytes\n")
    assert tokenizer_for_run(tmp_path).is_bytes
    trained = train_bpe([SAMPLE * 20], 300)
    trained.save(tmp_path)
    (tmp_path / ".hydra" / "config.yaml").write_text("data:\n  tokenizer: bpe:300\n")
    inner = tmp_path / "checkpoints" / "step_000010"
    inner.mkdir(parents=True)
    for where in (tmp_path, inner):  # the run folder, or a checkpoint inside it
        assert tokenizer_for_run(where).fingerprint() == trained.fingerprint()
    (tmp_path / TOKENIZER_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=TOKENIZER_FILE):
        tokenizer_for_run(tmp_path)


def test_model_vocab_follows_the_tokenizer():
    tc, shape = validate({"data": {"tokenizer": "bpe:2000"}}, world_size=1)
    fitted = fit_vocab(shape, tc.model, 2000)
    assert fitted.vocab_size == 2048 and fitted.llama_config.vocab_size == 2048
    assert fit_vocab(shape, tc.model, 256) is shape  # bytes: unchanged
    tc, shape = validate({"model": {"overrides": {"vocab_size": 512}}}, world_size=1)
    assert fit_vocab(shape, tc.model, 300).vocab_size == 512  # an explicit vocabulary is kept
    with pytest.raises(ConfigError, match="vocab_size is 512"):
        fit_vocab(shape, tc.model, 600)


# ----------------------------------------------------------------------------- the token cache


def test_cache_dir_setting(tmp_path, monkeypatch):
    assert cache_root(DataConfig()) == tmp_path / "env-cache"
    assert cache_root(DataConfig(cache_dir=str(tmp_path / "x"))) == tmp_path / "x"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_root(DataConfig()) == Path("~/.cache/boost_compile/tokens").expanduser()


def test_token_dtype_follows_the_vocabulary():
    assert token_dtype(256) == np.uint8
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_cache_is_written_once_and_reused(tmp_path, corpus_dir, monkeypatch, caplog):
    cache = tmp_path / "cache"
    data = text_data(corpus_dir, "bpe:300", cache)
    with caplog.at_level(logging.INFO, logger="boost_compile.train"):
        first = load_corpus(data, tmp_path / "run1")
    assert not first.reused and first.tokens.dtype == torch.uint16
    assert first.cache_path.parent == cache and first.cache_path.stat().st_size == 2 * len(first.tokens)
    assert "tokens: wrote" in caplog.text
    assert (tmp_path / "run1" / TOKENIZER_FILE).is_file()
    assert not list(cache.glob(".*.tmp"))  # the temporary file was renamed

    def spy(*args, **kwargs):
        raise AssertionError("the cached corpus was tokenized again")

    monkeypatch.setattr(Tokenizer, "encode_batch", spy)
    monkeypatch.setattr(Tokenizer, "encode", spy)
    monkeypatch.setattr(tok_mod, "train_bpe", spy)
    monkeypatch.setattr(data_mod, "_tokenize", spy)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="boost_compile.train"):
        second = load_corpus(data, tmp_path / "run2")  # a new run: the cache's trained BPE and tokens
    assert second.reused and "tokens: reused cache" in caplog.text
    assert torch.equal(first.tokens, second.tokens) and first.val_start == second.val_start
    assert second.tokenizer.fingerprint() == first.tokenizer.fingerprint()
    # what decodes back is the corpus (the byte stream: each file and a newline)
    text = "".join(p.read_text(encoding="utf-8") + "\n" for p in sorted(corpus_dir.glob("*.txt")))
    assert second.tokenizer.decode(second.tokens.tolist()) == text


def test_resume_reuses_the_run_tokenizer_without_the_cache(tmp_path, corpus_dir, monkeypatch):
    run = tmp_path / "run"
    first = load_corpus(text_data(corpus_dir, "bpe:300", tmp_path / "cache1"), run)
    monkeypatch.setattr(tok_mod, "train_bpe", lambda *a, **k: pytest.fail("retrained"))
    resumed = load_corpus(text_data(corpus_dir, "bpe:300", tmp_path / "cache2"), run)  # cache gone
    assert resumed.tokenizer.fingerprint() == first.tokenizer.fingerprint()
    assert torch.equal(resumed.tokens, first.tokens)


def test_a_new_source_or_tokenizer_is_a_new_cache_entry(tmp_path, corpus_dir):
    cache = tmp_path / "cache"
    load_corpus(text_data(corpus_dir, "bpe:300", cache), tmp_path / "a")
    (corpus_dir / "part9.txt").write_text("more text\n")
    assert not load_corpus(text_data(corpus_dir, "bpe:300", cache), tmp_path / "b").reused
    assert not load_corpus(text_data(corpus_dir, "bpe:320", cache), tmp_path / "c").reused
    assert load_corpus(text_data(corpus_dir, "bpe:320", cache), tmp_path / "d").reused


def test_uint32_for_a_large_vocabulary(tmp_path, corpus_dir):
    big = train_bpe(["line of part the quick brown fox " * 20], 300)
    big.backend.add_tokens([f"<extra{i}>" for i in range(66_000)])
    path = Tokenizer(big.backend, "big").save(tmp_path / "big")
    (corpus_dir / "part0.txt").write_text("<extra65999> fox <extra7>\n" * 50)
    corpus = load_corpus(text_data(corpus_dir, str(path), tmp_path / "cache"))
    assert corpus.tokenizer.vocab_size > 65536 and corpus.tokens.dtype == torch.uint32
    assert corpus.tokens.long().max().item() >= 65536
    assert corpus.tokens[:2].tolist() == corpus.tokenizer.encode("<extra65999> fox")


def test_cached_and_uncached_give_identical_batches(tmp_path, corpus_dir):
    tc = TrainConfig()
    tc.trainer.batch, tc.trainer.seq = 4, 32
    for spec in ("bpe:300", "bytes"):
        tc.data = text_data(corpus_dir, spec, tmp_path / "cache")
        uncached = load_corpus(tc.data, tmp_path / spec.replace(":", ""), use_cache=False)
        cached = load_corpus(tc.data, tmp_path / spec.replace(":", ""), use_cache=True)
        assert cached.cache_path is not None and uncached.cache_path is None
        assert cached.tokens.dtype == uncached.tokens.dtype
        assert torch.equal(cached.tokens, uncached.tokens) and cached.val_start == uncached.val_start
        for a, b in zip(make_loaders(tc, cached, fake_dev()), make_loaders(tc, uncached, fake_dev()), strict=True):
            for _ in range(3):
                (xa, ya), (xb, yb) = next(a), next(b)
                assert torch.equal(xa, xb) and torch.equal(ya, yb) and xa.dtype == torch.long


def test_bytes_corpus_is_todays_stream(tmp_path):
    """data=stdlib with bytes: the same tokens and split as before the cache existed."""
    tc = to_train_config({"data": {"max_bytes": 100_000}})
    legacy = stdlib_tokens(100_000)
    for use_cache in (False, True):
        corpus = load_corpus(tc.data, use_cache=use_cache)
        assert torch.equal(corpus.tokens, legacy)
        train, val = split(legacy, tc.data.val_fraction)
        assert torch.equal(corpus.train, train) and torch.equal(corpus.val, val)


def test_dp_ranks_see_disjoint_shards_of_one_global_batch(tmp_path, corpus_dir):
    tc = TrainConfig()
    tc.trainer.batch, tc.trainer.seq = 8, 16
    tc.data = text_data(corpus_dir, "bpe:300", tmp_path / "cache")
    corpus = load_corpus(tc.data)
    single, _ = make_loaders(tc, corpus, fake_dev())
    ranks = [make_loaders(tc, corpus, fake_dev(dp=2, dp_rank=r))[0] for r in range(2)]
    for _ in range(4):
        whole = {tuple(row) for row in next(single)[0].tolist()}
        shards = [{tuple(row) for row in next(r)[0].tolist()} for r in ranks]
        assert all(len(s) == 4 for s in shards)
        assert not shards[0] & shards[1]
        assert shards[0] | shards[1] == whole


class _Recorder:
    """A two-process ``Dist`` stand-in: rank 0 records its broadcasts, rank 1 replays them."""

    def __init__(self, rank: int, values: list) -> None:
        self.world, self.dp, self.dp_rank, self.rank = 2, 2, rank, rank
        self.is_main = rank == 0
        self.values = values

    def broadcast(self, value):
        if self.is_main:
            self.values.append(value)
            return value
        return self.values.pop(0)


def test_other_ranks_map_rank0s_cache_without_tokenizing(tmp_path, corpus_dir, monkeypatch):
    data = text_data(corpus_dir, "bpe:300", tmp_path / "cache")
    shared: list = []
    rank0 = load_corpus(data, tmp_path / "run", _Recorder(0, shared))

    def spy(*args, **kwargs):
        raise AssertionError("rank 1 read, trained or tokenized")

    for name in ("_tokenize", "_source_digest", "_corpus_tokenizer"):
        monkeypatch.setattr(data_mod, name, spy)
    rank1 = load_corpus(data, tmp_path / "run", _Recorder(1, shared))
    assert rank1.reused and rank1.cache_path == rank0.cache_path
    assert torch.equal(rank1.tokens, rank0.tokens) and rank1.val_start == rank0.val_start
    assert rank1.tokenizer.fingerprint() == rank0.tokenizer.fingerprint()


def test_make_loaders_still_takes_a_token_stream():
    tc = TrainConfig()
    tc.trainer.batch, tc.trainer.seq = 2, 8
    stream = torch.arange(1000)
    train, val = make_loaders(tc, stream, fake_dev())
    as_corpus = make_loaders(tc, Corpus(stream, 990, Tokenizer.bytes()), fake_dev())[0]
    assert torch.equal(next(train)[0], next(as_corpus)[0])


def test_a_run_trains_with_a_bpe(tmp_path, corpus_dir):
    from boost_compile.train import run

    quick = {"steps": 3, "batch": 4, "seq": 32, "eval_batches": 2, "save_every": 0, "plot": False,
             "progress": "none", "threads": 1}
    cfg = {
        "trainer": quick,
        "passes": {"backend": "none"},
        "data": {"source": "text", "paths": [str(corpus_dir)], "tokenizer": "bpe:300",
                 "cache_dir": str(tmp_path / "cache")},
    }
    result = run(to_train_config(cfg), tmp_path / "run")
    assert result["status"] == "completed" and len(result["losses"]) == 3
    tok = Tokenizer.from_file(tmp_path / "run" / TOKENIZER_FILE)
    assert all(0 < loss < 2 * np.log(padded_vocab(tok.vocab_size)) for loss in result["losses"])


def test_hf_source_goes_through_the_tokenizer_and_cache(tmp_path, monkeypatch):
    """data=hf (a stand-in for ``datasets``, which loads offline): rows are documents."""
    rows = [{"text": f"row {i}: some text, ünï {i * 7}"} for i in range(3000)] + [{"text": ""}]

    class Dataset(list):
        column_names = ["text"]

    calls = []

    def load_dataset(name, subset, split):
        calls.append((name, subset, split))
        return Dataset(rows)

    monkeypatch.setitem(__import__("sys").modules, "datasets", SimpleNamespace(load_dataset=load_dataset))
    data = DataConfig(source="hf", dataset="local/wiki", tokenizer="bpe:300", cache_dir=str(tmp_path / "cache"))
    first = load_corpus(data, tmp_path / "run")
    expected = "".join(row["text"] + "\n" for row in rows if row["text"])
    assert first.tokenizer.decode(first.tokens.tolist()) == expected
    assert calls[0] == ("local/wiki", None, "train")
    assert load_corpus(data, tmp_path / "run").reused
    bytes_corpus = load_corpus(DataConfig(source="hf", dataset="local/wiki"))  # bytes: as before
    assert bytes(bytes_corpus.tokens.tolist()) == expected.encode("utf-8")
