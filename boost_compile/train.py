"""``boost-train``: Hydra training runs and sweeps for bottleneck LLMs.

    boost-train                                        # tiny CoLA model, boost backend, CPU
    boost-train model=cola-60m trainer.steps=1000 passes=inductor
    boost-train -m passes=boost,inductor factorize.rank_ratio=0.125,0.25   # a sweep
    torchrun --nproc-per-node 2 -m boost_compile.train parallel=dp2       # data parallel

The config is ``hydra_conf/train.yaml`` over the schema in
:mod:`boost_compile.train_config`. Each run gets a folder (``runs/<date>/<time>``,
or ``runs/multirun/<date>/<time>/<job>`` in a sweep) with the composed config
(``.hydra/``), ``train.log``, ``metrics.jsonl`` (one JSON object per step and per
evaluation), ``loss.png``, ``summary.json`` and ``checkpoints/step_*`` (DCP). A
sweep ends with ``summary.csv`` and ``summary.md`` in its folder.

Parallelism: ``torchrun`` starts ``dp * tp`` processes; they form a 2-D
DeviceMesh ``(dp, tp)``. Tensor parallelism shards the model with
``boost_compile.parallelize_`` over the ``tp`` dimension; data parallelism wraps
the compiled model in DDP over the ``dp`` dimension (README: why DDP).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import pickle
import random
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from boost_compile.config import ConfigError
from boost_compile.data import PackedTokens, split, stdlib_tokens
from boost_compile.train_config import (
    CheckpointConfig,
    DataConfig,
    ModelShape,
    OptimConfig,
    TrainConfig,
    boost_options,
    config_dir,
    env_world_size,
    factorize_config,
    register_configs,
    text_files,
    validate,
)

log = logging.getLogger("boost_compile.train")

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "loss.png"
SUMMARY_COLUMNS = (
    "job",
    "config",
    "status",
    "steps",
    "final_loss",
    "val_loss",
    "tokens_per_s",
    "peak_mem_mib",
    "total_s",
)


# ----------------------------------------------------------------------------- processes


@dataclass
class Dist:
    """This process's place in the ``(dp, tp)`` mesh."""

    world: int
    rank: int
    dp: int
    tp: int
    device: torch.device
    mesh: Any = None  # DeviceMesh when world > 1

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def group(self, dim: str) -> Any:
        return None if self.mesh is None else self.mesh[dim].get_group()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mean_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        if self.dp == 1:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, group=self.group("dp"))
        return value / self.dp

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on one of them."""
        if self.world == 1:
            return flag
        box = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return bool(box.item())


def setup_distributed(tc: TrainConfig) -> Dist:
    """Join the process group torchrun set up (if any) and build the (dp, tp) mesh."""
    par = tc.parallel
    world = env_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    want = tc.trainer.device
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    mesh = None
    if world > 1:
        if not dist.is_initialized():
            backend = par.dist_backend if par.dist_backend != "auto" else ("nccl" if use_cuda else "gloo")
            dist.init_process_group(backend, device_id=device if use_cuda else None)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (par.dp, par.tp), mesh_dim_names=("dp", "tp"))
    return Dist(world=world, rank=rank, dp=par.dp, tp=par.tp, device=device, mesh=mesh)


# ----------------------------------------------------------------------------- data


def load_tokens(data: DataConfig) -> torch.Tensor:
    """The configured text as a 1-D uint8 stream of byte tokens (at most ``max_bytes``)."""
    if data.source == "stdlib":
        return stdlib_tokens(data.max_bytes)
    if data.source == "text":
        blob = _join_capped((path.read_bytes() for path in text_files(data)), data.max_bytes)
        where = ", ".join(data.paths)
    else:
        blob = _join_capped((text.encode("utf-8") for text in _hf_texts(data)), data.max_bytes)
        where = f"dataset {data.dataset!r}"
    if not blob:
        raise ConfigError(f"data: no text in {where}")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _join_capped(chunks: Iterator[bytes], max_bytes: int) -> bytes:
    parts: list[bytes] = []
    total = 0
    for chunk in chunks:
        piece = (chunk + b"\n")[: max_bytes - total]
        parts.append(piece)
        total += len(piece)
        if total >= max_bytes:
            break
    return b"".join(parts)


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


def make_loaders(tc: TrainConfig, tokens: torch.Tensor, dev: Dist) -> tuple[PackedTokens, PackedTokens]:
    """Train and val batches of this rank's disjoint shard (the global batch split over dp)."""
    tr = tc.trainer
    train_tokens, val_tokens = split(tokens, tc.data.val_fraction)
    local_batch = tr.batch // dev.dp
    val_windows = (len(val_tokens) - 1) // tr.seq // dev.dp
    try:
        train = PackedTokens(
            train_tokens, local_batch, tr.seq, seed=tr.seed, rank=dev.dp_rank, world_size=dev.dp
        )
        val = PackedTokens(
            val_tokens,
            max(1, min(local_batch, val_windows)),
            tr.seq,
            shuffle=False,
            rank=dev.dp_rank,
            world_size=dev.dp,
        )
    except ValueError as exc:
        raise ConfigError(
            f"data: {exc}; read more text (data.max_bytes={tc.data.max_bytes}) or use a smaller "
            f"trainer.batch / trainer.seq"
        ) from exc
    return train, val


