"""``boost-export``: a boost-train checkpoint as a model folder that loads without boost-train.

    boost-export runs/exp1 exported/            # the run's newest checkpoint
    boost-export runs/exp1/checkpoints/step_000500 exported/

The model is rebuilt from the run's saved config (``.hydra/config.yaml``) with
the code boost-train uses (:func:`boost_compile.train.model.build_model`, no
parallelism, no compile), and the checkpoint's model state is loaded into it in
one process: DCP with ``no_dist=True`` reads every tensor whole (tensor-parallel
shards were saved as DTensors with their global shapes; data-parallel replicas
are identical). Then, by kind (``boost_export.json`` records which):

- ``hf``: a dense Hugging Face model: ``save_pretrained`` (config.json,
  model.safetensors), loads with ``transformers.AutoModelForCausalLM.from_pretrained``;
- ``boost_llama``: a reference model (:class:`boost_compile.models.Llama`,
  factorized or not): :meth:`Llama.save_pretrained`, loads with ``Llama.from_pretrained``;
- ``hf-lowrank``: a factorized Hugging Face model: the Hugging Face config.json,
  the factorized state dict (model.safetensors) and, in ``boost_export.json``, each
  bottleneck's shape; loads with :func:`load_exported`.

The run's tokenizer is saved next to it as ``tokenizer.json`` (for ``hf``, with
the ``tokenizer_config.json`` of ``AutoTokenizer``; byte tokens: no file); the model's vocabulary may be larger than the \
tokenizer's (padding
rows, ``vocab_size`` in ``boost_export.json`` is the tokenizer's).
:func:`load_exported` loads any of the three kinds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from boost_compile.config import ConfigError

EXPORT_FILE = "boost_export.json"
RUN_CONFIG = Path(".hydra") / "config.yaml"


# ----------------------------------------------------------------------------- where from


@dataclass
class Source:
    """A checkpoint and the run config that built its model."""

    checkpoint: Path
    config_file: Path
    run_dir: Path | None  # the run folder (tokenizer files), when the config sits in one
    config: Any  # TrainConfig
    step: int | None
    _tokenizer: Any = field(default=None, repr=False)

    def tokenizer(self) -> Any:
        """The run's tokenizer (:func:`run_tokenizer`), loaded once."""
        if self._tokenizer is None:
            self._tokenizer = run_tokenizer(self)
        return self._tokenizer


def _run_of(path: Path) -> Path | None:
    """The nearest folder at or above ``path`` that holds ``.hydra/config.yaml``."""
    for folder in (path, *path.parents):
        if (folder / RUN_CONFIG).is_file():
            return folder
    return None


def resolve(path: str | Path, config: str | Path | None = None) -> Source:
    """The checkpoint ``path`` names (a run folder: its newest; a ``step_*`` folder; a folder of them)
    and the config of its run (``config``: an explicit ``.hydra/config.yaml``)."""
    from omegaconf import OmegaConf

    from boost_compile.train.checkpoint import checkpoint_dir, checkpoint_step, find_checkpoint
    from boost_compile.train.validate import to_train_config

    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"{path} does not exist (a boost-train run folder or a checkpoint folder)")
    checkpoint = find_checkpoint(path)
    run_dir = _run_of(path) if checkpoint is not None else (path if (path / RUN_CONFIG).is_file() else None)
    if config is not None:
        config_file = Path(config).expanduser().resolve()
        if not config_file.is_file():
            raise ConfigError(f"--config {config_file} is not a file")
        if run_dir is None and config_file.parent.name == ".hydra":
            run_dir = config_file.parent.parent
    elif run_dir is not None:
        config_file = run_dir / RUN_CONFIG
    else:
        raise ConfigError(
            f"no run config for {path}: neither it nor a folder above it holds {RUN_CONFIG}; "
            "pass the run's config with --config RUN/.hydra/config.yaml"
        )
    tc = to_train_config(OmegaConf.load(config_file))
    if checkpoint is None:
        where = checkpoint_dir(tc.checkpoint, run_dir or path)
        checkpoint = find_checkpoint(where)
        if checkpoint is None:
            raise ConfigError(f"the run {run_dir or path} has no complete checkpoint in {where}")
    return Source(checkpoint, config_file, run_dir, tc, checkpoint_step(checkpoint))


# ----------------------------------------------------------------------------- the model


def load_checkpoint_model(model: nn.Module, checkpoint: str | Path) -> None:
    """Load a boost-train checkpoint's model state into ``model`` (whole, one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from boost_compile.train.checkpoint import _quiet_dcp

    state = {"model": get_model_state_dict(model)}
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    set_model_state_dict(model, state["model"])


def build_from_source(source: Source, device: torch.device | str = "cpu") -> nn.Module:
    """The trained model: built as boost-train builds it (the vocabulary following the run's
    tokenizer), with the checkpoint's weights, in eval mode."""
    from boost_compile.train.model import build_model, fit_vocab
    from boost_compile.train.parallel import cast_weights
    from boost_compile.train.validate import model_shape

    tc = source.config
    shape = fit_vocab(model_shape(tc.model, tc.trainer.seq), tc.model, source.tokenizer().vocab_size)
    model = build_model(tc, shape, torch.device(device))
    cast_weights(model, tc.trainer.precision)
    load_checkpoint_model(model, source.checkpoint)
    return model.eval()


def load_trained(
    path: str | Path, *, config: str | Path | None = None, device: torch.device | str = "cpu"
) -> tuple[nn.Module, Source]:
    """(the trained model, where it came from) for a run folder or a checkpoint folder."""
    source = resolve(path, config)
    return build_from_source(source, device), source


