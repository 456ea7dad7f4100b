"""boost-train's data: a text corpus, tokenized, packed into shuffled windows.

The default corpus needs no download: the ``.py`` source of the interpreter's own
standard library, read in a fixed path-hashed order and capped at a byte budget,
so the same install always yields the same bytes (``data=text`` reads local
files, ``data=hf`` a dataset ``datasets`` finds offline). The corpus is one byte
stream (each document followed by a newline, at most ``data.max_bytes``); the
last ``val_fraction`` of it is the validation split.

``data.tokenizer`` (:mod:`boost_compile.train.tokenizer`) turns it into tokens.
Bytes are read straight into memory, as they are their own tokens; any other
tokenizer goes through a token cache (:func:`load_corpus`): the stream is
tokenized once, in pieces, into a memory-mapped file keyed by the content hash
of the text and the tokenizer's fingerprint, which later runs and every rank
map. :class:`PackedTokens` cuts a token stream into contiguous windows and
serves shuffled ``(inputs, targets)`` batches, sharded disjointly across
data-parallel ranks and resumable from a ``state_dict``.

:func:`load_corpus` (and :func:`load_tokens`, its token stream) reads the
configured corpus and :func:`make_loaders` gives each rank its train and val
loaders.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import sys
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from boost_compile.config import ConfigError
from boost_compile.train.config import DataConfig, TrainConfig, text_files
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

DEFAULT_MAX_BYTES = 4_000_000
VAL_FRACTION = 0.01
CACHE_ENV = "BOOST_COMPILE_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/boost_compile/tokens"
CACHE_FORMAT = 1  # bump when the cached layout or the way pieces are cut changes
READ_BYTES = 1 << 22  # files are read in blocks of 4 MiB
PIECE_BYTES = 1 << 20  # the tokenizer sees pieces of about 1 MiB, cut after a newline
BATCH_BYTES = 1 << 23  # pieces encoded together (in parallel by the tokenizers backend)
# Third-party code may live under the stdlib directory; it is not part of the corpus.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The ``.py`` files of the standard library in a fixed, path-hashed order.

    Ordering by a hash of the relative path (not the path itself) mixes the
    packages, so a byte cap samples the whole library and the held-out tail is
    not one package's code (alphabetical order ends in ``encodings/`` tables).
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: _path_key(p.relative_to(base).as_posix()))


def _path_key(relative: str) -> tuple[str, str]:
    return hashlib.sha256(relative.encode("utf-8")).hexdigest(), relative


def stdlib_text(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Concatenated stdlib source, at most ``max_bytes`` long; deterministic per install."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_files():
        data = path.read_bytes() + b"\n"
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no .py files found under {sysconfig.get_paths()['stdlib']}")
    return b"".join(chunks)


class ByteTokenizer:
    """Bytes are tokens: ids 0..255, no special tokens."""

    vocab_size: int = 256

    def encode(self, text: str | bytes) -> Tensor:
        """UTF-8 bytes of ``text`` as a 1-D int64 tensor."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        """Text of a sequence of byte ids; invalid UTF-8 becomes U+FFFD."""
        values = ids.flatten().tolist() if isinstance(ids, Tensor) else list(ids)
        if any(not 0 <= v < self.vocab_size for v in values):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        return bytes(values).decode("utf-8", errors="replace")


def split(tokens: Tensor, val_fraction: float = VAL_FRACTION) -> tuple[Tensor, Tensor]:
    """Split a 1-D token stream into (train, val); val is the last ``val_fraction``."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def stdlib_tokens(max_bytes: int = DEFAULT_MAX_BYTES) -> Tensor:
    """The stdlib corpus as a 1-D uint8 token tensor."""
    return torch.frombuffer(bytearray(stdlib_text(max_bytes)), dtype=torch.uint8)


