"""A token stream split into train and val and cut into shuffled windows: :class:`Corpus`,
:class:`PackedTokens` (sharded over the dp ranks, resumable) and each rank's loaders.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from boost_compile.config import ConfigError
from boost_compile.train.config import TrainConfig
from boost_compile.train.tokenizer import Tokenizer

if TYPE_CHECKING:
    from boost_compile.train.parallel import Dist

VAL_FRACTION = 0.01


def split(tokens: Tensor, val_fraction: float = VAL_FRACTION) -> tuple[Tensor, Tensor]:
    """Split a 1-D token stream into (train, val); val is the last ``val_fraction``."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


@dataclass
class Corpus:
    """A tokenized corpus: one 1-D token stream whose validation split starts at ``val_start``,
    or, with ``held_out``, a training stream and a validation stream of their own.

    ``tokens`` is memory-mapped from the token cache (``cache_path``; ``reused``
    says whether this load found it there), from a pre-tokenized file
    (:mod:`.tokens_file`: ``val.bin`` is ``held_out``) or, uncached, in memory.
    """

    tokens: Tensor
    val_start: int
    tokenizer: Tokenizer
    cache_path: Path | None = None
    reused: bool = False
    held_out: Tensor | None = None

    @property
    def train(self) -> Tensor:
        return self.tokens[: self.val_start]

    @property
    def val(self) -> Tensor:
        return self.held_out if self.held_out is not None else self.tokens[self.val_start :]


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
        self._orders: dict[int, Tensor] = {}  # the last epoch's order, drawn once, not per batch

    def _order(self, epoch: int) -> Tensor:
        """Window indices this rank visits in ``epoch`` (kept for the epoch: on a large corpus
        the permutation costs more than the batch)."""
        if epoch not in self._orders:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.n_windows, generator=gen)
            else:
                order = torch.arange(self.n_windows)
            used = order[: self.windows_per_rank * self.world_size]
            self._orders = {epoch: used[self.rank :: self.world_size].clone()}  # this rank's share only
        return self._orders[epoch]

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
        more = "give more tokens" if tc.data.source == "tokens" else f"read more text (data.max_bytes={tc.data.max_bytes})"
        raise ConfigError(f"data: {exc}; {more} or use a smaller trainer.batch / trainer.seq") from exc
    return train, val
