"""Before the model is built: does this rank's memory hold the layout's start and step?

The planner's memory model (:mod:`boost_compile.plan.memory`) prices the layout boost-train is
about to run: the start (the model built, materialised, sharded and cast: ``start_memory``) and
the step's peak (``memory``). Where a rank's memory is bounded, a layout that needs more is refused
before anything is allocated, in one line with the bytes it needs, the bytes the rank has and the
layouts of the same processes that would fit (``boost-plan``'s search): never an allocator error
half-way through the build. What bounds a rank: a CUDA device's free memory; on CPU the address
space RLIMIT_AS (``ulimit -v``) leaves above what the process already maps; without either there
is nothing to check against. ``parallel.check_memory=false`` skips it.
"""

from __future__ import annotations

import logging
import resource

import torch
import torch.distributed as dist

from boost_compile.config import ConfigError
from boost_compile.plan.memory import GIB
from boost_compile.plan.search import CHECKPOINTS, Job, Layout, price, search
from boost_compile.train.config import TrainConfig
from boost_compile.train.metrics import address_space_bytes
from boost_compile.train.model import defers_init
from boost_compile.train.parallel import Dist

log = logging.getLogger("boost_compile.train")

#: What a process holds beyond the tensors the planner counts (the allocator's slack, gloo's
#: buffers, the compiler's own objects), as a share of the planner's figure: a 350M Llama under
#: eager FSDP2 8 grew its address space 2.4% past the planner's bytes (benchmarks/RESULTS.md)
HEADROOM = 0.05


def rank_budget(dev: Dist) -> tuple[int, str] | None:
    """Bytes this rank may still take, and what bounds them; None when nothing does."""
    if dev.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev.device)
        return int(free), f"free on {dev.device}"
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    used = address_space_bytes()
    if soft == resource.RLIM_INFINITY or used is None:
        return None
    return max(0, soft - used), f"RLIMIT_AS {soft / GIB:.2f} GiB less the {used / GIB:.2f} GiB this process maps"


def layout_of(tc: TrainConfig, spec_projection: str) -> Layout:
    """The planner's :class:`Layout` of what ``tc.parallel`` (and the checkpoint option) say."""
    par = tc.parallel
    plan = par.plan if par.plan != "auto" else ("megatron" if spec_projection == "dense" else "btp")
    checkpoint = tc.passes.options.get("checkpoint", "none") if tc.passes.backend == "boost" else "none"
    microbatches = (par.microbatches or 1) if par.pp > 1 else 1
    return Layout(tp=par.tp, pp=par.pp, dp=par.dp, zero=par.zero, microbatches=microbatches,
                  schedule=par.pp_schedule, checkpoint=checkpoint if checkpoint in CHECKPOINTS else "none", plan=plan,
                  stages_per_rank=par.stages_per_rank, local_batch=tc.trainer.local_batch, dp_shard=par.dp_shard,
                  reshard_after_forward=par.reshards_after_forward)


def check_memory(tc: TrainConfig, dev: Dist) -> None:
    """ConfigError (one line) when the planner says this layout's start or step does not fit the
    smallest budget of any rank; nothing when it fits, when no rank is bounded or when the
    planner cannot price the model (logged)."""
    if not tc.parallel.check_memory:
        return
    budget = rank_budget(dev)
    smallest = _min_over_ranks(budget[0] if budget else -1, dev)
    if smallest < 0:
        return
    from boost_compile.costmodel.hardware import load_hardware
    from boost_compile.train.auto_layout import fsdp_allowed, model_spec

    try:
        spec = model_spec(tc)
    except ConfigError as exc:
        log.info("parallel.check_memory: not checked (%s)", exc)
        return
    svd = 0
    if tc.factorize.enabled and tc.factorize.init == "svd":  # one dense weight read whole for its SVD
        from dataclasses import replace

        from boost_compile.plan.model import largest_block_tensor

        svd = largest_block_tensor(replace(spec, projection="dense"))
    job = Job(spec, tc.trainer.batch, tc.trainer.seq, dev.world, dev.world, load_hardware("cpu"), smallest,
              tc.trainer.precision, on_meta=defers_init(tc), svd_elements=svd)
    layout = layout_of(tc, spec.projection)
    row = price(job, layout)
    need = max(row.memory_gib, row.start_gib) * GIB * (1 + HEADROOM)
    what = budget[1] if budget and budget[0] == smallest else "the smallest of the ranks' budgets"
    log.info("parallel.check_memory: %s needs about %.2f GiB per rank (start %.2f, step %.2f, +5%%); %.2f GiB (%s)",
             layout.label(), need / GIB, row.start_gib, row.memory_gib, smallest / GIB, what)
    if need <= smallest:
        return
    rows = search(job, local_batch=tc.trainer.local_batch, fsdp=fsdp_allowed(tc))
    fitting = [r.layout.label() for r in rows if r.fits][:3]
    procs = f"{dev.world} process" + ("es" if dev.world > 1 else "")
    others = (f"layouts of {procs} that fit: " + "; ".join(fitting)) if fitting else \
        f"no layout of {procs} fits: more processes, or a smaller batch or sequence"
    raise ConfigError(
        f"{spec.name} does not fit: {layout.label()} needs about {need / GIB:.2f} GiB per rank (its start "
        f"{row.start_gib:.2f} GiB, its step {row.memory_gib:.2f} GiB, {HEADROOM:.0%} more for what they leave out) "
        f"and a rank has {smallest / GIB:.2f} GiB ({what}); "
        f"{others} (boost-plan --model {tc.model.preset or spec.name} --devices {dev.world} --batch {tc.trainer.batch} "
        f"--seq {tc.trainer.seq} --hardware cpu --memory-gib {smallest / GIB:.2f}); parallel.check_memory=false tries anyway")


def _min_over_ranks(value: int, dev: Dist) -> int:
    """The smallest ``value`` of any rank (-1: unbounded) over every rank, so that all decide alike."""
    if dev.world == 1:
        return value
    big = float(2**62)
    box = torch.tensor([float(value) if value >= 0 else big], dtype=torch.float64, device=dev.device)
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return -1 if box.item() >= big else int(box.item())
