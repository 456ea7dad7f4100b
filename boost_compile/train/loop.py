"""The training loop: one :class:`Trainer` per run.

:meth:`Trainer.fit` sets the run up (data, the model through
:func:`~boost_compile.train.parallel.build_model_parts`, optimizer, checkpoint,
resume), makes the step function (:func:`make_train_step`: forward and backward,
then :mod:`~boost_compile.train.step`'s clipping, optimizer and schedule) and
hands it to :meth:`Trainer.train`, which times steps, logs them, evaluates,
checkpoints and stops on a signal.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from boost_compile import _torch_compat as compat
from boost_compile.distributed.expert_parallel import expert_load
from boost_compile.train.checkpoint import Checkpointer, StopOnSignal, checkpoint_dir
from boost_compile.train.collective_errors import reported_collectives, step_collectives
from boost_compile.train.config import TrainConfig
from boost_compile.train.data import PackedTokens, load_corpus, make_loaders
from boost_compile.train.faults import faults_from_env
from boost_compile.train.fsdp import is_sharded, no_gradient_sync
from boost_compile.train.memory_report import MemoryReport
from boost_compile.train.metrics import (
    METRICS_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    MetricsWriter,
    PeakMemory,
    Progress,
    address_space_bytes,
    count_restarts,
    plot_losses,
    wandb_run,
    write_summary,
)
from boost_compile.train.model import fit_vocab
from boost_compile.train.moe_balance import after_step as moe_after_step
from boost_compile.train.optim import make_optimizer
from boost_compile.train.parallel import Dist, ModelParts, attempt, build_model_parts, global_numel
from boost_compile.train.replica_streams import seed_replica, seed_resumed_replica
from boost_compile.train.step import StepFn, StepOutput, make_optimizer_tail
from boost_compile.train.utilization import Utilization, utilization
from boost_compile.train.validate import ModelShape, boost_options

log = logging.getLogger("boost_compile.train")


# ----------------------------------------------------------------------------- one step


def make_train_step(
    parts: ModelParts,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    grad_clip: float,
    dev: Dist,
    autocast: Callable[[], Any],
    micro_steps: int = 1,
) -> StepFn:
    """``step(inputs, targets)``: forward and backward, clip, update the weights and the schedule.

    With ``micro_steps > 1`` (gradient accumulation, ``trainer.local_batch``) the rank's batch
    runs as that many equal slices, each loss scaled by ``1 / micro_steps`` before its backward,
    so the summed gradients are those of the batch's mean loss; under DDP only the last slice's
    backward all-reduces them (the others run in ``no_sync``; under FSDP2 only the last reduce-scatters
    them). The slices have one shape: the
    compiled step is reused.
    """
    train_fn = parts.train_fn
    tail = make_optimizer_tail(parts.model, optimizer, scheduler, grad_clip, dev)
    settings = parts.compile_settings
    no_sync = getattr(train_fn, "no_sync", None)  # DDP's; a one-process module has none
    if is_sharded(train_fn):  # FSDP2: one reduce-scatter per step, in the last micro-step's backward
        no_sync = functools.partial(no_gradient_sync, train_fn)

    def forward_backward(inputs: torch.Tensor, targets: torch.Tensor, scale: float | None) -> torch.Tensor:
        with autocast(), compat.compile_settings(dynamo=settings) if settings else contextlib.nullcontext():
            loss = train_fn(inputs, targets)
        (loss if scale is None else loss * scale).backward()
        return loss.detach().to(torch.promote_types(loss.dtype, torch.float32))  # bf16 up, fp64 kept

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        if micro_steps == 1:
            loss = forward_backward(inputs, targets, None)
            return tail(lambda: dev.mean_over_dp(loss))
        losses = []
        slices = list(zip(inputs.chunk(micro_steps), targets.chunk(micro_steps), strict=True))
        for i, (x, y) in enumerate(slices):
            last = i == len(slices) - 1
            with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
                losses.append(forward_backward(x, y, 1.0 / micro_steps))
        loss = torch.stack(losses).mean()
        return tail(lambda: dev.mean_over_dp(loss))

    return step


@torch.no_grad()
def evaluate(forward: nn.Module, data: PackedTokens, n_batches: int | None, dev: Dist, autocast: Any,
             rows: int | None = None) -> float:
    """Mean loss over this rank's first ``n_batches`` val batches, averaged over dp.

    ``rows``: the most sequences one forward takes (``trainer.local_batch`` under gradient
    accumulation); a larger batch runs in slices whose losses are weighted by their rows, so
    the value is the whole batch's mean. With pipeline parallelism ``forward`` gives the loss
    on the last stage and zeros elsewhere; the sum over pp puts it on every rank.
    """
    count = len(data) if n_batches is None else min(n_batches, len(data))
    total = torch.zeros((), device=dev.device, dtype=torch.float64)
    for index in range(count):
        inputs, targets = (t.to(dev.device) for t in data.batch(0, index))
        with autocast():
            if rows is None or len(inputs) <= rows:
                total += forward(inputs, targets).double()
            else:
                parts = [forward(x, y).double() * len(x) for x, y in zip(inputs.split(rows), targets.split(rows), strict=True)]
                total += torch.stack(parts).sum() / len(inputs)
    return float(dev.sum_over_pp(dev.mean_over_dp(total / max(1, count))))


# ----------------------------------------------------------------------------- the run


class Trainer:
    """One run of ``boost-train`` on this rank: :meth:`fit` returns its summary."""

    def __init__(
        self,
        tc: TrainConfig,
        shape: ModelShape,
        dev: Dist,
        run_dir: Path,
        overrides: list[str],
        candidates: list[Path],
    ) -> None:
        self.tc, self.shape, self.dev, self.run_dir = tc, shape, dev, run_dir
        self.overrides = overrides
        self.candidates = candidates  # the checkpoints trainer.resume may load, in order
        self.resumed_from: Path | None = None
        self.faults = faults_from_env(dev.rank)
        self.restarts = 0  # earlier starts of this run in the same folder
        self.label = " ".join(overrides) if overrides else "defaults"
        self.title = self.label
        # set by _bind, once the model's parameters are final
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.ckpt: Checkpointer | None = None
        self.start = 0  # the step a resumed checkpoint was saved after
        self.state: dict[str, int] | None = None  # bytes of params, grads, optimizer state (first step)
        self.utilization: Utilization | None = None  # model FLOPs per token and the peak (MFU), set by _describe
        #: seconds from building the model to its compiled form, before the first step (summary's setup_s):
        #: under tp parallelize_'s captures of the whole model are here, not in first_step_s
        self.setup_s = 0.0
        #: memory of the start, set by _measure_start (summary's ``start``)
        self.start_memory: dict[str, float | None] = {}
        # trainer.memory_report: memory_rank{R}.json, the last step profiled (inert when off)
        self.memory_report = MemoryReport(tc.trainer.memory_report, run_dir, dev.rank, tc.trainer.steps, dev.device)

    def autocast(self) -> Any:
        if self.tc.trainer.precision == "bf16-mixed":
            return torch.autocast(self.dev.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def fit(self) -> dict[str, Any]:
        """Set up the data, the model, the optimizer and the checkpoint (resumed), then train."""
        tc, dev, tr = self.tc, self.dev, self.tc.trainer
        torch.manual_seed(tr.seed)
        random.seed(tr.seed)
        corpus = load_corpus(tc.data, self.run_dir, dev)  # tokenized (and tokenizer.json saved)
        self.shape = fit_vocab(self.shape, tc.model, corpus.tokenizer.vocab_size)
        train_data, val_data = make_loaders(tc, corpus, dev)
        if dev.pp > 1:
            return self._fit_pipeline(train_data, val_data)
        # parallelize_ traces one micro-step's batch: the shape every step then runs
        example = train_data.batch(0, 0)[0][: tr.rank_batch(dev.dp)].to(dev.device) if dev.tp > 1 else None
        begin = time.perf_counter()
        with self._measure_start():
            parts = build_model_parts(
                tc, self.shape, dev, example, before_compile=lambda model: self._bind(model, train_data),
                recorder=self.memory_report.recorder,
            )
        self.setup_s = time.perf_counter() - begin
        assert self.optimizer is not None
        self.memory_report.bind(parts.model, self.optimizer, parts.train_fn)
        self._describe(parts.model)
        step = make_train_step(parts, self.optimizer, self.scheduler, tc.optim.grad_clip, dev, self.autocast,
                               tr.micro_steps(dev.dp))
        return self.train(step, train_data, val_data, parts.eval_fn)

    def _fit_pipeline(self, train_data: PackedTokens, val_data: PackedTokens) -> dict[str, Any]:
        """``parallel.pp > 1``: this rank's stages, the schedule's step, the pipeline's evaluation."""
        from boost_compile.train.pipeline import (
            build_pipeline_parts,
            make_pipeline_step,
            stage_recompile_limit,
        )

        tc, dev = self.tc, self.dev
        with stage_recompile_limit(tc):
            begin = time.perf_counter()
            with self._measure_start():
                parts = build_pipeline_parts(tc, self.shape, dev, before_compile=lambda model: self._bind(model, train_data),
                                             recorder=self.memory_report.recorder)
            self.setup_s = time.perf_counter() - begin
            assert self.optimizer is not None
            self.memory_report.bind(parts.model, self.optimizer)
            self._describe(parts.model, parts.total_params)
            step = make_pipeline_step(parts, self.optimizer, self.scheduler, tc.optim.grad_clip, dev, self.autocast,
                                      tc.trainer.micro_steps(dev.dp), bucket_mb=tc.parallel.bucket_mb)
            return self.train(step, train_data, val_data, parts.eval_fn)

    @contextlib.contextmanager
    def _measure_start(self) -> Any:
        """This rank's memory while the model is built, sharded, bound and compiled (the start):
        the address space before it (the process's baseline: Python, torch, the process group) and
        the peak during it (RSS sampled, or CUDA's max allocated); in the summary as ``start``."""
        baseline = address_space_bytes()
        with PeakMemory(self.dev.device) as memory:
            before = memory.mib  # RSS (or CUDA allocated) as the start begins
            yield
        self.start_memory = {"baseline_vm_mib": baseline / 2**20 if baseline else None, "peak_mib": memory.mib,
                             "growth_mib": memory.mib - before}
        log.info("start: peak %.0f MiB (%s) building the model%s", memory.mib,
                 "CUDA max allocated" if self.dev.device.type == "cuda" else "RSS",
                 f", address space {baseline / 2**20:,.0f} MiB before it" if baseline else "")

    def _bind(self, model: nn.Module, data: PackedTokens) -> None:
        """Each replica's and stage's own random stream (replica_streams.py), then the optimizer,
        schedule and checkpointer over ``model``; restore them when resuming."""
        tc = self.tc
        seed_replica(tc.trainer.seed, self.dev.dp_rank, self.dev.pp_rank)
        zero_group = self.dev.group("dp") if tc.parallel.zero else None
        self.optimizer, self.scheduler = make_optimizer(model, tc.optim, tc.trainer.steps, zero_group)
        ckpt_dir = checkpoint_dir(tc.checkpoint, self.run_dir)
        in_save = self.faults.in_save if self.faults.in_saves else None
        self.ckpt = Checkpointer(
            tc.checkpoint, ckpt_dir, self.dev, model, self.optimizer, self.scheduler, data, before_metadata=in_save
        )
        self.start, self.resumed_from = self.ckpt.resume(self.candidates, auto=tc.trainer.resume == "auto")
        if self.resumed_from is not None:
            log.info("resumed from %s (step %d)", self.resumed_from, self.start)
            if not self.ckpt.rng_restored:  # another layout saved it: not the first steps' stream again
                seed_resumed_replica(tc.trainer.seed, self.dev.dp_rank, self.dev.pp_rank, self.start)

    def _describe(self, model: nn.Module, params: int | None = None) -> None:
        tc, dev, tr = self.tc, self.dev, self.tc.trainer
        if params is None:
            params = sum(global_numel(p, dev) for p in model.parameters())
        boost = boost_options(tc.passes)
        backend = tc.passes.backend + (f"(inner={boost.inner})" if boost is not None else "")
        model_name = (f"export:{Path(tc.model.hf_path).name}" if tc.model.hf_path and self.shape.kind == "preset"
                      else tc.model.preset if self.shape.kind == "preset" else f"hf:{self.shape.hf_config.model_type}")
        dp = f"dp={dev.dp}" if dev.dp_shard == 1 else f"dp={dev.dp // dev.dp_shard}x{dev.dp_shard} (fsdp2)"
        mesh = f"{dp} tp={dev.tp}" if dev.pp == 1 else f"pp={dev.pp} {dp} tp={dev.tp}"
        self.title = f"{model_name}, {backend}, {mesh}: {self.label}"
        if dev.pp > 1:
            par = tc.parallel
            mesh += (f" pp_schedule={par.pp_schedule} microbatches={par.n_microbatches} "
                     f"stages_per_rank={par.stages_per_rank}")
        log.info(
            "model=%s params=%s backend=%s device=%s %s batch=%d seq=%d steps=%d precision=%s threads=%d",
            model_name, f"{params:,}", backend, dev.device, mesh, tr.batch, tr.seq, tr.steps,
            tr.precision, torch.get_num_threads(),
        )
        log.info("run folder: %s", self.run_dir)
        self.utilization = utilization(tc, model, self.shape, dev)

    def train(self, step_fn: StepFn, train_data: PackedTokens, val_data: PackedTokens, eval_fn: nn.Module) -> dict[str, Any]:
        """Steps ``self.start + 1 .. trainer.steps`` of ``step_fn``, with evaluation and checkpoints."""
        tc, dev, tr = self.tc, self.dev, self.tc.trainer
        assert self.ckpt is not None
        ckpt, start = self.ckpt, self.start
        earlier_rows, self.restarts = dev.broadcast(count_restarts(self.run_dir / METRICS_FILE) if dev.is_main else None)
        restart = earlier_rows > 0  # an earlier start of this run wrote here: the rows after `start` are redone
        metrics = MetricsWriter(
            self.run_dir, enabled=dev.is_main, tensorboard=tc.metrics.tensorboard,
            purge_step=start + 1 if start or restart else None,
            wandb=wandb_run(tc, self.run_dir, self.overrides) if dev.is_main else None,
        )
        if restart:
            self.restarts += 1
            metrics.write({"event": "restart", "step": start, "restart": self.restarts, "attempt": attempt(),
                           "checkpoint": str(self.resumed_from) if self.resumed_from else None})
            log.info("restart %d of this run: from step %d (%s)", self.restarts, start,
                     self.resumed_from or "no checkpoint: from the start")
        timeout_s, collectives = tc.parallel.timeout_s, step_collectives(dev)
        progress = Progress(tr.progress, tr.steps, start, tr.log_every, tr.batch * tr.seq, dev.is_main)
        tokens_per_step = tr.batch * tr.seq
        history: list[tuple[int, float]] = []
        val_loss: float | None = None
        first_step_s = steady_s = 0.0
        status = "completed"
        stopper = StopOnSignal(tc.checkpoint.on_signal)
        begin = time.perf_counter()
        if tc.checkpoint.enabled and tc.checkpoint.at_start and start == 0 and not restart:
            with reported_collectives(dev, "the checkpoint save (DCP's gathers to rank 0)", 0, timeout_s):
                progress.message(f"checkpoint: {ckpt.save(0)} (the starting weights)")
        try:
            with stopper, PeakMemory(dev.device) as memory:
                last = time.perf_counter()
                for step in range(start + 1, tr.steps + 1):
                    inputs, targets = next(train_data)
                    self.faults.before_step(step)
                    with (reported_collectives(dev, f"the training step ({collectives})", step, timeout_s),
                          self.memory_report.step(step)):
                        out = step_fn(inputs.to(dev.device), targets.to(dev.device))
                        # the reference MoE: routing over the global batch, router biases moved (all-reduces)
                        moe = moe_after_step(ckpt.model, dev.group("dp"), dev.group("pp") if dev.pp > 1 else None)
                    self.faults.after_step(step)
                    ckpt.poll()
                    now = time.perf_counter()
                    step_s, last = now - last, now
                    first = step == start + 1
                    if first:
                        first_step_s = step_s
                    else:
                        steady_s += step_s
                    history.append((step, out.loss))
                    if out.state is not None:
                        self.state = out.state
                    rate = tokens_per_step / max(step_s, 1e-9)
                    row = {"step": step, "loss": out.loss, "lr": out.lr, "tokens": step * tokens_per_step,
                           "tokens_per_s": rate, "step_s": step_s, "time_s": now - begin}
                    mfu = self.utilization.mfu(rate) if self.utilization is not None else None
                    if mfu is not None:  # omitted without a known peak (logged once)
                        row["mfu"] = mfu
                    if out.grad_norm is not None:
                        row["grad_norm"] = out.grad_norm
                    if dev.ep > 1:  # tokens per expert over every rank (an all-reduce)
                        row.update(expert_load(ckpt.model, dev.group("dp")))
                    row.update(moe)  # the reference MoE's own counts (the same tokens under ep)
                    metrics.write(row)
                    progress.step(step, out.loss, out.lr, step_s, first)
                    if tr.eval_every and step % tr.eval_every == 0 and step != tr.steps:
                        val_loss = self._evaluate(eval_fn, val_data, step, metrics, progress)
                    with reported_collectives(dev, "the stop check (an all-reduce over every rank)", step, timeout_s):
                        stop = dev.any(stopper.signum is not None)
                    saving = tc.checkpoint.enabled and (
                        (tr.save_every and step % tr.save_every == 0)
                        or (stop and tc.checkpoint.on_signal)
                        or (step == tr.steps and tc.checkpoint.at_end)
                    )
                    if saving:
                        with reported_collectives(dev, "the checkpoint save (DCP's gathers to rank 0)", step, timeout_s):
                            path = ckpt.save(step)
                        progress.message(f"checkpoint: {path}" + (" (writing in the background)" if ckpt.pending else ""))
                    if stop:
                        status = "stopped"
                        break
                    last = time.perf_counter()  # evaluation and saving are not step time
                ckpt.wait()  # the last asynchronous save is complete before the run reports it
                if status == "completed" and history:
                    val_loss = self._evaluate(eval_fn, val_data, history[-1][0], metrics, progress)
        except BaseException:
            status = "failed"  # the wandb run is marked failed; the error goes on
            raise
        finally:
            progress.close()
            metrics.close(failed=status == "failed")
        total_s = time.perf_counter() - begin
        self.memory_report.write(self.state)
        return self._finish(history, val_loss, first_step_s, steady_s, total_s, memory.mib, status, stopper.signum, ckpt)

    def _evaluate(self, eval_fn: nn.Module, data: PackedTokens, step: int, metrics: MetricsWriter, progress: Progress) -> float:
        was_training = eval_fn.training
        eval_fn.eval()
        try:
            tr = self.tc.trainer  # a pipeline's forward slices the batch itself
            rows = tr.rank_batch(self.dev.dp) if tr.local_batch is not None and self.dev.pp == 1 else None
            value = evaluate(eval_fn, data, tr.eval_batches, self.dev, self.autocast, rows)
        finally:
            eval_fn.train(was_training)
        metrics.write({"step": step, "val_loss": value})
        progress.message(f"step {step:4d} val loss {value:.3f}")
        return value

    def _state_mib(self) -> dict[str, float] | None:
        """MiB of parameters, gradients and optimizer state on the rank that holds the most of each."""
        keys = ("params", "grads", "optimizer")
        if self.state is None:  # no step ran (still a collective with several ranks)
            values = torch.full((3,), -1.0, dtype=torch.float64)
        else:
            values = torch.tensor([float(self.state[k]) for k in keys], dtype=torch.float64)
        if self.dev.world > 1:
            values = values.to(self.dev.device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        if values[0] < 0:
            return None
        mib = {k: float(v) / 2**20 for k, v in zip(keys, values.tolist(), strict=True)}
        return {**mib, "total": sum(mib.values())}

    def _start_summary(self) -> dict[str, float | None]:
        """The start's memory on the rank with the most of each (MiB): ``baseline_vm_mib`` (the address
        space before the build), ``peak_mib`` (during it), ``growth_mib`` (that peak less what the
        rank held as the start began: what the start itself costs) and ``vm_peak_mib`` (the address
        space's high-water mark over the run so far: what RLIMIT_AS must allow)."""
        keys = ("baseline_vm_mib", "peak_mib", "growth_mib", "vm_peak_mib")
        vm_peak = address_space_bytes("VmPeak")
        mine = {**self.start_memory, "vm_peak_mib": vm_peak / 2**20 if vm_peak else None}
        values = torch.tensor([float(mine.get(k) or -1.0) for k in keys], dtype=torch.float64)
        if self.dev.world > 1:
            values = values.to(self.dev.device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return {k: (round(float(v), 1) if v >= 0 else None) for k, v in zip(keys, values.tolist(), strict=True)}

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
        state_mib = self._state_mib()
        start = self._start_summary()
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
            "mfu": self.utilization.mfu(tokens_per_s) if self.utilization and tokens_per_s else None,
            "flops_per_token": self.utilization.flops_per_token if self.utilization else None,
            "peak_mem_mib": float(peak.item()),
            "state_mib": state_mib,
            "start": start,
            "setup_s": round(self.setup_s, 3),
            "first_step_s": first_step_s,
            "total_s": total_s,
            "world": dev.world,
            "checkpoint": str(ckpt.dir / f"step_{ckpt.last_saved:06d}") if ckpt.last_saved else None,
            "restarts": self.restarts,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
        }
        if dev.is_main:
            write_summary(self.run_dir / SUMMARY_FILE, result)
            if tr.plot and history:
                plot_losses(self.run_dir / METRICS_FILE, self.run_dir / PLOT_FILE, f"{self.title} ({status})")
            if status == "stopped":
                log.warning(
                    "stopped by %s after step %d; checkpoint %s; continue with trainer.resume=true hydra.run.dir=%s",
                    result["signal"], result["steps"], result["checkpoint"], self.run_dir,
                )
            if state_mib is not None:
                log.info(
                    "per rank (the largest): params %.2f MiB + grads %.2f MiB + optimizer state %.2f MiB = %.2f MiB%s",
                    state_mib["params"], state_mib["grads"], state_mib["optimizer"], state_mib["total"],
                    " (optimizer state sharded over dp: parallel.zero=1)" if self.tc.parallel.zero else "",
                )
            if history:
                val = f" (val {val_loss:.2f})" if val_loss is not None else ""
                log.info(
                    "done: steps=%d loss %.2f -> %.2f%s tokens/s=%s%s peak_mem=%.0fMiB first_step=%.1fs total=%.1fs run=%s",
                    result["steps"], history[0][1], history[-1][1], val, f"{tokens_per_s:,.0f}",
                    f" mfu={result['mfu']:.2%}" if result["mfu"] is not None else "", result["peak_mem_mib"],
                    first_step_s, total_s, self.run_dir,
                )
            if not history:
                log.info("done: nothing to do, the checkpoint is at or past trainer.steps=%d", tr.steps)
        return result
