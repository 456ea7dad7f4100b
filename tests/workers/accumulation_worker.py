"""Worker for the gradient-accumulation count test (gloo on CPU): boost-train's own DP2 step
(``build_model_parts``, ``make_train_step``) with a DDP comm hook that counts the gradient
buckets it all-reduces, per optimizer step, with and without accumulation."""

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from conftest import cfg_of
from scenario_runner import run_on_gloo
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from boost_compile.train.loop import make_train_step
from boost_compile.train.optim import make_optimizer
from boost_compile.train.parallel import build_model_parts, setup_distributed
from boost_compile.train.validate import validate


def scenario(sc: dict[str, Any]) -> dict[str, Any]:
    tc, shape = validate(cfg_of(*sc["overrides"]), world_size=dist.get_world_size())
    torch.manual_seed(tc.trainer.seed)
    dev = setup_distributed(tc)
    parts = build_model_parts(tc, shape, dev)
    optimizer, scheduler = make_optimizer(parts.model, tc.optim, tc.trainer.steps)
    buckets: list[int] = []

    def counting(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # DDP checks these annotations: real ones, so this module has no postponed annotations
        buckets.append(1)
        return allreduce_hook(group, bucket)

    parts.train_fn.register_comm_hook(dev.group("dp"), counting)
    step = make_train_step(parts, optimizer, scheduler, tc.optim.grad_clip, dev, contextlib.nullcontext,
                           tc.trainer.micro_steps(dev.dp))
    rows = tc.trainer.batch // dev.dp
    gen = torch.Generator().manual_seed(1)  # both ranks draw the global batch; each takes its rows
    per_step, losses = [], []
    for _ in range(sc["steps"]):
        tokens = torch.randint(0, 256, (tc.trainer.batch, tc.trainer.seq + 1), generator=gen)
        mine = tokens[dev.dp_rank * rows : (dev.dp_rank + 1) * rows]
        before = len(buckets)
        out = step(mine[:, :-1], mine[:, 1:])
        per_step.append(len(buckets) - before)
        losses.append(out.loss)
    return {"buckets_per_step": per_step, "losses": losses, "micro_steps": tc.trainer.micro_steps(dev.dp)}


def worker(rank: int, world: int, store: str, scenarios: list[dict[str, Any]], result_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    run_on_gloo(rank, world, store, scenarios, result_path, scenario)
