"""The token cache: the corpus tokenized once, in pieces, into a memory-mapped file that
later runs and every rank map (:func:`load_corpus`); a trained BPE is cached beside it.

Bytes are read straight into memory, as they are their own tokens; any other
tokenizer goes through the cache, a file keyed by the content hash of the text and
the tokenizer's fingerprint.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from boost_compile.config import ConfigError
from boost_compile.train.config import DataConfig
from boost_compile.train.data.packing import Corpus
from boost_compile.train.data.sources import source_stream, source_where
from boost_compile.train.data.split_points import val_cut
from boost_compile.train.data.tokens_file import id_problem, map_tokens, token_files
from boost_compile.train.tokenizer import (
    BYTES,
    TOKENIZER_FILE,
    Tokenizer,
    atomic_write_text,
    load_tokenizer,
    parse_spec,
)

if TYPE_CHECKING:
    from boost_compile.train.parallel import Dist

log = logging.getLogger("boost_compile.train")

CACHE_ENV = "BOOST_COMPILE_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/boost_compile/tokens"
CACHE_FORMAT = 1  # bump when the cached layout or the way pieces are cut changes
PIECE_BYTES = 1 << 20  # the tokenizer sees pieces of about 1 MiB, cut after a newline
BATCH_BYTES = 1 << 23  # pieces encoded together (in parallel by the tokenizers backend)


def cache_root(data: DataConfig) -> Path:
    """The token cache's folder: ``data.cache_dir``, else ``$BOOST_COMPILE_CACHE``, else
    ``~/.cache/boost_compile/tokens``."""
    where = data.cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR
    return Path(where).expanduser()


def token_dtype(vocab_size: int) -> Any:
    """The narrowest unsigned numpy type of a token file: uint8 (bytes), uint16 or uint32."""
    import numpy as np

    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ValueError(f"a vocabulary of {vocab_size} tokens does not fit uint32 ids")


def load_corpus(
    data: DataConfig,
    run_dir: Path | None = None,
    dev: Dist | None = None,
    *,
    use_cache: bool | None = None,
) -> Corpus:
    """The configured corpus, tokenized with ``data.tokenizer`` (``data=tokens``: the ids on
    disk, memory-mapped, :func:`load_token_corpus`).

    ``use_cache`` (default: every tokenizer but bytes) maps the token cache under
    :func:`cache_root`, writing it first when it is missing; ``False`` tokenizes
    in memory. ``run_dir`` receives ``tokenizer.json`` (a trained BPE reuses the
    one there). With several processes (``dev``) rank 0 reads the corpus, builds
    the tokenizer and writes the cache while the others wait for its broadcast,
    then every rank maps the same file (a rank that cannot see it, on another
    node's disk, writes its own copy).
    """
    if data.source == "tokens":  # ids already on disk: mapped as they are, no cache
        return load_token_corpus(data, run_dir, dev)
    try:
        kind, _ = parse_spec(data.tokenizer)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if use_cache is None:
        use_cache = kind != BYTES
    if kind == BYTES and not use_cache:
        blob = b"".join(source_stream(data))
        if not blob:
            raise ConfigError(f"data: no text in {source_where(data)}")
        tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        return Corpus(tokens, val_cut(len(tokens), data.val_fraction), Tokenizer.bytes())

    world = dev.world if dev is not None else 1
    main = dev is None or dev.is_main

    def share(value: Any) -> Any:  # rank 0's value on every rank (and a wait for rank 0)
        return dev.broadcast(value) if dev is not None and world > 1 else value

    digest, total = share(_source_digest(data) if main else None)
    if total == 0:
        raise ConfigError(f"data: no text in {source_where(data)}")
    cut = val_cut(total, data.val_fraction)

    tok = _corpus_tokenizer(data, run_dir, digest, cut, use_cache) if main else None
    shared = share((tok.to_str(), tok.name) if tok is not None else None)
    if tok is None:
        tok = Tokenizer.bytes() if not shared[0] else Tokenizer.from_str(*shared)

    if not use_cache:
        parts: list[Any] = []
        start = _tokenize(data, tok, cut, parts.append, progress=False)
        import numpy as np

        array = np.concatenate(parts) if parts else np.zeros(0, dtype=token_dtype(tok.vocab_size))
        return Corpus(torch.from_numpy(array), start, tok)

    key = hashlib.sha256(
        json.dumps(
            {"format": CACHE_FORMAT, "source": digest, "bytes": total, "cut": cut,
             "piece": PIECE_BYTES, "tokenizer": tok.fingerprint()},
            sort_keys=True,
        ).encode()
    ).hexdigest()[:32]
    meta_path = cache_root(data) / f"{data.source}-v{tok.vocab_size}-{key}.json"
    begin = time.perf_counter()
    corpus = _cached_corpus(data, tok, cut, total, meta_path) if main else None
    share(None)  # the others wait until rank 0 has written the file
    if corpus is None:  # maps rank 0's file; writes one where it is not visible (another node's disk)
        corpus = _cached_corpus(data, tok, cut, total, meta_path)
    if main:
        verb = "reused" if corpus.reused else f"wrote ({total / 1e6:.1f} MB in {time.perf_counter() - begin:.1f}s)"
        log.info(
            "tokens: %s cache %s (%s tokens, %s train / %s val, %s)",
            verb, corpus.cache_path, f"{len(corpus.tokens):,}", f"{corpus.val_start:,}",
            f"{len(corpus.tokens) - corpus.val_start:,}", tok.name,
        )
    return corpus


def load_tokens(data: DataConfig, run_dir: Path | None = None, dev: Dist | None = None) -> Tensor:
    """The configured text as one 1-D token stream (uint8 for bytes); see :func:`load_corpus`
    (``data=tokens`` with a validation file of its own: the training stream)."""
    return load_corpus(data, run_dir, dev).tokens


def _source_digest(data: DataConfig) -> tuple[str, int]:
    """The content hash and the length of :func:`source_stream` (read once, not held)."""
    h = hashlib.blake2b(digest_size=20)
    total = 0
    for block in source_stream(data):
        h.update(block)
        total += len(block)
    return h.hexdigest(), total


def _parts(data: DataConfig, cut: int) -> Iterator[tuple[int, bytes]]:
    """``(part, piece)``: the stream cut at byte ``cut`` into train (0) and val (1), each in
    pieces of about ``PIECE_BYTES`` that end after a newline (a piece never spans the cut)."""

    def split_blocks() -> Iterator[tuple[int, bytes]]:
        pos = 0
        for block in source_stream(data):
            if pos < cut < pos + len(block):
                yield 0, block[: cut - pos]
                yield 1, block[cut - pos :]
            else:
                yield (0 if pos < cut else 1), block
            pos += len(block)

    for part, group in itertools.groupby(split_blocks(), key=lambda item: item[0]):
        for piece in _pieces(block for _, block in group):
            yield part, piece


def _pieces(blocks: Iterable[bytes], size: int = PIECE_BYTES) -> Iterator[bytes]:
    """Blocks re-cut into pieces of at most ``size`` bytes, each ending after its last
    newline (or, in a longer line, on a UTF-8 character boundary)."""
    buf = bytearray()
    for block in blocks:
        buf += block
        while len(buf) >= size:
            end = buf.rfind(b"\n", 0, size) + 1
            if end == 0:
                end = size
                while end > 1 and buf[end] & 0xC0 == 0x80:  # inside a multi-byte character
                    end -= 1
            yield bytes(buf[:end])
            del buf[:end]
    if buf:
        yield bytes(buf)


def _train_texts(data: DataConfig, cut: int) -> Iterator[str]:
    """The training split's text, piece by piece (what a BPE is trained on)."""
    for part, piece in _parts(data, cut):
        if part:
            return
        yield piece.decode("utf-8", errors="replace")


def _tokenize(
    data: DataConfig, tok: Tokenizer, cut: int, sink: Callable[[Any], Any], *, progress: bool, total: int = 0
) -> int:
    """Feed the stream's token ids to ``sink`` as numpy arrays, a batch of pieces at a
    time; returns the number of tokens before the validation split."""
    import numpy as np
    from tqdm.auto import tqdm

    dtype = token_dtype(tok.vocab_size)
    count = 0
    start: int | None = None
    bar = tqdm(
        total=total or None, unit="B", unit_scale=True, desc=f"tokenizing ({tok.name})",
        disable=not (progress and sys.stderr.isatty()), leave=False,
    )

    def flush(part: int, batch: list[bytes]) -> None:
        nonlocal count, start
        if part and start is None:
            start = count
        if tok.is_bytes:
            arrays = [np.frombuffer(piece, dtype=np.uint8) for piece in batch]
        else:
            ids = tok.encode_batch([piece.decode("utf-8", errors="replace") for piece in batch])
            arrays = [np.asarray(row, dtype=dtype) for row in ids]
        for array in arrays:
            sink(array)
            count += len(array)
        bar.update(sum(len(piece) for piece in batch))

    with bar:
        batch: list[bytes] = []
        size = 0
        current = 0
        for part, piece in _parts(data, cut):
            if batch and (part != current or size >= BATCH_BYTES):
                flush(current, batch)
                batch, size = [], 0
            current = part
            batch.append(piece)
            size += len(piece)
        if batch:
            flush(current, batch)
    return count if start is None else start


def _corpus_tokenizer(data: DataConfig, run_dir: Path | None, digest: str, cut: int, use_cache: bool) -> Tokenizer:
    """The tokenizer of this run; a BPE is trained once per (training text, vocabulary):
    the run folder's ``tokenizer.json`` first, then the cache's copy, else trained."""
    kind, vocab = parse_spec(data.tokenizer)
    if kind != "bpe" or (run_dir is not None and (Path(run_dir) / TOKENIZER_FILE).is_file()):
        return load_tokenizer(data.tokenizer, run_dir)
    key = hashlib.sha256(f"bpe-v1|{vocab}|{digest}|{cut}|{PIECE_BYTES}".encode()).hexdigest()[:32]
    cached = cache_root(data) / "tokenizers" / f"bpe{vocab}-{key}.json"
    if use_cache and cached.is_file():
        tok = Tokenizer.from_file(cached, name=data.tokenizer)
        where = tok.save(run_dir) if run_dir is not None else None
        log.info(
            "tokenizer: reused trained %s from %s (%s tokens)%s",
            data.tokenizer, cached, f"{tok.vocab_size:,}", f" -> {where}" if where else "",
        )
        return tok
    tok = load_tokenizer(data.tokenizer, run_dir, train_text=lambda: _train_texts(data, cut))
    if use_cache:
        atomic_write_text(cached, tok.to_str())
    return tok


def _open_cache(meta_path: Path, tok: Tokenizer) -> Corpus | None:
    """The cached corpus ``meta_path`` describes, memory-mapped; None if absent or incomplete."""
    import numpy as np

    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    path = meta_path.with_suffix(".tokens")
    dtype = np.dtype(meta.get("dtype", "uint8"))
    n = int(meta.get("tokens", -1))
    if n < 1 or not path.is_file() or path.stat().st_size != n * dtype.itemsize:
        return None
    # copy-on-write: the pages stay shared with the file (and between ranks) unless written
    array = np.memmap(path, dtype=dtype, mode="c", shape=(n,))
    return Corpus(torch.from_numpy(array), int(meta["val_start"]), tok, path, reused=True)


def _cached_corpus(data: DataConfig, tok: Tokenizer, cut: int, total: int, meta_path: Path) -> Corpus:
    """Map the cache; write it first when it is missing (atomically: a temporary file,
    then a rename; the ``.json`` beside the ``.tokens``, written last, marks it complete)."""
    corpus = _open_cache(meta_path, tok)
    if corpus is not None:
        return corpus
    path = meta_path.with_suffix(".tokens")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    begin = time.perf_counter()
    try:
        with open(tmp, "wb") as f:
            start = _tokenize(data, tok, cut, lambda array: f.write(array.tobytes()), progress=True, total=total)
            n = f.tell() // token_dtype(tok.vocab_size).itemsize
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {
        "format": CACHE_FORMAT,
        "tokens": n,
        "val_start": start,
        "dtype": token_dtype(tok.vocab_size).name,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "fingerprint": tok.fingerprint(),
        "source": data.source,
        "where": source_where(data),
        "bytes": total,
        "seconds": round(time.perf_counter() - begin, 3),
    }
    atomic_write_text(meta_path, json.dumps(meta, indent=1) + "\n")
    corpus = _open_cache(meta_path, tok)
    assert corpus is not None, f"the token cache {path} did not read back"
    corpus.reused = False
    return corpus


def load_token_corpus(data: DataConfig, run_dir: Path | None = None, dev: Dist | None = None) -> Corpus:
    """The pre-tokenized corpus ``data.paths`` names, memory-mapped, with ``data.tokenizer``.

    Rank 0 loads the tokenizer (a ``tokenizer.json`` is copied into ``run_dir`` for export and
    generation) and checks every id against its vocabulary; the others take both from its
    broadcast, so all raise the same ConfigError. Every rank maps the same files.
    """
    world = dev.world if dev is not None else 1
    main = dev is None or dev.is_main

    def share(value: Any) -> Any:
        return dev.broadcast(value) if dev is not None and world > 1 else value

    files = token_files(data)
    train = map_tokens(files.train, data)
    val = map_tokens(files.val, data) if files.val is not None else None
    tok: Tokenizer | None = None
    problem: str | None = None
    if main:  # a refusal goes to every rank (a rank that raised alone would leave the others waiting)
        try:
            tok = _tokenizer(data, run_dir)
            for path, array in ((files.train, train), (files.val, val)):
                if path is not None and array is not None and problem is None:
                    problem = id_problem(path, array, tok, data.tokenizer)
        except ConfigError as exc:
            problem = str(exc)
    shared, problem = share(((tok.to_str(), tok.name) if tok is not None else None, problem))
    if problem is not None:
        raise ConfigError(problem)
    if tok is None:
        tok = Tokenizer.bytes() if not shared[0] else Tokenizer.from_str(*shared)
    tokens = torch.from_numpy(train)  # shares the map's memory: no copy of the corpus
    if val is None:
        corpus = Corpus(tokens, val_cut(len(tokens), data.val_fraction), tok)
    else:
        corpus = Corpus(tokens, len(tokens), tok, held_out=torch.from_numpy(val))
    if main:
        log.info(
            "tokens: mapped %s (%s train / %s val tokens, %s, %s)",
            " + ".join(str(p) for p in (files.train, files.val) if p is not None),
            f"{len(corpus.train):,}", f"{len(corpus.val):,}", train.dtype.name, tok.name,
        )
    return corpus


def _tokenizer(data: DataConfig, run_dir: Path | None) -> Tokenizer:
    try:
        kind, _ = parse_spec(data.tokenizer)
        if kind == "bpe":
            raise ValueError(f"data=tokens cannot train data.tokenizer={data.tokenizer}: name the one that made the ids")
        return Tokenizer.bytes() if kind == BYTES else load_tokenizer(data.tokenizer, run_dir)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
