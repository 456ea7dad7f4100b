"""Pipeline parallelism in ``boost-train`` (``parallel.pp > 1``), on :mod:`boost_compile.distributed.pipeline`.

Every rank builds the whole model from the shared seed (so every stage starts
from the one-process run's weights), cuts its own stages out of it with
``split_model`` (stage ``i`` of ``pp * stages_per_rank`` on pipeline rank
``i % pp``), frees the rest, shards each stage over its tp group when
``tp > 1`` (``parallelize_(stage, ..., stream_io=True)``: under btp a stage
takes and returns its d-slice of the stream, so the activation sent between
stages is ``[mb, s, d/tp]``), and compiles each stage like the one-process path
compiles the model. A training step is ``pipeline_step`` on the schedule, then:

* data parallelism (``dp > 1``): the stage gradients are averaged over the dp
  group in buckets of ``parallel.bucket_mb``, each all-reduce issued during the
  schedule's backward as soon as its gradients are final (``dp_buckets.py``). DDP
  cannot wrap the stages here: ``build_schedule`` takes the modules ``split_model``
  made (optionally compiled), and PyTorch's ``PipelineStage`` would need the DDP
  module itself to drive its reducer micro-batch by micro-batch;
* FSDP2 (``parallel.dp_shard > 1``): each stage's blocks are compiled, then sharded over the
  data-parallel ranks of its pipeline rank like the whole model without pp (``train/fsdp.py``),
  the stage the root unit. PyTorch's ``PipelineStage`` drives an ``FSDPModule`` itself: each
  micro-batch's backward keeps its gradients unreduced, and after the last the stage's units are
  reduce-scattered (and, HSDP, all-reduced over the replicas) at once, averaged over the data
  ranks; the schedule then divides by the micro-batches. With ``trainer.local_batch`` that is
  once per slice of the batch, the shards adding up. ``zero_bubble`` is refused (validate.py);
* gradient clipping (:func:`~boost_compile.train.step.clip_grad_norm`): TP
  shards' squared norms are summed over tp, then every stage's over pp, so
  every rank clips with the whole model's norm;
* the loss: the last stage's mean micro-batch loss, averaged over dp and summed
  over pp (the other stages add zeros), so every rank, rank 0 included, has it.

The optimizer, gradient clipping and checkpoints see :class:`StageParameters`, one
module holding this rank's stage modules under the whole model's names
(``layers.3...``, ``tok_embeddings.weight``; a Hugging Face model's under
``hf.``), so a DCP checkpoint of a pipeline run names each parameter and its
optimizer state as the one-process run does, every rank saving its own stages
(TP shards as DTensors over the tp group, as without pp).

Evaluation (:class:`PipelineForward`) runs the stages forward in order without
gradients, micro-batch by micro-batch, sending the hidden stream point to point
over the pp group: eager stages without tp, the compiled ones with it (a TP
stage's collectives exist only in its compiled graph).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from boost_compile import _torch_compat as compat
from boost_compile.backend import Recorder
from boost_compile.config import ConfigError
from boost_compile.distributed.expert_parallel import is_expert_parameter
from boost_compile.train.config import TrainConfig
from boost_compile.train.model import HFCausalLM, build_model, build_on_meta, defers_init, materialize_part
from boost_compile.train.parallel import Dist, cast_weights, compile_model, fsdp_mesh, shard_experts
from boost_compile.train.step import StepFn, StepOutput, make_optimizer_tail
from boost_compile.train.validate import ModelShape

log = logging.getLogger("boost_compile.train")


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The micro-batch mean loss, as the whole model's ``forward(tokens, targets)`` computes it."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class StageParameters(nn.Module):
    """This rank's stage modules under the whole model's names (no forward).

    A fresh tree of plain modules whose leaves are the stages' own submodules
    (shared, not copied): ``named_parameters()`` gives ``layers.0...`` for the
    block that stage 0 holds and ``layers.2...`` for stage 2's, as the whole
    model names them.
    """

    def __init__(self, stages: Sequence[nn.Module], prefix: str = "") -> None:
        super().__init__()
        root: nn.Module = self
        if prefix:
            root = nn.Module()
            self.add_module(prefix, root)
        fresh = {id(root)}
        for stage in stages:
            self._place(root, stage, fresh)

    @staticmethod
    def _place(dst: nn.Module, src: nn.Module, fresh: set[int]) -> None:
        for name, p in src.named_parameters(recurse=False):
            dst.register_parameter(name, p)
        for name, child in src.named_children():
            mine = dst._modules.get(name)
            if mine is None:
                dst.add_module(name, child)
                continue
            if id(mine) not in fresh:  # another stage's module at this path: split it into a fresh node
                node = nn.Module()
                fresh.add(id(node))
                StageParameters._place(node, mine, fresh)
                dst._modules[name] = node
                mine = node
            StageParameters._place(mine, child, fresh)

    def forward(self, *args: Any) -> Any:  # pragma: no cover - a holder, never called
        raise RuntimeError("StageParameters holds parameters; run the stages through the schedule")


def _send_recv_peer(dev: Dist, pp_rank: int) -> int:
    """The global rank of pipeline rank ``pp_rank`` in this rank's pp group."""
    return dist.get_global_rank(dev.group("pp"), pp_rank)


