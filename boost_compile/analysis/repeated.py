"""A model's repeated blocks, and a capture of its first few only.

    repeated_blocks(model)          -> ("layers", ["layers.0", ..., "layers.31"])
    with first_blocks(model, 2):    -> model.layers holds layers.0 and layers.1 while inside
        capture ...

``compile_blocks`` compiles the blocks one by one; ``parallelize_`` captures the model with its
first two blocks only (``first_blocks``), so sharding a 32-layer model costs what a 2-layer one
does, and reads the other blocks' roles from the second block's (``repeat_names``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from torch import nn


def repeated_blocks(model: nn.Module) -> tuple[str, list[str]] | None:
    """The container and names of the model's repeated blocks: the children of its largest
    ``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential`` whose children are all of one class
    (a decoder's ``layers``), by parameter count. None when it has none.

    A container inside a numbered stack of layers of several classes (a hybrid's ``layers``:
    Zamba 2's Mamba and shared-attention layers) is part of one of those layers, not the
    model's blocks: such a model has none."""
    best: tuple[int, str, list[str]] | None = None
    mixed: list[str] = []  # numbered stacks of several classes (named_modules: parents first)
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or len(module) == 0:
            continue
        if any(name.startswith(m + ".") for m in mixed):
            continue
        children = list(module.named_children())
        if len({type(child) for _n, child in children}) != 1:
            if isinstance(module, (nn.ModuleList, nn.Sequential)):
                mixed.append(name)
            continue
        size = sum(p.numel() for p in module.parameters())
        names = [f"{name}.{child}" if name else child for child, _m in children]
        if best is None or size > best[0]:
            best = (size, name, names)
    return None if best is None else (best[1], best[2])


@contextlib.contextmanager
def first_blocks(model: nn.Module, keep: int) -> Iterator[tuple[str, list[str]] | None]:
    """While inside, the model's block container (``nn.ModuleList``, numbered children) holds only
    its first ``keep`` blocks; yields (container, the names of all its blocks), or None (and
    changes nothing) when the model has no such container or no more than ``keep`` blocks."""
    found = repeated_blocks(model)
    if found is None or len(found[1]) <= keep:
        yield None
        return
    container_name, names = found
    container = model.get_submodule(container_name) if container_name else model
    if not isinstance(container, nn.ModuleList):
        yield None
        return
    saved = container._modules
    container._modules = dict(list(saved.items())[:keep])
    try:
        yield found
    finally:
        container._modules = saved


def repeat_names(names: Iterable[str], container: str, source: int, count: int) -> list[str]:
    """``names`` plus, for each name inside block ``source`` of ``container``, the same name in
    blocks ``source + 1 .. count - 1``."""
    base = f"{container}." if container else ""
    prefix = f"{base}{source}."
    out = list(names)
    for name in list(out):
        if name.startswith(prefix):
            out += [f"{base}{i}.{name[len(prefix):]}" for i in range(source + 1, count)]
    return out


__all__ = ["first_blocks", "repeat_names", "repeated_blocks"]