class PackedTokens:
    """Shuffled batches of contiguous windows from a 1-D token stream.

    The stream is cut into non-overlapping windows of ``seq + 1`` tokens (one
    token of overlap gives the shifted targets). Each epoch visits the windows
    in a fresh permutation drawn from ``seed + epoch``; rank ``r`` of
    ``world_size`` takes every ``world_size``-th window of that permutation, so
    shards are disjoint and equally sized. Iterating is endless (epochs roll
    over); :meth:`state_dict` captures the position for an exact resume.
    """

    def __init__(
        self,
        tokens: Tensor,
        batch_size: int,
        seq_len: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(
                f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}"
            )
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.n_windows = (len(tokens) - 1) // seq_len
        self.windows_per_rank = self.n_windows // world_size
        self.batches_per_epoch = self.windows_per_rank // batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"{len(tokens)} tokens make {self.n_windows} windows of {seq_len}; "
                f"too few for batch_size={batch_size} on {world_size} rank(s)"
            )
        self.epoch = 0
        self.position = 0  # batches already served in the current epoch

    def _order(self, epoch: int) -> Tensor:
        """Window indices this rank visits in ``epoch``."""
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.n_windows, generator=gen)
        else:
            order = torch.arange(self.n_windows)
        used = order[: self.windows_per_rank * self.world_size]
        return used[self.rank :: self.world_size]

    def batch(self, epoch: int, index: int) -> tuple[Tensor, Tensor]:
        """The ``index``-th batch of ``epoch`` for this rank: int64 (inputs, targets)."""
        start = index * self.batch_size
        windows = self._order(epoch)[start : start + self.batch_size]
        offsets = windows[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        chunk = self.tokens[offsets].long()
        return chunk[:, :-1], chunk[:, 1:]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        out = self.batch(self.epoch, self.position)
        self.position += 1
        return out

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return self.batches_per_epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"state was saved with seed {state['seed']}, this loader uses {self.seed}"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


# ----------------------------------------------------------------------------- boost-train's data


def source_stream(data: DataConfig) -> Iterator[bytes]:
    """The configured corpus as blocks of one byte stream: each document (a file, a
    dataset row) followed by a newline, at most ``data.max_bytes`` in all. Files are
    read block by block, so a corpus larger than memory streams through."""
    remaining = data.max_bytes
    for document in _documents(data):
        for block in itertools.chain(document, (b"\n",)):
            piece = block[:remaining]
            if piece:
                yield piece
                remaining -= len(piece)
            if remaining <= 0:
                return


def _documents(data: DataConfig) -> Iterator[Iterable[bytes]]:
    if data.source == "stdlib":
        yield from (_file_blocks(path) for path in stdlib_files())
    elif data.source == "text":
        yield from (_file_blocks(path) for path in text_files(data))
    else:
        yield from ((text.encode("utf-8"),) for text in _hf_texts(data))


def _file_blocks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            yield block


def _where(data: DataConfig) -> str:
    if data.source == "stdlib":
        return f"the standard library ({sysconfig.get_paths()['stdlib']})"
    if data.source == "text":
        return ", ".join(data.paths)
    return f"dataset {data.dataset!r}"


def val_cut(n: int, val_fraction: float) -> int:
    """Where the validation split of ``n`` bytes or tokens starts (as :func:`split` cuts)."""
    return n - max(1, int(n * val_fraction))


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


@dataclass
class Corpus:
    """A tokenized corpus: one 1-D token stream whose validation split starts at ``val_start``.

    ``tokens`` is memory-mapped from the token cache (``cache_path``; ``reused``
    says whether this load found it there) or, uncached, in memory.
    """

    tokens: Tensor
    val_start: int
    tokenizer: Tokenizer
    cache_path: Path | None = None
    reused: bool = False

    @property
    def train(self) -> Tensor:
        return self.tokens[: self.val_start]

    @property
    def val(self) -> Tensor:
        return self.tokens[self.val_start :]


def load_corpus(
    data: DataConfig,
    run_dir: Path | None = None,
    dev: Dist | None = None,
    *,
    use_cache: bool | None = None,
) -> Corpus:
    """The configured corpus, tokenized with ``data.tokenizer``.

    ``use_cache`` (default: every tokenizer but bytes) maps the token cache under
    :func:`cache_root`, writing it first when it is missing; ``False`` tokenizes
    in memory. ``run_dir`` receives ``tokenizer.json`` (a trained BPE reuses the
    one there). With several processes (``dev``) rank 0 reads the corpus, builds
    the tokenizer and writes the cache while the others wait for its broadcast,
    then every rank maps the same file (a rank that cannot see it, on another
    node's disk, writes its own copy).
    """
    try:
        kind, _ = parse_spec(data.tokenizer)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if use_cache is None:
        use_cache = kind != BYTES
    if kind == BYTES and not use_cache:
        blob = b"".join(source_stream(data))
        if not blob:
            raise ConfigError(f"data: no text in {_where(data)}")
        tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        return Corpus(tokens, val_cut(len(tokens), data.val_fraction), Tokenizer.bytes())

    world = dev.world if dev is not None else 1
    main = dev is None or dev.is_main

    def share(value: Any) -> Any:  # rank 0's value on every rank (and a wait for rank 0)
        return dev.broadcast(value) if dev is not None and world > 1 else value

    digest, total = share(_source_digest(data) if main else None)
    if total == 0:
        raise ConfigError(f"data: no text in {_where(data)}")
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
    """The configured text as one 1-D token stream (uint8 for bytes); see :func:`load_corpus`."""
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
        "where": _where(data),
        "bytes": total,
        "seconds": round(time.perf_counter() - begin, 3),
    }
    atomic_write_text(meta_path, json.dumps(meta, indent=1) + "\n")
    corpus = _open_cache(meta_path, tok)
    assert corpus is not None, f"the token cache {path} did not read back"
    corpus.reused = False
    return corpus