class PipelineForward(nn.Module):
    """``forward(tokens, targets)``: the loss of a batch through the pipeline, no gradients.

    The batch runs as the training step's micro-batches (``micro_batch`` rows
    each), one after the other through the stages, and the loss is their mean:
    compiled stages then meet the shapes they were compiled for. Returns the loss
    on the ranks holding the last stage and zeros elsewhere
    (:func:`~boost_compile.train.loop.evaluate` sums it over pp).
    """

    def __init__(self, stages: Sequence[nn.Module], indices: Sequence[int], num_stages: int, dev: Dist,
                 micro_batch: int, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn) -> None:
        super().__init__()
        self.loss = loss
        self.stages = nn.ModuleList(stages)
        self.indices = list(indices)
        self.num_stages = num_stages
        self.dev = dev
        self.micro_batch = micro_batch

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from boost_compile.distributed.pipeline import stage_module

        dev, pp = self.dev, self.dev.pp
        group = dev.group("pp")
        local = dict(zip(self.indices, self.stages, strict=True))
        losses: list[torch.Tensor] = []
        for x_mb, y_mb in zip(tokens.split(self.micro_batch), targets.split(self.micro_batch), strict=True):
            for i in range(self.num_stages):
                stage = local.get(i)
                if stage is None:
                    continue
                if i == 0:
                    x = x_mb
                else:
                    meta = stage_module(stage)
                    width = meta.hidden_size // getattr(meta, "_boost_stream_shards", 1)
                    x = torch.empty(*x_mb.shape, width, dtype=meta.hidden_dtype, device=tokens.device)
                    dist.recv(x, src=_send_recv_peer(dev, (i - 1) % pp), group=group)
                h = stage(x)
                if i == self.num_stages - 1:
                    losses.append(self.loss(h, y_mb))
                else:
                    dist.send(h.contiguous(), dst=_send_recv_peer(dev, (i + 1) % pp), group=group)
        if not losses:
            return torch.zeros((), device=tokens.device)
        return torch.stack(losses).mean()


@dataclass
class PipelineParts:
    """This rank's share of the pipeline."""

    model: StageParameters  # the local stages' parameters, whole-model names: optimizer, checkpoints, clipping
    stages: list[nn.Module]  # eager stage modules (split_model's)
    indices: list[int]  # their stage indices
    num_stages: int
    schedule: Any  # the torch.distributed.pipelining schedule over the compiled stages
    eval_fn: PipelineForward
    total_params: int  # of the whole model


def _parallelize_stages(stages: Sequence[nn.Module], indices: Sequence[int], tc: TrainConfig, dev: Dist,
                        micro_batch: int) -> None:
    """Shard each stage over the tp group; btp stages take and return their d-slice of the stream, and
    the last stage returns its vocabulary slice of the logits (the loss is ``vocab_parallel_loss``)."""
    import boost_compile

    seq = tc.trainer.seq
    for i, stage in zip(indices, stages, strict=True):
        if i == 0:
            example = torch.zeros(micro_batch, seq, dtype=torch.long, device=dev.device)
        else:  # the whole stream; parallelize_ slices it for a btp stage
            example = torch.zeros(micro_batch, seq, stage.hidden_size, dtype=stage.hidden_dtype, device=dev.device)
        last = i == stage.num_stages - 1  # returns its vocabulary slice of the logits: the loss is vocabulary-parallel
        report = boost_compile.parallelize_(stage, (example,), dev.mesh["tp"], plan=tc.parallel.plan, stream_io=True,
                                            shard_logits=last)
        log.info("stage %d: %s", i, report)


def _original_names(stage: nn.Module, whole: nn.Module, memo: dict[int, Any]) -> dict[str, str]:
    """Each of ``stage``'s parameter names -> the name of the whole model's parameter it was copied
    from (``split_model``'s ``memo``: the original's id -> its copy)."""
    from boost_compile.meta_init import canonical_name

    original = {id(memo[id(p)]): n for n, p in whole.named_parameters(remove_duplicate=False) if id(p) in memo}
    return {canonical_name(n): original[id(p)] for n, p in stage.named_parameters(remove_duplicate=False)
            if id(p) in original}


