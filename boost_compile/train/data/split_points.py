"""Where a token stream's validation split starts: shared by the packing of text corpora and
the checks of pre-tokenized files, which must cut alike."""

from __future__ import annotations


def val_cut(n: int, val_fraction: float) -> int:
    """Where the validation split of ``n`` bytes or tokens starts (as :func:`split` cuts)."""
    return n - max(1, int(n * val_fraction))
