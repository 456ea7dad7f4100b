"""Tests for the embedded stdlib corpus, the byte tokenizer and batch packing."""

from __future__ import annotations

import pytest
import torch

from boost_compile.train.data import PackedTokens, split, stdlib_text, stdlib_tokens
from boost_compile.train.tokenizer import ByteTokenizer


def test_stdlib_text_is_real_deterministic_text():
    text = stdlib_text(200_000)
    assert len(text) == 200_000
    assert text == stdlib_text(200_000)
    decoded = text.decode("utf-8", errors="replace")
    assert decoded.count("\ufffd") < 100  # essentially valid UTF-8
    for word in ("def ", "import ", "return", "class "):
        assert word in decoded
    assert stdlib_text(1000) == text[:1000]  # a smaller cap is a prefix


def test_stdlib_default_size():
    assert len(stdlib_text()) == 4_000_000
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_text(0)


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    text = "def f(x):\n    return x ** 2  # ünïcødé ✓"
    ids = tok.encode(text)
    assert ids.dtype == torch.long and ids.dim() == 1
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    assert torch.equal(tok.encode(text.encode("utf-8")), ids)
    assert tok.encode("").numel() == 0


def test_tokenizer_decode_invalid():
    tok = ByteTokenizer()
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"
    with pytest.raises(ValueError, match="token ids"):
        tok.decode([256])


def test_split_last_percent():
    tokens = torch.arange(1000)
    train, val = split(tokens)
    assert len(val) == 10 and len(train) == 990
    assert torch.equal(torch.cat([train, val]), tokens)
    with pytest.raises(ValueError, match="val_fraction"):
        split(tokens, 1.5)


def test_stdlib_tokens():
    tokens = stdlib_tokens(10_000)
    assert tokens.dtype == torch.uint8 and tokens.shape == (10_000,)
    assert bytes(tokens.tolist()) == stdlib_text(10_000)


def test_packing_shapes_and_shift():
    stream = torch.arange(10_000) % 251
    data = PackedTokens(stream, batch_size=4, seq_len=32, seed=3)
    inputs, targets = next(data)
    assert inputs.shape == targets.shape == (4, 32)
    assert inputs.dtype == targets.dtype == torch.long
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
    for row, target in zip(inputs, targets, strict=True):
        start = int(row[0])  # the stream is a position counter modulo 251
        expected = (torch.arange(start, start + 33)) % 251
        assert torch.equal(torch.cat([row, target[-1:]]), expected)


def test_epoch_covers_windows_once():
    stream = torch.arange(1025)
    data = PackedTokens(stream, batch_size=4, seq_len=16, seed=0)
    assert data.n_windows == 64 and len(data) == 16
    starts = torch.cat([next(data)[0][:, 0] for _ in range(len(data))])
    assert sorted(starts.tolist()) == list(range(0, 1024, 16))
    assert data.state_dict() == {"epoch": 0, "position": 16, "seed": 0}
    next(data)
    assert data.state_dict()["epoch"] == 1


def test_seed_determinism():
    stream = torch.arange(5000)
    a = PackedTokens(stream, 4, 16, seed=7)
    b = PackedTokens(stream, 4, 16, seed=7)
    c = PackedTokens(stream, 4, 16, seed=8)
    batch_a, batch_b, batch_c = next(a)[0], next(b)[0], next(c)[0]
    assert torch.equal(batch_a, batch_b)
    assert not torch.equal(batch_a, batch_c)


def test_unshuffled_is_in_order():
    data = PackedTokens(torch.arange(1000), 2, 10, shuffle=False)
    inputs, _ = next(data)
    assert inputs[:, 0].tolist() == [0, 10]


def test_shards_are_disjoint():
    stream = torch.arange(4097)
    ranks = [PackedTokens(stream, 4, 16, seed=5, rank=r, world_size=2) for r in range(2)]
    seen = []
    for data in ranks:
        assert len(data) == 4096 // 16 // 2 // 4
        seen.append({int(s) for _ in range(len(data)) for s in next(data)[0][:, 0]})
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == 4096 // 16


def test_resume_from_state_dict():
    stream = torch.arange(3000)
    data = PackedTokens(stream, 3, 16, seed=11)
    for _ in range(len(data) + 2):  # cross an epoch boundary
        next(data)
    state = data.state_dict()
    expected = next(data)
    resumed = PackedTokens(stream, 3, 16, seed=11)
    resumed.load_state_dict(state)
    got = next(resumed)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(ValueError, match="seed"):
        PackedTokens(stream, 3, 16, seed=12).load_state_dict(state)


def test_invalid_packing_arguments():
    with pytest.raises(ValueError, match="too few"):
        PackedTokens(torch.arange(100), 8, 64)
    with pytest.raises(ValueError, match="rank"):
        PackedTokens(torch.arange(1000), 2, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="1-D"):
        PackedTokens(torch.zeros(4, 100), 2, 8)