# ----------------------------------------------------------------------------- tokenizer


def run_tokenizer(source: Source) -> Any:
    """The tokenizer the run trained with (:func:`boost_compile.train.tokenizer.tokenizer_for_run`)."""
    from boost_compile.train.tokenizer import load_tokenizer, tokenizer_for_run

    try:
        if source.run_dir is not None:
            return tokenizer_for_run(source.run_dir)
        return load_tokenizer(source.config.data.tokenizer)  # --config outside a run folder
    except ValueError as exc:
        raise ConfigError(f"the run's tokenizer: {exc}") from exc


def _save_tokenizer(source: Source, out: Path, *, hf: bool = False) -> Any:
    """Save the run's tokenizer into ``out`` (``tokenizer.json``; bytes: no file); returns it.

    ``hf``: as a ``transformers.PreTrainedTokenizerFast`` (``tokenizer_config.json``
    too), so ``AutoTokenizer.from_pretrained(out)`` loads the same tokenizer.
    """
    tokenizer = source.tokenizer()
    backend = getattr(tokenizer, "backend", None)
    if hf and backend is not None:
        import transformers

        transformers.PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(str(out))
    else:
        tokenizer.save(out)
    return tokenizer


# ----------------------------------------------------------------------------- export


def export(
    path: str | Path, out: str | Path, *, config: str | Path | None = None
) -> dict[str, Any]:
    """Export the checkpoint ``path`` names into ``out``; returns what ``boost_export.json`` says."""
    from safetensors.torch import save_model

    from boost_compile.models import Llama
    from boost_compile.models.llama import WEIGHTS_FILE, lowrank_layout
    from boost_compile.train.model import HFCausalLM

    model, source = load_trained(path, config=config)
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    layers: dict[str, Any] = {}
    if isinstance(model, Llama):
        kind = "boost_llama"
        model.save_pretrained(out)
    elif isinstance(model, HFCausalLM):
        hf = model.hf
        hf.config.use_cache = True  # boost-train turned it off for training
        layers = lowrank_layout(hf)
        if not layers:
            kind = "hf"
            hf.save_pretrained(str(out))
        else:
            kind = "hf-lowrank"
            hf.config.save_pretrained(str(out))
            save_model(hf, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    else:  # pragma: no cover - build_model makes one of the two
        raise TypeError(f"cannot export a {type(model).__name__}")
    tokenizer = _save_tokenizer(source, out, hf=kind == "hf")
    info = {
        "format": kind,
        "checkpoint": str(source.checkpoint),
        "step": source.step,
        "run_config": str(source.config_file),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "tokenizer": tokenizer.name,
        "vocab_size": int(tokenizer.vocab_size),
        "factorize": dataclasses.asdict(source.config.factorize),
        "lowrank_layers": layers,
    }
    (out / EXPORT_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


def load_exported(path: str | Path, *, device: torch.device | str = "cpu") -> nn.Module:
    """The model of a ``boost-export`` folder: a ``Llama`` or a Hugging Face causal LM.

    ``hf-lowrank``: the Hugging Face model is built from config.json, the listed
    linears become the same bottlenecks, and model.safetensors is loaded into it
    (strict, bit for bit).
    """
    from boost_compile.models import Llama
    from boost_compile.models.llama import (
        CONFIG_FILE,
        MODEL_TYPE,
        WEIGHTS_FILE,
        apply_lowrank_layout,
    )

    folder = Path(path).expanduser()
    info = json.loads((folder / EXPORT_FILE).read_text()) if (folder / EXPORT_FILE).is_file() else {}
    kind = info.get("format")
    if kind is None:  # a folder written by Llama.save_pretrained or a Hugging Face model alone
        model_type = json.loads((folder / CONFIG_FILE).read_text()).get("model_type")
        kind = "boost_llama" if model_type == MODEL_TYPE else "hf"
    if kind == "boost_llama":
        return Llama.from_pretrained(folder, device=device).eval()
    import transformers

    if kind == "hf":
        return transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).to(device).eval()
    if kind != "hf-lowrank":
        raise ValueError(f"{folder / EXPORT_FILE}: unknown format {kind!r}")
    from safetensors.torch import load_model

    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    dtype = getattr(torch, info.get("dtype", "float32"))
    hf = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    apply_lowrank_layout(hf, info["lowrank_layers"])
    load_model(hf, str(folder / WEIGHTS_FILE), strict=True)
    return hf.to(device).eval()


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> None:
    """``boost-export RUN_OR_CHECKPOINT OUT [--config RUN/.hydra/config.yaml]``."""
    parser = argparse.ArgumentParser(
        prog="boost-export",
        description="Export a boost-train checkpoint as a model folder (safetensors + config.json).",
    )
    parser.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run folder (its newest checkpoint) or a checkpoint folder")
    parser.add_argument("out", metavar="OUT", help="the folder to write")
    parser.add_argument("--config", help="the run's .hydra/config.yaml, when the checkpoint is not inside its run folder")
    args = parser.parse_args(argv)
    try:
        info = export(args.source, args.out, config=args.config)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"boost-export: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    loader = {
        "hf": "transformers.AutoModelForCausalLM.from_pretrained",
        "boost_llama": "boost_compile.models.Llama.from_pretrained",
        "hf-lowrank": "boost_compile.export.load_exported",
    }[info["format"]]
    print(f"exported {info['checkpoint']} (step {info['step']}) as {info['format']} to {args.out}; load with {loader}")


if __name__ == "__main__":
    main()
