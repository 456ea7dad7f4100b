"""``boost-export``: a boost-train checkpoint as a model folder that loads without boost-train.

    boost-export runs/exp1 exported/            # the run's newest checkpoint
    boost-export runs/exp1/checkpoints/step_000500 exported/

The model is rebuilt on the meta device from the run's saved config
(``.hydra/config.yaml``) with the code boost-train uses (no parallelism, no
compile), and the checkpoint's model state is streamed into safetensors files a
group of tensors at a time (DCP with ``no_dist=True`` reads each tensor whole:
tensor-parallel and FSDP2 shards were saved as DTensors with their global shapes;
data-parallel replicas are identical), so an export holds one parameter of the
model, never all of it. Files over 5 GB are cut into shards with Hugging Face's
index (``model.safetensors.index.json``). Then, by kind (``boost_export.json``
records which):

- ``hf``: a dense Hugging Face model: config.json, generation_config.json and its
  state dict under the module's own names (a mixture of experts' fused
  ``gate_up_proj``, where ``save_pretrained`` would write the older per-expert
  names), loads with ``transformers.AutoModelForCausalLM.from_pretrained``, and
  as ``model.hf_path`` of a boost-train run with ``model.pretrained=true``;
- ``boost_llama``: a reference model (:class:`boost_compile.models.Llama`,
  factorized or not): what :meth:`Llama.save_pretrained` writes, loads with ``Llama.from_pretrained``;
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
from boost_compile.export_folder import EXPORT_FILE
from boost_compile.safetensors_writer import Entry, load_folder_into, write_folder

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


#: An export folder's files are cut into shards of at most this many bytes (Hugging Face's default).
MAX_SHARD_BYTES = 5 * 10**9
#: Tensors read from the checkpoint at once: several small ones together, a larger one alone, so an
#: export holds at most max(one parameter, this) of the model's values.
READ_GROUP_BYTES = 64 << 20


def meta_model(source: Source) -> nn.Module:
    """The run's model on the meta device, built as boost-train builds it (the vocabulary following
    the run's tokenizer, factorized, cast to the run's weight dtype): names, shapes and dtypes, no
    values."""
    from boost_compile.meta_init import deferred_init
    from boost_compile.train.model import construct, factorize_model, fit_vocab
    from boost_compile.train.parallel import cast_weights
    from boost_compile.train.validate import model_shape

    tc = source.config
    shape = fit_vocab(model_shape(tc.model, tc.trainer.seq), tc.model, source.tokenizer().vocab_size)
    with deferred_init(tc.trainer.seed):
        model = construct(tc, shape)
    factorize_model(model, tc, shape, torch.device("cpu"))
    cast_weights(model, tc.trainer.precision)
    return model


def _entries(model: nn.Module, strip: str) -> tuple[list[Entry], dict[str, str]]:
    """The tensors an export writes (a tied alias once, under its first name, as Hugging Face saves
    it) and each one's key in the checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    seen: set[int] = set()
    entries, keys = [], {}
    state = get_model_state_dict(model)
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or key not in state:
            continue
        seen.add(id(t))
        name = key.removeprefix(strip)
        entries.append(Entry(name, t.dtype, tuple(t.shape)))
        keys[name] = key
    return entries, keys


def checkpoint_reader(checkpoint: Path, keys: dict[str, str], group_bytes: int = READ_GROUP_BYTES):
    """``read(entries)`` for :func:`write_folder`: each entry's tensor from the checkpoint's model
    state (its key ``keys[name]``), read by DCP a group of at most ``group_bytes`` at a time (a
    larger tensor alone) and released once written."""
    import torch.distributed.checkpoint as dcp

    from boost_compile.train.checkpoint import _quiet_dcp

    def load(group: list[Entry]) -> dict[str, torch.Tensor]:
        state = {"model": {keys[e.name]: torch.empty(e.shape, dtype=e.dtype) for e in group}}
        with _quiet_dcp():
            dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
        return state["model"]

    def read(entries: Sequence[Entry]):
        group: list[Entry] = []
        for entry in [*entries, None]:
            if group and (entry is None or sum(e.nbytes for e in group) + entry.nbytes > group_bytes):
                values = load(group)
                for e in group:
                    yield e.name, values.pop(keys[e.name])
                del values
                group = []
            if entry is not None:
                group.append(entry)

    return read


def export(
    path: str | Path, out: str | Path, *, config: str | Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES, group_bytes: int = READ_GROUP_BYTES,
) -> dict[str, Any]:
    """Export the checkpoint ``path`` names into ``out``; returns what ``boost_export.json`` says.

    The model is built on the meta device and the weights are streamed from the checkpoint into the
    safetensors files a group at a time (:func:`checkpoint_reader`): the export never holds the
    whole model, only max(one parameter, ``group_bytes``) of it."""
    from boost_compile.models import Llama
    from boost_compile.models.llama import CONFIG_FILE, lowrank_layout
    from boost_compile.train.model import HFCausalLM

    source = resolve(path, config)
    model = meta_model(source)
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    layers: dict[str, Any] = {}
    if isinstance(model, Llama):
        kind, strip = "boost_llama", ""
        (out / CONFIG_FILE).write_text(json.dumps(model.pretrained_config(), indent=2) + "\n")
    elif isinstance(model, HFCausalLM):
        hf, strip = model.hf, "hf."
        hf.config.use_cache = True  # boost-train turned it off for training
        hf.config.dtype = str(dtype).removeprefix("torch.")
        layers = lowrank_layout(hf)
        kind = "hf-lowrank" if layers else "hf"
        hf.config.save_pretrained(str(out))
        if kind == "hf" and getattr(hf, "generation_config", None) is not None and hf.can_generate():
            hf.generation_config.save_pretrained(str(out))
    else:  # pragma: no cover - build_model makes one of the two
        raise TypeError(f"cannot export a {type(model).__name__}")
    entries, keys = _entries(model, strip)
    files = write_folder(out, entries, checkpoint_reader(source.checkpoint, keys, group_bytes), max_shard_bytes)
    tokenizer = _save_tokenizer(source, out, hf=kind == "hf")
    info = {
        "format": kind,
        "checkpoint": str(source.checkpoint),
        "step": source.step,
        "run_config": str(source.config_file),
        "dtype": str(dtype).removeprefix("torch."),
        "tokenizer": tokenizer.name,
        "vocab_size": int(tokenizer.vocab_size),
        "factorize": dataclasses.asdict(source.config.factorize),
        "lowrank_layers": layers,
        "files": files,
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
    from boost_compile.models.llama import CONFIG_FILE, MODEL_TYPE, apply_lowrank_layout

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
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    dtype = getattr(torch, info.get("dtype", "float32"))
    hf = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    apply_lowrank_layout(hf, info["lowrank_layers"])
    load_folder_into(hf, folder)
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
    parser.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES,
                        help="cut the weights into safetensors files of at most this many bytes (default 5e9)")
    args = parser.parse_args(argv)
    try:
        info = export(args.source, args.out, config=args.config, max_shard_bytes=args.max_shard_bytes)
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
