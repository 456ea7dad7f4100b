"""What a ``boost-export`` folder says about its model, read without building it.

A lower layer than :mod:`boost_compile.export` (which writes such folders and needs boost-train):
boost-train's config check and the planner read an export given as ``model.hf_path`` through this.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EXPORT_FILE = "boost_export.json"
#: ``config.json``'s model_type of a reference model (``Llama.save_pretrained``)
BOOST_LLAMA = "boost_llama"


def export_info(path: str | Path) -> dict[str, Any] | None:
    """``boost_export.json`` of the folder ``path`` (or of the folder of a ``config.json`` path);
    for a folder ``Llama.save_pretrained`` wrote alone, ``{"format": "boost_llama"}``; None for
    anything else (a Hugging Face folder)."""
    folder = Path(path).expanduser()
    folder = folder if folder.is_dir() else folder.parent
    if (folder / EXPORT_FILE).is_file():
        return json.loads((folder / EXPORT_FILE).read_text())
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == BOOST_LLAMA:
        return {"format": BOOST_LLAMA}
    return None


def llama_fields(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A reference model's folder: (its ``LlamaConfig`` fields, its bottlenecks by module name)."""
    folder = Path(path).expanduser()
    folder = folder if folder.is_dir() else folder.parent
    config = json.loads((folder / "config.json").read_text())
    config.pop("model_type", None)
    config.pop("dtype", None)
    return config, config.pop("lowrank_layers", {})


def lowrank_layers(path: str | Path) -> dict[str, Any]:
    """The bottlenecks an export made of its config's dense linears (module name -> shape)."""
    info = export_info(path) or {}
    if info.get("format") == BOOST_LLAMA:
        return llama_fields(path)[1]
    return dict(info.get("lowrank_layers") or {})
