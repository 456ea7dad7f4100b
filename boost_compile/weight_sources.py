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


class SafetensorsFolder:
    """The tensors of a folder of safetensors files, each read slice by slice as asked.

    ``prefix``: what the model's names have before the checkpoint's (``"hf."``: boost-train's
    wrapper of a Hugging Face model). ``base_prefix``: the Hugging Face model's ``base_model_prefix``
    (``"model"``), tried on or off a name, as ``from_pretrained`` does for a checkpoint saved from
    the base model or from the model with a head.
    """

    def __init__(self, folder: str | Path, prefix: str = "", base_prefix: str = "") -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            files = json.loads(index.read_text())["weight_map"]
        elif (self.folder / "model.safetensors").exists():
            files = None
        else:
            raise FileNotFoundError(f"{self.folder} holds neither model.safetensors nor model.safetensors.index.json")
        self.prefix, self.base_prefix = prefix, base_prefix
        self._handles = {}
        self._file_of: dict[str, str] = {}
        for file in sorted(set(files.values())) if files is not None else ["model.safetensors"]:
            handle = safe_open(str(self.folder / file), framework="pt")
            self._handles[file] = handle
            for key in handle.keys():  # noqa: SIM118 - a safe_open handle is not a mapping
                self._file_of[key] = file

    def keys(self) -> list[str]:
        return list(self._file_of)

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

    def _slice(self, name: str):  # noqa: ANN202 - safetensors' PySafeSlice
        key = self.key(name)
        if key is None:
            raise MissingWeightError(f"{name} is not in {self.folder}")
        return self._handles[self._file_of[key]].get_slice(key)

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self._slice(name).get_shape())

    def values(self, name: str, box: tuple[slice, ...] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        part = self._slice(name)
        shape = part.get_shape()
        box = tuple(box or ()) + tuple(slice(0, n) for n in shape[len(box or ()):])
        return part[box if box else ...].to(dtype)


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