def _shard_stages(stages: Sequence[nn.Module], indices: Sequence[int], tc: TrainConfig, dev: Dist) -> None:
    """FSDP2 over each compiled stage (``parallel.dp_shard > 1``): its blocks, embedding and head as
    units, the stage the root (:func:`~boost_compile.train.fsdp.shard_model`), so that ``PipelineStage``
    sees an ``FSDPModule``: it then runs every micro-batch's backward without reducing and
    reduce-scatters the stage's gradients once, after the last (``perform_reduce_grad``)."""
    from boost_compile.train.fsdp import shard_model

    for i, stage in zip(indices, stages, strict=True):
        if compat.is_compiled_module(stage):
            raise ConfigError(f"parallel.dp_shard > 1 with pp: stage {i} was compiled whole; FSDP2 shards stages whose "
                              "blocks are compiled one by one (passes.unit=block)")
        shard_model(stage, fsdp_mesh(dev), tc.trainer.precision, tc.parallel.reshards_after_forward,
                    dev.experts_fsdp_mesh)


def stage_recompile_limit(tc: TrainConfig) -> contextlib.AbstractContextManager[None]:
    """Dynamo's recompile limit raised for this rank's stages while inside (the run), then put back.

    The local stages share their class's forward, whose compiled entries (training and
    evaluation graphs of each stage) count against one limit."""
    stages = tc.parallel.stages_per_rank
    needed = 2 * stages + 2
    if compat.dynamo_recompile_limit_value() < needed:
        log.info("raising Dynamo's recompile_limit to %d for %d stages of one class", needed, stages)
    return compat.dynamo_recompile_limit(needed)


def build_pipeline_parts(
    tc: TrainConfig,
    shape: ModelShape,
    dev: Dist,
    *,
    before_compile: Callable[[nn.Module], None] | None = None,
    recorder: Recorder | None = None,
) -> PipelineParts:
    """Build the model, keep this rank's stages, shard them over tp, cast, bind (``before_compile``),
    compile (into ``recorder`` too: see :func:`~boost_compile.train.parallel.compile_model`), schedule.
    Run it, and the steps, inside ``stage_recompile_limit(tc)``."""
    from boost_compile.distributed.pipeline import (
        PipelineError,
        build_schedule,
        split_model,
        vocab_parallel_loss,
    )

    par, tr = tc.parallel, tc.trainer
    # on meta (model.init=per_parameter), each rank materialises its own stages only
    recipe = None
    if defers_init(tc):
        whole, recipe = build_on_meta(tc, shape, dev.device)
    else:
        whole = build_model(tc, shape, dev.device)
    total = sum(p.numel() for p in whole.parameters())
    target, prefix = (whole.hf, "hf") if isinstance(whole, HFCausalLM) else (whole, "")
    num_stages = dev.pp * par.stages_per_rank
    indices = list(range(dev.pp_rank, num_stages, dev.pp))
    memos: list[dict[int, Any]] = [{} for _ in indices]
    try:
        layers = list(par.layers_per_stage) if par.layers_per_stage is not None else None
        stages = [split_model(target, i, num_stages, layers_per_stage=layers, memo=memo)
                  for i, memo in zip(indices, memos, strict=True)]
    except PipelineError as exc:
        raise ConfigError(f"parallel.pp={dev.pp}: {exc}") from exc
    # a stage's parameters are copies: each named by its original's name in the whole model
    renames = [_original_names(stage, whole, memo) for stage, memo in zip(stages, memos, strict=True)]
    # each rank materialises its stages as it will hold them: whole, its TP shards, or its FSDP2 slices
    if recipe is not None and dev.dp_shard == 1 and dev.tp == 1 and dev.ep == 1:
        for i, stage, names in zip(indices, stages, renames, strict=True):
            materialize_part(stage, recipe, dev.device, f"stage {i}", names)
    del whole, target, memos
    local_batch = tr.rank_batch(dev.dp)  # one micro-step's rows (the whole share without accumulation)
    n_mb = par.n_microbatches
    micro_batch = local_batch // n_mb
    if dev.tp > 1:
        _parallelize_stages(stages, indices, tc, dev, micro_batch)
        if recipe is not None and dev.dp_shard == 1 and dev.ep == 1:
            for i, stage, names in zip(indices, stages, renames, strict=True):
                materialize_part(stage, recipe, dev.device, f"stage {i}'s TP shards", names)
    if dev.ep > 1:  # each stage's experts over the stage's expert group, then its part materialised
        for i, stage, names in zip(indices, stages, renames, strict=True):
            shard_experts(stage, dev, f"stage {i}")
            if recipe is not None and dev.dp_shard == 1:
                materialize_part(stage, recipe, dev.device, f"stage {i}'s experts and its other weights", names)
    for stage in stages:
        cast_weights(stage, tr.precision)
    def bind() -> StageParameters:
        holder = StageParameters(stages, prefix)
        if before_compile is not None:
            before_compile(holder)
        return holder

    fsdp = dev.dp_shard > 1  # FSDP2: the stages' parameters are final once sharded, after the blocks compile
    holder = None if fsdp else bind()
    compiled = [compile_model(stage, tc, dynamic=False, recorder=recorder) for stage in stages]
    if fsdp:
        _shard_stages(compiled, indices, tc, dev)
        if recipe is not None:
            for i, stage, names in zip(indices, stages, renames, strict=True):
                materialize_part(stage, recipe, dev.device, f"stage {i}'s FSDP2 shards", names)
        holder = bind()
    example = torch.zeros(micro_batch, tr.seq, dtype=torch.long, device=dev.device)
    loss = loss_fn
    if dev.tp > 1 and num_stages - 1 in indices:
        loss = vocab_parallel_loss(compiled[indices.index(num_stages - 1)])
    try:
        schedule = build_schedule(compiled, indices, num_stages, dev.group("pp"), n_mb, par.pp_schedule, loss,
                                  example, batch_size=local_batch, device=dev.device,
                                  scale_grads=tr.micro_steps(dev.dp) == 1 and (dev.dp == 1 or dev.dp_shard > 1))
    except PipelineError as exc:
        raise ConfigError(f"parallel.pp_schedule={par.pp_schedule}: {exc}") from exc
    for i, stage in zip(indices, stages, strict=True):
        log.info("pipeline stage %d/%d on pp rank %d: blocks %s%s%s", i, num_stages, dev.pp_rank,
                 list(stage.layer_range), " + embedding" if i == 0 else "", " + head" if i == num_stages - 1 else "")
    # a TP stage runs only through the backend (its collectives are inserted there); evaluation
    # without TP stays eager, as in the one-process run
    evaluated = compiled if dev.tp > 1 else stages
    return PipelineParts(
        model=holder, stages=stages, indices=indices, num_stages=num_stages, schedule=schedule,
        eval_fn=PipelineForward(evaluated, indices, num_stages, dev, micro_batch, loss), total_params=total,
    )