def _hf_texts(data: DataConfig) -> Iterator[str]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    try:
        dataset = datasets.load_dataset(data.dataset, data.subset, split=data.split)
    except Exception as exc:  # the library raises many types for "not available offline"
        raise ConfigError(
            f"data=hf could not load {data.dataset!r} (subset {data.subset!r}, split {data.split!r}) "
            f"offline: {exc}"
        ) from exc
    if data.text_field not in dataset.column_names:
        raise ConfigError(
            f"data.text_field={data.text_field!r} is not a column of {data.dataset!r}; "
            f"columns: {dataset.column_names}"
        )
    for row in dataset:
        text = row[data.text_field]
        if text:
            yield text


def make_loaders(tc: TrainConfig, tokens: Tensor | Corpus, dev: Dist) -> tuple[PackedTokens, PackedTokens]:
    """Train and val batches of this rank's disjoint shard (the global batch split over dp).

    ``tokens``: a :class:`Corpus` (its own split) or a token stream (split by ``val_fraction``).
    """
    tr = tc.trainer
    if isinstance(tokens, Corpus):
        train_tokens, val_tokens = tokens.train, tokens.val
    else:
        train_tokens, val_tokens = split(tokens, tc.data.val_fraction)
    local_batch = tr.batch // dev.dp
    val_windows = (len(val_tokens) - 1) // tr.seq // dev.dp
    try:
        train = PackedTokens(
            train_tokens, local_batch, tr.seq, seed=tr.seed, rank=dev.dp_rank, world_size=dev.dp
        )
        val = PackedTokens(
            val_tokens,
            max(1, min(local_batch, val_windows)),
            tr.seq,
            shuffle=False,
            rank=dev.dp_rank,
            world_size=dev.dp,
        )
    except ValueError as exc:
        raise ConfigError(
            f"data: {exc}; read more text (data.max_bytes={tc.data.max_bytes}) or use a smaller "
            f"trainer.batch / trainer.seq"
        ) from exc
    return train, val
