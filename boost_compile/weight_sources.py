"""Where a model built on the meta device gets its values, slice by slice.

A *source* answers ``values(name, box, dtype)``: the values of the slice ``box`` of the parameter
``name`` (one ``slice`` per leading dim; None: the whole), computing or reading no more of it than
it must. Three kinds:

- :class:`boost_compile.meta_init.InitRecipe`: the model's own random init, replayed per parameter;
- :class:`SafetensorsFolder`: a Hugging Face folder (``model.safetensors``, or shards and their
  ``model.safetensors.index.json``), read through safetensors' lazy slices;
- :class:`boost_compile.factorize.FactorSource`: the factors ``factorize_`` gives a dense layer
  (an SVD of its weight, one layer at a time).

:class:`Sources` asks them in turn. :func:`slice_values` assembles a rank's part of a parameter
when it is not one box (a fused weight cut part by part under TP, a padded vocabulary, a TP shard
sharded again by FSDP2) from the boxes it is made of.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch

#: Wrappers that compiling and checkpointing put into parameter names.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")

#: Per dim, the index in the whole parameter of each of a local tensor's elements (-1: padding),
#: or None where the local tensor spans the whole dim.
Index = tuple[torch.Tensor | None, ...]


def canonical_name(name: str) -> str:
    """``name`` without the segments compile and checkpoint wrappers add (``_orig_mod.``)."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