def make_pipeline_step(
    parts: PipelineParts,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    grad_clip: float,
    dev: Dist,
    autocast: Callable[[], Any],
    micro_steps: int = 1,
    bucket_mb: float = 25.0,
) -> StepFn:
    """``step(inputs, targets)`` through the pipeline; returns a :class:`~boost_compile.train.step.StepOutput`.

    With ``micro_steps > 1`` (``trainer.local_batch``) the batch runs through the schedule as
    that many slices; the schedule was built without ``scale_grads``, so the gradients add up
    over every slice's micro-batches and are divided once, by their number. With ``dp > 1``
    (without FSDP2, which averages over the data ranks itself) the schedule never scales them:
    :class:`~boost_compile.train.dp_buckets.BucketedDpAverage` all-reduces them in buckets of
    ``bucket_mb`` MiB during the backward and divides the sums by the dp ranks and micro-batches once.
    """
    from boost_compile.distributed.pipeline import pipeline_step
    from boost_compile.train.dp_buckets import BucketedDpAverage

    params = list(parts.model.parameters())
    tail = make_optimizer_tail(parts.model, optimizer, scheduler, grad_clip, dev)
    # FSDP2 (dp_shard > 1) reduce-scatters (and averages) each stage's gradients itself; expert
    # parallelism's experts are each rank's own (their mean over the expert group is in the graph)
    experts = [p for p in params if is_expert_parameter(p)] if dev.dp_shard == 1 else []
    shared = [(n, p) for n, p in parts.model.named_parameters() if not is_expert_parameter(p)]
    average = BucketedDpAverage(shared, dev.group("dp"), dev.dp, bucket_mb) if dev.dp > 1 and dev.dp_shard == 1 else None

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        slices = zip(inputs.chunk(micro_steps), targets.chunk(micro_steps), strict=True)
        if average is not None:
            average.begin()
        with autocast():
            losses = [pipeline_step(parts.schedule, x, y) for x, y in slices]
        if average is not None:
            average.finish(micro_steps * parts.schedule._n_microbatches)
            for p in experts:  # summed over the micro-batches, as the others before their average
                if p.grad is not None:
                    p.grad.div_(micro_steps * parts.schedule._n_microbatches)
        elif micro_steps > 1:
            scale = micro_steps * parts.schedule._n_microbatches
            for p in params:
                if p.grad is not None:
                    p.grad.div_(scale)
        loss = None if losses[0] is None else (losses[0] if micro_steps == 1 else torch.stack(losses).mean())
        value = loss.float() if loss is not None else torch.zeros((), device=dev.device)
        return tail(lambda: dev.sum_over_pp(dev.mean_over_dp(value)))

    return step
