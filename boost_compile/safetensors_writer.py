"""Safetensors files written one tensor at a time: the header first (every name, dtype and shape is
known before any value), then each tensor's bytes as it arrives, so a writer holds one tensor.

``safetensors.torch.save_file`` takes every tensor at once; an export of a model larger than a
host's memory cannot. The folder layout is Hugging Face's: ``model.safetensors``, or shards
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` when the tensors exceed
``max_shard_bytes``; both load with ``transformers``' ``from_pretrained`` and ``safetensors``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

#: torch dtype -> safetensors' name for it
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _header(entries: Sequence[Entry], metadata: dict[str, str]) -> bytes:
    """The length-prefixed JSON header, padded with spaces to 8 bytes as safetensors writes it."""
    table: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for e in entries:
        if e.dtype not in DTYPE_NAMES:
            raise TypeError(f"{e.name}: safetensors has no dtype {e.dtype}")
        table[e.name] = {"dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_file(path: Path, entries: Sequence[Entry], values: Iterable[tuple[str, torch.Tensor]],
               metadata: dict[str, str] | None = None) -> None:
    """Write ``entries`` into ``path`` from ``values`` (name, tensor) pairs in the entries' order."""
    with open(path, "wb") as f:
        f.write(_header(entries, metadata or {"format": "pt"}))
        expected = iter(entries)
        for name, tensor in values:
            entry = next(expected, None)
            if entry is None or entry.name != name:
                raise ValueError(f"{path.name}: got {name}, expected {entry.name if entry else 'no more tensors'}")
            if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                raise ValueError(f"{name}: {tensor.dtype} {tuple(tensor.shape)} written where the header "
                                 f"says {entry.dtype} {entry.shape}")
            data = tensor.detach().to("cpu").contiguous().reshape(-1)
            if data.numel():
                f.write(memoryview(data.view(torch.uint8).numpy()))
        left = next(expected, None)
        if left is not None:
            raise ValueError(f"{path.name}: {left.name} was never written")


def shard_plan(entries: Sequence[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """``entries`` cut, in order, into files of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_folder(out: Path, entries: Sequence[Entry],
                 read: Callable[[Sequence[Entry]], Iterable[tuple[str, torch.Tensor]]],
                 max_shard_bytes: int, metadata: dict[str, str] | None = None) -> list[str]:
    """Write ``entries`` into ``out`` as one file or as shards with their index; ``read(entries)``
    yields each entry's tensor in order. Returns the files written."""
    shards = shard_plan(entries, max_shard_bytes)
    if len(shards) == 1:
        write_file(out / SINGLE_FILE, shards[0], read(shards[0]), metadata)
        (out / INDEX_FILE).unlink(missing_ok=True)
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        write_file(out / name, shard, read(shard), metadata)
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
             "weight_map": {e.name: name for name, shard in zip(names, shards, strict=True) for e in shard}}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / SINGLE_FILE).unlink(missing_ok=True)
    return names


def load_folder_into(model: torch.nn.Module, folder: Path) -> None:
    """Load a folder :func:`write_folder` (or ``save_model``) wrote into ``model``, strictly: every
    tensor of the model that is not a tied alias of one loaded must be in the folder, and nothing
    else may be. One file is read at a time."""
    from safetensors.torch import load_file

    index = folder / INDEX_FILE
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [SINGLE_FILE]
    first: dict[int, str] = {}
    owner = {}  # every name of a tensor -> the first name of the same tensor (a tied alias's owner)
    for name, t in model.state_dict(keep_vars=True).items():
        owner[name] = first.setdefault(id(t), name)
    loaded: set[str] = set()
    for file in files:
        values = load_file(str(folder / file))
        unexpected = sorted(set(values) - set(owner))
        if unexpected:
            raise KeyError(f"{folder / file} holds {', '.join(unexpected[:3])}, which the model does not have")
        model.load_state_dict(values, strict=False)
        loaded.update(values)
    covered = {owner[n] for n in loaded} | loaded
    missing = [n for n in owner if n not in loaded and owner[n] not in covered]
    if missing:
        raise KeyError(f"{folder} lacks {', '.join(missing[:3])}")
