"""Embedded real-text data: the installed Python standard library, byte-tokenised.

No downloads: the corpus is the ``.py`` source of the interpreter's own standard
library, read in a fixed path-hashed order and capped at a byte budget, so the same
install always yields the same bytes. Tokens are bytes (vocab 256).
:class:`PackedTokens` cuts the stream into contiguous windows and serves shuffled
``(inputs, targets)`` batches, sharded disjointly across data-parallel ranks and
resumable from a ``state_dict``.

:func:`load_tokens` reads the configured corpus (``data=stdlib``, ``text`` or
``hf``) and :func:`make_loaders` gives each rank its train and val loaders.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from boost_compile.config import ConfigError
from boost_compile.train.config import DataConfig, TrainConfig, text_files

if TYPE_CHECKING:
    from boost_compile.train.parallel import Dist

DEFAULT_MAX_BYTES = 4_000_000
VAL_FRACTION = 0.01
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


def load_tokens(data: DataConfig) -> torch.Tensor:
    """The configured text as a 1-D uint8 stream of byte tokens (at most ``max_bytes``)."""
    if data.source == "stdlib":
        return stdlib_tokens(data.max_bytes)
    if data.source == "text":
        blob = _join_capped((path.read_bytes() for path in text_files(data)), data.max_bytes)
        where = ", ".join(data.paths)
    else:
        blob = _join_capped((text.encode("utf-8") for text in _hf_texts(data)), data.max_bytes)
        where = f"dataset {data.dataset!r}"
    if not blob:
        raise ConfigError(f"data: no text in {where}")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _join_capped(chunks: Iterator[bytes], max_bytes: int) -> bytes:
    parts: list[bytes] = []
    total = 0
    for chunk in chunks:
        piece = (chunk + b"\n")[: max_bytes - total]
        parts.append(piece)
        total += len(piece)
        if total >= max_bytes:
            break
    return b"".join(parts)


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


def make_loaders(tc: TrainConfig, tokens: torch.Tensor, dev: Dist) -> tuple[PackedTokens, PackedTokens]:
    """Train and val batches of this rank's disjoint shard (the global batch split over dp)."""
    tr = tc.trainer
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
