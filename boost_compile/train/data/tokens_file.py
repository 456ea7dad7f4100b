"""Pre-tokenized corpora (``data=tokens``): token ids already on disk, memory-mapped, never
copied whole into memory.

The layouts (``data.paths``):

- a folder holding ``train.bin`` and ``val.bin`` (what nanoGPT's ``prepare.py`` writes:
  flat little-endian ids, uint16, or int32 with ``data.token_dtype=int32``), or
  ``train.npy`` and ``val.npy``;
- one ``.bin`` or ``.npy`` file, its last ``data.val_fraction`` held out;
- two files: the training split, then the validation split.

A ``.npy`` file (an int32, uint16, int64 ... array) names its own type; a ``.bin`` file is
read as ``data.token_dtype``. ``data.tokenizer`` names the tokenizer that made the ids: the
model's vocabulary follows it, and :func:`~boost_compile.train.data.cache.load_token_corpus`
refuses a file holding an id
outside it (the ids are checked a chunk at a time, read from the file, not from the map).
The batches index the map (:class:`~boost_compile.train.data.packing.PackedTokens`), so
only the windows a batch takes are read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from boost_compile.config import ConfigError
from boost_compile.train.config import DataConfig
from boost_compile.train.data.split_points import val_cut
from boost_compile.train.tokenizer import Tokenizer, parse_spec

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("boost_compile.train")

RAW_SUFFIX = ".bin"
NPY_SUFFIX = ".npy"
#: The file names of a folder, in the order they are looked for: (train, val).
FOLDER_LAYOUTS = (("train.bin", "val.bin"), ("train.npy", "val.npy"))
#: The integer types a ``.npy`` file may hold (each has a torch type the batches index).
NPY_TYPES = ("uint8", "uint16", "uint32", "int16", "int32", "int64")
SCAN_IDS = 1 << 22  # ids read per chunk when checking their range (at most 32 MiB of int64)


@dataclass(frozen=True)
class TokenFiles:
    """The files of a pre-tokenized corpus: ``val`` None holds out the tail of ``train``."""

    train: Path
    val: Path | None = None


def token_files(data: DataConfig) -> TokenFiles:
    """The files ``data.paths`` names (see the module docstring); ConfigError when one is missing."""
    if not data.paths:
        raise ConfigError(
            "data=tokens needs data.paths=[folder] (holding train.bin and val.bin), [file.bin or file.npy] "
            "or [train_file, val_file]"
        )
    if len(data.paths) > 2:
        raise ConfigError(
            f"data=tokens takes one folder, one file or two files (train, val); got {len(data.paths)} paths: "
            f"{', '.join(data.paths)}"
        )
    missing = [p for p in data.paths if not Path(p).expanduser().exists()]
    if missing:
        raise ConfigError(f"data path(s) not found: {', '.join(missing)}")
    paths = [Path(p).expanduser() for p in data.paths]
    if len(paths) == 1 and paths[0].is_dir():
        return _folder_files(paths[0])
    for path in paths:
        if path.is_dir():
            raise ConfigError(f"data=tokens: {path} is a folder; give one folder alone, or two token files")
        if path.suffix not in (RAW_SUFFIX, NPY_SUFFIX):
            raise ConfigError(
                f"data=tokens reads {RAW_SUFFIX} (raw ids) and {NPY_SUFFIX} files; {path} is neither "
                "(text goes through data=text)"
            )
    return TokenFiles(paths[0], paths[1] if len(paths) == 2 else None)


def _folder_files(folder: Path) -> TokenFiles:
    for train_name, val_name in FOLDER_LAYOUTS:
        train, val = folder / train_name, folder / val_name
        if train.is_file():
            if not val.is_file():
                raise ConfigError(
                    f"data=tokens: {folder} has {train_name} but no {val_name}; give the file itself "
                    f"(data.paths=[{train}]) to hold out its last data.val_fraction"
                )
            return TokenFiles(train, val)
    names = " or ".join(f"{t} and {v}" for t, v in FOLDER_LAYOUTS)
    raise ConfigError(f"data=tokens: {folder} holds neither {names} (nanoGPT's prepare.py writes train.bin, val.bin)")


def map_tokens(path: Path, data: DataConfig) -> np.ndarray:
    """``path``'s ids as a 1-D memory map, copy-on-write (the file is never written; the pages
    stay the file's, shared between ranks); ConfigError for a file that is empty, of the wrong
    size for ``data.token_dtype`` or not a 1-D integer array."""
    import numpy as np

    size = path.stat().st_size
    if path.suffix == NPY_SUFFIX:
        try:
            array = np.load(path, mmap_mode="c")
        except (ValueError, OSError, EOFError) as exc:
            raise ConfigError(f"data: {path} is not a .npy array file ({exc})") from exc
        if not isinstance(array, np.ndarray):
            raise ConfigError(f"data: {path} holds several arrays (an .npz); save one 1-D array of ids with np.save")
        if array.dtype.name not in NPY_TYPES or not array.dtype.isnative:
            raise ConfigError(
                f"data: {path} holds {array.dtype.name} values ({array.dtype.str}); token ids are integers in "
                f"native byte order: save them as one of {', '.join(NPY_TYPES)}"
            )
        if array.ndim != 1:
            raise ConfigError(
                f"data: {path} holds an array of shape {tuple(array.shape)}; token ids are one flat stream "
                "(save array.reshape(-1))"
            )
    else:
        dtype = np.dtype(data.token_dtype).newbyteorder("<")
        if size % dtype.itemsize:
            raise ConfigError(
                f"data: {path} is {size} bytes, not a whole number of {data.token_dtype} ids ({dtype.itemsize} "
                "bytes each); set data.token_dtype to the type that wrote it (uint16 or int32)"
            )
        array = np.memmap(path, dtype=dtype, mode="c") if size else np.zeros(0, dtype=dtype)
    if len(array) == 0:
        raise ConfigError(f"data: {path} holds no token ids")
    return array


def id_range(array: np.ndarray) -> tuple[int, int]:
    """The smallest and largest id of a memory-mapped ``array``, read from its file a chunk of
    ``SCAN_IDS`` at a time (the map's pages are not touched; memory stays one chunk)."""
    import numpy as np

    lo, hi = None, None
    with open(array.filename, "rb") as f:
        f.seek(array.offset)
        left = len(array)
        while left > 0:
            chunk = np.fromfile(f, dtype=array.dtype, count=min(SCAN_IDS, left))
            if chunk.size == 0:
                break
            left -= chunk.size
            low, high = int(chunk.min()), int(chunk.max())
            lo = low if lo is None else min(lo, low)
            hi = high if hi is None else max(hi, high)
    assert lo is not None and hi is not None, f"{array.filename}: no ids read"
    return lo, hi


def id_problem(path: Path, array: np.ndarray, tokenizer: Tokenizer, spec: str) -> str | None:
    """Why ``array``'s ids cannot be tokens of ``tokenizer`` (one line naming the file, the
    offending id and the vocabulary), or None when they all lie in ``[0, vocab_size)``."""
    lo, hi = id_range(array)
    vocab = tokenizer.vocab_size
    if lo < 0:
        return f"data: {path} holds token id {lo}; ids are 0 or more (is data.token_dtype={array.dtype.name} right?)"
    if hi >= vocab:
        return (
            f"data: {path} holds token id {hi}, but data.tokenizer={spec} has a vocabulary of {vocab} "
            f"(ids 0..{vocab - 1}); name the tokenizer that made the ids (data.tokenizer=<its tokenizer.json>)"
        )
    return None


def check_token_files(data: DataConfig, seq: int, batch: int, dp: int = 1) -> None:
    """What :func:`validate` checks of ``data=tokens`` before anything starts: a tokenizer that
    names the ids, files that exist and map, a training split of at least ``batch`` windows of
    ``seq`` and a validation split of at least one window per dp rank."""
    try:
        kind, _ = parse_spec(data.tokenizer)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if kind == "bpe":
        raise ConfigError(
            f"data=tokens reads ids a tokenizer already made; data.tokenizer={data.tokenizer} trains one on text: "
            "name the one that made them (bytes, or its tokenizer.json / folder)"
        )
    files = token_files(data)
    train = len(map_tokens(files.train, data))
    if files.val is not None:
        val = len(map_tokens(files.val, data))
        where = str(files.val)
    else:
        cut = val_cut(train, data.val_fraction)
        train, val = cut, train - cut
        where = f"the last data.val_fraction={data.val_fraction} of {files.train}"
    if (train - 1) // seq < batch:
        raise ConfigError(
            f"data: the training split ({files.train}) holds {train:,} tokens, fewer than trainer.batch={batch} "
            f"windows of trainer.seq={seq} need ({batch * seq + 1:,}); use a smaller trainer.batch / trainer.seq"
        )
    if (val - 1) // seq < dp:
        raise ConfigError(
            f"data: the validation split ({where}) holds {val:,} tokens, fewer than one window of trainer.seq={seq} "
            f"per dp rank needs ({dp * seq + 1:,}); give more validation tokens"
            + (" (a larger data.val_fraction)" if files.val is None else "")
            + " or use a smaller trainer.seq"
        )
