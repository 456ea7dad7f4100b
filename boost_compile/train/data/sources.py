"""Where boost-train's text comes from: the standard library's source, local files or an
offline Hugging Face dataset, read as one byte stream of at most ``data.max_bytes``.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from boost_compile.config import ConfigError
from boost_compile.train.config import DataConfig
from boost_compile.train.validate import text_files

DEFAULT_MAX_BYTES = 4_000_000
READ_BYTES = 1 << 22  # files are read in blocks of 4 MiB
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


def stdlib_tokens(max_bytes: int = DEFAULT_MAX_BYTES) -> Tensor:
    """The stdlib corpus as a 1-D uint8 token tensor."""
    return torch.frombuffer(bytearray(stdlib_text(max_bytes)), dtype=torch.uint8)


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


def source_where(data: DataConfig) -> str:
    """Where the configured corpus is read from, in words (for messages)."""
    if data.source == "stdlib":
        return f"the standard library ({sysconfig.get_paths()['stdlib']})"
    if data.source in ("text", "tokens"):
        return ", ".join(data.paths)
    return f"dataset {data.dataset!r}"


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