# ----------------------------------------------------------------------------- model


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM behind the reference models' ``forward(tokens, targets)``."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.hf(input_ids=tokens, use_cache=False).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_model(tc: TrainConfig, shape: ModelShape, device: torch.device) -> nn.Module:
    """The model every rank starts from (same seed, same weights), factorized if asked."""
    torch.manual_seed(tc.trainer.seed)
    if shape.kind == "preset":
        from boost_compile.models import Llama

        model: nn.Module = Llama(shape.llama_config, device=device)
    else:
        import transformers

        config = shape.hf_config
        config.use_cache = False
        if tc.model.pretrained:
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                tc.model.hf_path, config=config, local_files_only=True
            )
        else:
            hf = transformers.AutoModelForCausalLM.from_config(config)
        model = HFCausalLM(hf.float()).to(device)
    factorize = factorize_config(tc.factorize)
    if factorize is not None:
        from boost_compile.factorize import factorize_

        example = (torch.arange(16, device=device).view(1, 16) % shape.vocab_size,)
        report = factorize_(model, factorize, example_inputs=example)
        log.info("factorized %d layers: %s -> %s parameters", len(report.layers), f"{report.params_before:,}", f"{report.params_after:,}")
    return model


def parallelize(model: nn.Module, tc: TrainConfig, dev: Dist, example: torch.Tensor) -> None:
    """Shard ``model`` over the tp dimension with ``boost_compile.parallelize_``."""
    import boost_compile

    if not hasattr(boost_compile, "parallelize_"):  # validate() said so already; belt and braces
        raise ConfigError("tensor parallelism is not available in this build (no boost_compile.parallelize_)")
    report = boost_compile.parallelize_(model, (example,), dev.mesh["tp"], plan=tc.parallel.plan)
    log.info("%s", report)


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def global_numel(p: torch.Tensor, dev: Dist) -> int:
    """Elements of the whole parameter, whether or not this rank holds only a TP shard."""
    spec = getattr(p, "_boost_tp", None)
    if not is_dtensor(p) and spec is not None and spec.dim is not None:
        return p.numel() * dev.tp
    return p.numel()


def compile_model(model: nn.Module, tc: TrainConfig) -> nn.Module:
    passes = tc.passes
    if passes.backend == "none":
        return model
    if passes.backend == "boost":
        return torch.compile(model, backend="boost", options=dict(passes.options), fullgraph=passes.fullgraph)
    return torch.compile(model, backend=passes.backend, fullgraph=passes.fullgraph)