class WeightSource(Protocol):
    """Values of parameters by name, slice by slice."""

    def has(self, name: str) -> bool: ...

    def shape(self, name: str) -> torch.Size: ...

    def values(self, name: str, box: tuple[slice, ...] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


class MissingWeightError(KeyError):
    """No source holds a parameter's values."""

    def __str__(self) -> str:
        return str(self.args[0])


class Sources:
    """The first of ``sources`` that holds each name."""

    def __init__(self, *sources: WeightSource | None) -> None:
        self.sources = [s for s in sources if s is not None]

    def _of(self, name: str) -> WeightSource:
        for source in self.sources:
            if source.has(name):
                return source
        raise MissingWeightError(f"no values for {name}")

    def has(self, name: str) -> bool:
        return any(s.has(name) for s in self.sources)

    def shape(self, name: str) -> torch.Size:
        return self._of(name).shape(name)

    def values(self, name: str, box: tuple[slice, ...] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._of(name).values(name, box, dtype)


# ----------------------------------------------------------------------------- a Hugging Face folder


#: safetensors' dtype names
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
#: Bytes read from a file at once when a box is assembled row group by row group.
READ_BYTES = 1 << 24


class _SafetensorsFile:
    """One safetensors file, read by ``seek`` and ``readinto``: no mapping of the file, so a rank's
    address space grows by the rows it reads, not by the file (``safe_open`` maps it whole)."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        self.path, self.data_start, self.entries = path, 8 + length, header

    def shape(self, key: str) -> torch.Size:
        return torch.Size(self.entries[key]["shape"])

    def read(self, key: str, box: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        """The slice ``box`` (one slice of step 1 per dim) of tensor ``key``, as ``dtype``: its rows
        read a group at a time, each group's other dims cut to the box."""
        entry = self.entries[key]
        stored, shape, offset = _DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"][0]
        if not shape:
            box = ()
        row_bytes = math.prod(shape[1:]) * stored.itemsize
        first, last, _ = box[0].indices(shape[0]) if shape else (0, 1, 1)
        group = max(1, READ_BYTES // max(1, row_bytes))
        out = torch.empty([len(range(*s.indices(n))) for s, n in zip(box, shape, strict=True)], dtype=dtype)
        with open(self.path, "rb", buffering=0) as f:
            for row in range(first, last, group):
                rows = min(group, last - row)
                buf = bytearray(rows * row_bytes if shape else stored.itemsize)
                f.seek(self.data_start + offset + row * row_bytes)
                f.readinto(buf)
                values = torch.frombuffer(buf, dtype=stored) if buf else torch.empty(0, dtype=stored)
                if not shape:
                    return values.view(()).to(dtype, copy=True)
                part = values.view(rows, *shape[1:])[(slice(None), *box[1:])]
                out[row - first:row - first + rows] = part
        return out


class SafetensorsFolder:
    """The tensors of a folder of safetensors files, each read slice by slice as asked.

    ``prefix``: what the model's names have before the checkpoint's (``"hf."``: boost-train's
    wrapper of a Hugging Face model). ``base_prefix``: the Hugging Face model's ``base_model_prefix``
    (``"model"``), tried on or off a name, as ``from_pretrained`` does for a checkpoint saved from
    the base model or from the model with a head.
    """

    def __init__(self, folder: str | Path, prefix: str = "", base_prefix: str = "") -> None:
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.folder / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{self.folder} holds neither model.safetensors nor model.safetensors.index.json")
        self.prefix, self.base_prefix = prefix, base_prefix
        self._file_of: dict[str, _SafetensorsFile] = {}
        for name in files:
            file = _SafetensorsFile(self.folder / name)
            self._file_of.update(dict.fromkeys(file.entries, file))

    def key(self, name: str) -> str | None:
        """The checkpoint's key for the model's parameter ``name`` (None: not in the checkpoint)."""
        name = canonical_name(name)
        if self.prefix and name.startswith(self.prefix):
            name = name[len(self.prefix):]
        base = f"{self.base_prefix}." if self.base_prefix else ""
        candidates = [name]
        if base and name.startswith(base):
            candidates.append(name[len(base):])
        elif base:
            candidates.append(base + name)
        return next((c for c in candidates if c in self._file_of), None)

    def has(self, name: str) -> bool:
        return self.key(name) is not None

    def _key(self, name: str) -> str:
        key = self.key(name)
        if key is None:
            raise MissingWeightError(f"{name} is not in {self.folder}")
        return key

    def shape(self, name: str) -> torch.Size:
        key = self._key(name)
        return self._file_of[key].shape(key)

    def values(self, name: str, box: tuple[slice, ...] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        key = self._key(name)
        shape = self._file_of[key].shape(key)
        box = tuple(box or ()) + tuple(slice(0, n) for n in shape[len(box or ()):])
        return self._file_of[key].read(key, box, dtype)


# ----------------------------------------------------------------------------- a rank's part


def runs(index: torch.Tensor | None, size: int) -> list[tuple[int, int, int]]:
    """``(local start, whole start, length)`` of each run of consecutive whole indices in
    ``index`` (its -1s, padding, in none); ``[(0, 0, size)]`` for None."""
    if index is None:
        return [(0, 0, size)]
    values = index.tolist()
    out: list[tuple[int, int, int]] = []
    for pos, whole in enumerate(values):
        if whole < 0:
            continue
        if out and out[-1][0] + out[-1][2] == pos and out[-1][1] + out[-1][2] == whole:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((pos, whole, 1))
    return out


def slice_values(source: WeightSource, name: str, index: Index, shape: Sequence[int],
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The local tensor of ``shape`` whose element at each position is the whole parameter's at
    ``index`` (zeros where -1), read box by box from ``source``."""
    dims = [runs(index[d] if d < len(index) else None, n) for d, n in enumerate(shape)]
    if len(dims) == 0 or all(len(r) == 1 and r[0] == (0, 0, n) for r, n in zip(dims, shape, strict=True)):
        whole = all(i is None for i in index)
        box = None if whole else tuple(slice(0, n) for n in shape)
        return source.values(name, box, dtype)
    out = torch.zeros(tuple(shape), dtype=dtype)
    for combo in itertools.product(*dims):
        box = tuple(slice(w, w + n) for _, w, n in combo)
        into = tuple(slice(o, o + n) for o, _, n in combo)
        out[into] = source.values(name, box, dtype)
    return out


def narrowed(index: Index, box: Iterable[slice] | None) -> Index:
    """``index`` of a tensor cut again to ``box`` (an FSDP2 shard of a TP shard)."""
    if box is None:
        return index
    out = list(index)
    for d, s in enumerate(box):
        if d >= len(out):
            out.append(None)
        if out[d] is None:
            if s == slice(None):
                continue
            out[d] = torch.arange(s.start, s.stop)
        else:
            out[d] = out[d][s]
    return tuple(out)