def wrap_data_parallel(module: nn.Module, model: nn.Module, dev: Dist) -> nn.Module:
    """DDP over the dp dimension around the compiled module (one graph, grads averaged)."""
    if dev.dp == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    if any(is_dtensor(p) for p in model.parameters()):
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        _pre_dp_module_transform(model)
    return DDP(
        module,
        process_group=dev.group("dp"),
        broadcast_buffers=False,
        device_ids=[dev.device.index] if dev.device.type == "cuda" else None,
    )


# ----------------------------------------------------------------------------- optimisation


def lr_multiplier(total: int, warmup: int, schedule: str, min_ratio: float) -> Callable[[int], float]:
    """LambdaLR factor for step s: linear warmup to 1, then ``schedule`` down to ``min_ratio``."""

    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "constant":
            return 1.0
        if schedule == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return scale


def make_optimizer(model: nn.Module, opt: OptimConfig, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]  # norms, biases: no decay
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": opt.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=opt.lr,
        betas=(opt.betas[0], opt.betas[1]),
        eps=opt.eps,
    )
    warmup = opt.warmup_steps if opt.warmup_steps is not None else max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(steps, warmup, opt.schedule, opt.min_lr_ratio)
    )
    return optimizer, scheduler


def clip_grad_norm(model: nn.Module, max_norm: float, dev: Dist) -> float:
    """Clip the global gradient norm; with tp, shards of a parameter count once."""
    params = [p for p in model.parameters() if p.grad is not None]
    if dev.tp == 1:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    sharded = torch.zeros((), device=dev.device, dtype=torch.float32)
    whole = torch.zeros((), device=dev.device, dtype=torch.float32)
    for p in params:
        g = p.grad
        if is_dtensor(g):
            whole += torch.linalg.vector_norm(g.float()).full_tensor() ** 2
            continue
        spec = getattr(p, "_boost_tp", None)
        sq = g.detach().float().pow(2).sum()
        if spec is not None and spec.dim is not None:
            sharded += sq
        else:
            whole += sq
    dist.all_reduce(sharded, group=dev.group("tp"))
    total = (sharded + whole).sqrt()
    coef = max_norm / (float(total) + 1e-6)
    if max_norm > 0 and coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return float(total)


@torch.no_grad()
def evaluate(forward: nn.Module, data: PackedTokens, n_batches: int | None, dev: Dist, autocast: Any) -> float:
    """Mean loss over this rank's first ``n_batches`` val batches, averaged over dp."""
    count = len(data) if n_batches is None else min(n_batches, len(data))
    total = torch.zeros((), device=dev.device)
    for index in range(count):
        inputs, targets = data.batch(0, index)
        with autocast():
            total += forward(inputs.to(dev.device), targets.to(dev.device)).float()
    return float(dev.mean_over_dp(total / max(1, count)))


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_step(path: Path) -> int | None:
    """The step of a complete checkpoint folder ``step_000123`` (None if not one)."""
    if not path.name.startswith("step_") or not (path / ".metadata").is_file():
        return None
    try:
        return int(path.name[len("step_") :])
    except ValueError:
        return None


def find_checkpoint(path: Path) -> Path | None:
    """``path`` if it is a complete checkpoint, else the newest complete one inside it."""
    if (path / ".metadata").is_file():
        return path
    if not path.is_dir():
        return None
    found = [(s, p) for p in path.iterdir() if (s := checkpoint_step(p)) is not None]
    return max(found)[1] if found else None


class Checkpointer:
    """Model, optimizer, schedule, data position and RNG in one DCP checkpoint per step."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        directory: Path,
        dev: Dist,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        data: PackedTokens,
    ) -> None:
        self.cfg = cfg
        self.dir = directory
        self.dev = dev
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.last_saved: int | None = None

    # state -------------------------------------------------------------------------

    def _state(self, step: int) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if self.dev.tp > 1:
            model_sd, optim_sd = self._to_dtensors(model_sd, optim_sd)
        rng = {"torch": torch.get_rng_state(), "python": _pickled(random.getstate())}
        if self.dev.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.dev.device)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "meta": {
                "step": step,
                "scheduler": self.scheduler.state_dict(),
                "data": self.data.state_dict(),
            },
            "rng": {f"rank{self.dev.rank}": rng},
        }

    def _to_dtensors(self, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        """Plain TP shards (``parallelize_``'s btp/megatron) as DTensors, so DCP saves each shard.

        New dicts: the optimizer's state dict shares its per-parameter dicts with
        the live optimizer, which must keep its plain tensors.
        """
        from torch.distributed.tensor import DTensor, Shard

        mesh = self.dev.mesh["tp"]
        specs = {name: getattr(p, "_boost_tp", None) for name, p in self.model.named_parameters()}

        def wrap(name: str, t: Any) -> Any:
            spec = specs.get(name)
            if spec is None or spec.dim is None or not isinstance(t, torch.Tensor) or is_dtensor(t) or t.dim() == 0:
                return t
            return DTensor.from_local(t, mesh, [Shard(spec.dim)], run_check=False)

        model_sd = {name: wrap(name, t) for name, t in model_sd.items()}
        states = {name: {k: wrap(name, t) for k, t in st.items()} for name, st in optim_sd.get("state", {}).items()}
        return model_sd, {**optim_sd, "state": states}

    # save / load -------------------------------------------------------------------

    def save(self, step: int) -> Path:
        import torch.distributed.checkpoint as dcp

        path = self.dir / f"step_{step:06d}"
        with _quiet_dcp():
            dcp.save(self._state(step), checkpoint_id=str(path), no_dist=self.dev.world == 1)
        self.last_saved = step
        if self.dev.is_main:
            self._prune()
        return path

    def _prune(self) -> None:
        found = sorted((s, p) for p in self.dir.iterdir() if (s := checkpoint_step(p)) is not None)
        for _, path in found[: -self.cfg.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path) -> int:
        """Restore everything from ``path``; returns the step it was saved after."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state(0)
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        key = f"rng.rank{self.dev.rank}."
        if not any(k.startswith(key) for k in saved):
            log.warning("checkpoint %s has no RNG state for rank %d; keeping this run's", path, self.dev.rank)
            del state["rng"]
        with _quiet_dcp():
            dcp.load(state, checkpoint_id=str(path), no_dist=self.dev.world == 1)
        params = dict(self.model.named_parameters())

        def unwrap(name: str, t: Any) -> Any:  # back to the plain shards parallelize_ keeps
            return t.to_local() if is_dtensor(t) and not is_dtensor(params.get(name)) else t

        model_sd = {name: unwrap(name, t) for name, t in state["model"].items()}
        optim_sd = state["optim"]
        optim_sd = {
            **optim_sd,
            "state": {n: {k: unwrap(n, t) for k, t in st.items()} for n, st in optim_sd.get("state", {}).items()},
        }
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        meta = state["meta"]
        self.scheduler.load_state_dict(meta["scheduler"])
        self.data.load_state_dict(meta["data"])
        if "rng" in state:
            rng = state["rng"][f"rank{self.dev.rank}"]
            torch.set_rng_state(rng["torch"])
            random.setstate(pickle.loads(rng["python"].numpy().tobytes()))
            if "cuda" in rng and self.dev.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.dev.device)
        return int(meta["step"])


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
        yield


class StopOnSignal:
    """SIGTERM/SIGINT ask the loop to stop after the current step (a second one stops now)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if self.enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("received %s: stopping after this step", signal.Signals(signum).name)


# ----------------------------------------------------------------------------- measurement


class PeakMemory:
    """Peak memory of a run: CUDA max allocated, or the process's RSS sampled every 20 ms."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def mib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return max(self.peak, _rss_bytes()) / 2**20


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Progress:
    """A tqdm bar (loss, tokens/s) on a terminal, periodic log lines otherwise; rank 0 only.

    The tokens/s shown is over the steps since the previous line (the bar: an
    exponential average), so a slow first step (compilation) does not linger.
    """

    def __init__(self, mode: str, total: int, start: int, log_every: int, tokens_per_step: int, enabled: bool) -> None:
        interactive = sys.stderr.isatty()
        self.bar_on = enabled and (mode == "bar" or (mode == "auto" and interactive))
        self.lines_on = enabled and not self.bar_on and mode != "none"
        self.log_every = log_every
        self.total = total
        self.tokens_per_step = tokens_per_step
        self.window_steps = 0
        self.window_s = 0.0
        self.ema_rate: float | None = None
        self.bar = None
        if self.bar_on:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def step(self, step: int, loss: float, lr: float, step_s: float, first: bool) -> None:
        if first:
            if self.lines_on:
                log.info("step %4d/%d loss %.3f (first step incl. compile %.1fs)", step, self.total, loss, step_s)
            elif self.bar is not None:
                self.bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)
                self.bar.update(1)
            return
        self.window_steps += 1
        self.window_s += step_s
        rate = self.tokens_per_step / max(step_s, 1e-9)
        self.ema_rate = rate if self.ema_rate is None else 0.9 * self.ema_rate + 0.1 * rate
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f} tokens/s {self.ema_rate:,.0f}", refresh=False)
            self.bar.update(1)
        elif self.lines_on and (step % self.log_every == 0 or step == self.total):
            window = self.window_steps * self.tokens_per_step / max(self.window_s, 1e-9)
            log.info("step %4d/%d loss %.3f lr %.2e tokens/s %s", step, self.total, loss, lr, f"{window:,.0f}")
            self.window_steps, self.window_s = 0, 0.0

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.lines_on:
            log.info("%s", text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_losses(metrics: Path, out: Path, title: str) -> bool:
    """Draw the train (and val) loss of ``metrics.jsonl`` into a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no %s", out.name)
        return False
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            train[row["step"]] = row["loss"]
        if "val_loss" in row:
            val[row["step"]] = row["val_loss"]
    if not train:
        return False
    steps = sorted(train)
    losses = [train[s] for s in steps]
    smooth, ema = [], 0.0
    for i, value in enumerate(losses, start=1):
        ema = 0.9 * ema + 0.1 * value
        smooth.append(ema / (1.0 - 0.9**i))  # bias-corrected: no lag at the start
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="train")
    ax.plot(steps, smooth, color="tab:blue", linewidth=2, label="train (EMA 0.9)")
    if val:
        ax.plot(sorted(val), [val[s] for s in sorted(val)], "o-", color="tab:orange", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- the run


def resume_source(tc: TrainConfig, run_dir: Path) -> Path | None:
    """The checkpoint ``trainer.resume`` loads; ConfigError when there is none."""
    if not tc.trainer.resume:
        return None
    where = Path(tc.checkpoint.resume_from or tc.checkpoint.dir or run_dir / "checkpoints").expanduser()
    found = find_checkpoint(where)
    if found is None:
        raise ConfigError(
            f"trainer.resume=true but there is no complete checkpoint in {where}; point at the earlier run "
            "with hydra.run.dir=<its folder> or checkpoint.resume_from=<its checkpoints folder>"
        )
    return found


def run(cfg: Any, run_dir: str | Path, *, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Train as ``cfg`` says, writing into ``run_dir``; returns the summary (every rank).

    Everything is validated first (:func:`validate`), before the process group,
    the data or the model exists.
    """
    tc, shape = validate(cfg)
    run_dir = Path(run_dir).resolve()
    resume_from = resume_source(tc, run_dir)
    dev = setup_distributed(tc)
    own_dir = run_dir
    run_dir = Path(dev.broadcast(str(run_dir)))  # all ranks write where rank 0 does
    if own_dir != run_dir and own_dir.is_dir() and not any(own_dir.iterdir()):
        own_dir.rmdir()  # a worker's Hydra folder that got a later timestamp
    if dev.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if tc.trainer.threads is not None:
        torch.set_num_threads(tc.trainer.threads)
    try:
        return _Run(tc, shape, dev, run_dir, list(overrides), resume_from).fit()
    finally:
        torch.set_num_threads(threads)  # a multirun's next job (or the caller) gets its own


class _Run:
    def __init__(
        self,
        tc: TrainConfig,
        shape: ModelShape,
        dev: Dist,
        run_dir: Path,
        overrides: list[str],
        resume_from: Path | None,
    ) -> None:
        self.tc, self.shape, self.dev, self.run_dir = tc, shape, dev, run_dir
        self.overrides = overrides
        self.resume_from = resume_from
        self.label = " ".join(overrides) if overrides else "defaults"
        self.title = self.label

    def autocast(self) -> Any:
        if self.tc.trainer.precision == "bf16-mixed":
            return torch.autocast(self.dev.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def fit(self) -> dict[str, Any]:
        tc, dev, tr = self.tc, self.dev, self.tc.trainer
        torch.manual_seed(tr.seed)
        random.seed(tr.seed)
        train_data, val_data = make_loaders(tc, load_tokens(tc.data), dev)
        model = build_model(tc, self.shape, dev.device)
        if dev.tp > 1:
            example, _ = train_data.batch(0, 0)
            parallelize(model, tc, dev, example.to(dev.device))
        if tr.precision == "bf16-true":
            model.to(torch.bfloat16)
        optimizer, scheduler = make_optimizer(model, tc.optim, tr.steps)
        ckpt_dir = Path(tc.checkpoint.dir).expanduser() if tc.checkpoint.dir else self.run_dir / "checkpoints"
        ckpt = Checkpointer(tc.checkpoint, ckpt_dir, dev, model, optimizer, scheduler, train_data)
        start = 0
        if self.resume_from is not None:
            start = ckpt.load(self.resume_from)
            log.info("resumed from %s (step %d)", self.resume_from, start)
        compiled = compile_model(model, tc)
        train_fn = wrap_data_parallel(compiled, model, dev)
        eval_fn = compiled if dev.tp > 1 else model  # a TP model runs only through the backend

        params = sum(global_numel(p, dev) for p in model.parameters())
        boost = boost_options(tc.passes)
        backend = tc.passes.backend + (f"(inner={boost.inner})" if boost is not None else "")
        model_name = tc.model.preset if self.shape.kind == "preset" else f"hf:{self.shape.hf_config.model_type}"
        self.title = f"{model_name}, {backend}, dp={dev.dp} tp={dev.tp}: {self.label}"
        log.info(
            "model=%s params=%s backend=%s device=%s dp=%d tp=%d batch=%d seq=%d steps=%d precision=%s threads=%d",
            model_name, f"{params:,}", backend, dev.device, dev.dp, dev.tp, tr.batch, tr.seq, tr.steps,
            tr.precision, torch.get_num_threads(),
        )
        log.info("run folder: %s", self.run_dir)

        metrics = open(self.run_dir / METRICS_FILE, "a") if dev.is_main else None
        progress = Progress(tr.progress, tr.steps, start, tr.log_every, tr.batch * tr.seq, dev.is_main)
        tokens_per_step = tr.batch * tr.seq
        history: list[tuple[int, float]] = []
        val_loss: float | None = None
        first_step_s = steady_s = 0.0
        status = "completed"
        stopper = StopOnSignal(tc.checkpoint.on_signal)
        begin = time.perf_counter()
        try:
            with stopper, PeakMemory(dev.device) as memory:
                last = time.perf_counter()
                for step in range(start + 1, tr.steps + 1):
                    inputs, targets = next(train_data)
                    inputs, targets = inputs.to(dev.device), targets.to(dev.device)
                    with self.autocast():
                        loss = train_fn(inputs, targets)
                    loss.backward()
                    grad_norm = clip_grad_norm(model, tc.optim.grad_clip, dev) if tc.optim.grad_clip > 0 else None
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    lr = scheduler.get_last_lr()[0]
                    scheduler.step()
                    loss_value = float(dev.mean_over_dp(loss.detach().float()))
                    now = time.perf_counter()
                    step_s, last = now - last, now
                    first = step == start + 1
                    if first:
                        first_step_s = step_s
                    else:
                        steady_s += step_s
                    history.append((step, loss_value))
                    rate = tokens_per_step / max(step_s, 1e-9)
                    if metrics is not None:
                        row = {"step": step, "loss": loss_value, "lr": lr, "tokens": step * tokens_per_step,
                               "tokens_per_s": rate, "step_s": step_s, "time_s": now - begin}
                        if grad_norm is not None:
                            row["grad_norm"] = grad_norm
                        metrics.write(json.dumps(row) + "\n")
                        metrics.flush()
                    progress.step(step, loss_value, lr, step_s, first)
                    if tr.eval_every and step % tr.eval_every == 0 and step != tr.steps:
                        val_loss = self._evaluate(eval_fn, val_data, step, metrics, progress)
                    stop = dev.any(stopper.signum is not None)
                    saving = tc.checkpoint.enabled and (
                        (tr.save_every and step % tr.save_every == 0)
                        or (stop and tc.checkpoint.on_signal)
                        or (step == tr.steps and tc.checkpoint.at_end)
                    )
                    if saving:
                        path = ckpt.save(step)
                        progress.message(f"checkpoint: {path}")
                    if stop:
                        status = "stopped"
                        break
                    last = time.perf_counter()  # evaluation and saving are not step time
                if status == "completed" and history:
                    val_loss = self._evaluate(eval_fn, val_data, history[-1][0], metrics, progress)
        finally:
            progress.close()
            if metrics is not None:
                metrics.close()
        total_s = time.perf_counter() - begin
        return self._finish(history, val_loss, first_step_s, steady_s, total_s, memory.mib, status, stopper.signum, ckpt)

    def _evaluate(self, eval_fn: nn.Module, data: PackedTokens, step: int, metrics: Any, progress: Progress) -> float:
        was_training = eval_fn.training
        eval_fn.eval()
        try:
            value = evaluate(eval_fn, data, self.tc.trainer.eval_batches, self.dev, self.autocast)
        finally:
            eval_fn.train(was_training)
        if metrics is not None:
            metrics.write(json.dumps({"step": step, "val_loss": value}) + "\n")
            metrics.flush()
        progress.message(f"step {step:4d} val loss {value:.3f}")
        return value

    def _finish(
        self,
        history: list[tuple[int, float]],
        val_loss: float | None,
        first_step_s: float,
        steady_s: float,
        total_s: float,
        peak_mib: float,
        status: str,
        signum: int | None,
        ckpt: Checkpointer,
    ) -> dict[str, Any]:
        tr, dev = self.tc.trainer, self.dev
        n = len(history)
        tokens_per_s = (n - 1) * tr.batch * tr.seq / steady_s if n > 1 and steady_s > 0 else 0.0
        peak = torch.tensor([peak_mib], dtype=torch.float64)
        if dev.world > 1 and dev.device.type == "cpu":
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result: dict[str, Any] = {
            "status": status,
            "signal": signal.Signals(signum).name if signum is not None else None,
            "config": self.label,
            "overrides": self.overrides,
            "run_dir": str(self.run_dir),
            "steps": history[-1][0] if history else 0,
            "start_step": history[0][0] - 1 if history else 0,
            "first_loss": history[0][1] if history else None,
            "final_loss": history[-1][1] if history else None,
            "val_loss": val_loss,
            "losses": [loss for _, loss in history],
            "tokens_per_s": tokens_per_s,
            "peak_mem_mib": float(peak.item()),
            "first_step_s": first_step_s,
            "total_s": total_s,
            "world": dev.world,
            "checkpoint": str(ckpt.dir / f"step_{ckpt.last_saved:06d}") if ckpt.last_saved else None,
        }
        if dev.is_main:
            (self.run_dir / SUMMARY_FILE).write_text(json.dumps(result, indent=2) + "\n")
            if tr.plot and history:
                plot_losses(self.run_dir / METRICS_FILE, self.run_dir / PLOT_FILE, f"{self.title} ({status})")
            if status == "stopped":
                log.warning(
                    "stopped by %s after step %d; checkpoint %s; continue with trainer.resume=true hydra.run.dir=%s",
                    result["signal"], result["steps"], result["checkpoint"], self.run_dir,
                )
            if history:
                val = f" (val {val_loss:.2f})" if val_loss is not None else ""
                log.info(
                    "done: steps=%d loss %.2f -> %.2f%s tokens/s=%s peak_mem=%.0fMiB first_step=%.1fs total=%.1fs run=%s",
                    result["steps"], history[0][1], history[-1][1], val, f"{tokens_per_s:,.0f}", result["peak_mem_mib"],
                    first_step_s, total_s, self.run_dir,
                )
            else:
                log.info("done: nothing to do, the checkpoint is at or past trainer.steps=%d", tr.steps)
        return result


# ----------------------------------------------------------------------------- sweeps


def summary_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job folder of a sweep that wrote ``summary.json``, in job order."""
    rows = []
    for path in sweep_dir.glob(f"*/{SUMMARY_FILE}"):
        data = json.loads(path.read_text())
        job = path.parent.name
        rows.append({"job": job, **{k: data.get(k) for k in SUMMARY_COLUMNS if k != "job"}})

    def order(row: dict[str, Any]) -> tuple[int, str]:
        return (int(row["job"]) if str(row["job"]).isdigit() else 1 << 30, str(row["job"]))

    return sorted(rows, key=order)


_FORMATS = {"final_loss": "{:.4f}", "val_loss": "{:.4f}", "tokens_per_s": "{:,.0f}", "peak_mem_mib": "{:,.0f}", "total_s": "{:.1f}"}


def _cell(key: str, value: Any) -> str:
    if value is None:
        return ""
    if key in _FORMATS and isinstance(value, (int, float)):
        return _FORMATS[key].format(value)
    return str(value).replace("|", "\\|")


def write_sweep_summary(sweep_dir: str | Path) -> str:
    """Write ``summary.csv`` and ``summary.md`` for a sweep; returns the markdown table."""
    sweep_dir = Path(sweep_dir)
    rows = summary_rows(sweep_dir)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=SUMMARY_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    (sweep_dir / "summary.csv").write_text(buffer.getvalue())
    header = ["job", "config", "status", "steps", "final loss", "val loss", "tokens/s", "peak mem (MiB)", "time (s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(k, row[k]) for k in SUMMARY_COLUMNS) + " |")
    table = "\n".join(lines) + "\n"
    (sweep_dir / "summary.md").write_text(f"# sweep {sweep_dir}\n\n{table}")
    return table


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra-core is a dependency
    _HydraCallback = object  # type: ignore[assignment,misc]


class SweepSummary(_HydraCallback):
    """Hydra callback: after a ``-m`` sweep, tabulate every job (CSV and markdown)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        table = write_sweep_summary(sweep_dir)
        log.info("sweep summary (%s):\n%s", sweep_dir / "summary.md", table)


# ----------------------------------------------------------------------------- entry point


def _task(cfg: Any) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    try:
        result = run(cfg, hydra_cfg.runtime.output_dir, overrides=list(hydra_cfg.overrides.task))
    except ConfigError as exc:
        print(f"boost-train: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if result["status"] == "stopped":
        raise SystemExit(128 + int(signal.Signals[result["signal"]]))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    """``boost-train [overrides] [-m]``: the Hydra app (argv defaults to ``sys.argv[1:]``)."""
    import hydra

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    register_configs()
    if env_world_size() > 1 and int(os.environ.get("RANK", "0")) > 0:
        # only rank 0 writes the run folder's config and log; the others print warnings
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=boost_worker"]
    app = hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")(_task)
    try:
        app()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
