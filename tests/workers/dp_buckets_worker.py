"""Worker for the bucketed data-parallel average (boost_compile/train/dp_buckets.py), 2 gloo ranks.

A stack of linears (two dtypes: the last ones in float64) runs 3 micro-batches of this rank's
data per step, forward and backward, as a pipeline stage's schedule does; the average then
holds the sum of the micro-batches' gradients over both ranks, divided by 2 x 3. Each rank
reports, per step, the errors of those gradients (conftest.error_pair) against the same sums
computed without it and all-reduced afterwards (the eager reference) and in float64 (the
truth); how many buckets were issued before the first linear's last gradient was final (the
last one the backward produces); and the error a step raises when a parameter accumulates
once more than in the first step."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from conftest import error_pair, fp64_copy, grads
from scenario_runner import run_on_gloo

from boost_compile.train.dp_buckets import BucketedDpAverage

MICRO, WIDTH = 3, 32


def stack() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(6)])
    model[4].double()
    model[5].double()
    return model


def run_micro(model: torch.nn.Module, xs: list[torch.Tensor]) -> None:
    for x in xs:
        h = model[:4](x.to(model[0].weight.dtype))
        model[4:](h.to(model[4].weight.dtype)).square().mean().backward()


def summed_then_reduced(model: torch.nn.Module, world: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, g in grads(model).items():
        total = g.clone()
        dist.all_reduce(total)
        out[name] = total / (world * MICRO)
    return out


def scenario(sc: dict[str, Any]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = stack()
    eager, truth = copy.deepcopy(model), fp64_copy(model)
    seen: list[int] = []  # buckets issued as the first linear's weight accumulates (before the average's hook)
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(len(average._issued)))
    average = BucketedDpAverage(list(model.named_parameters()), dist.group.WORLD, world, bucket_mb=sc["bucket_mb"])
    out: dict[str, Any] = {"buckets": len(average.buckets), "steps": []}
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + rank)
        xs = [torch.randn(4, WIDTH, generator=gen) for _ in range(MICRO)]
        for m in (model, eager, truth):
            m.zero_grad(set_to_none=True)
        seen.clear()
        average.begin()
        run_micro(model, xs)
        average.finish(MICRO)
        run_micro(eager, xs)
        run_micro(truth, [x.double() for x in xs])
        out["steps"].append({
            "parity": error_pair(grads(model), summed_then_reduced(eager, world), summed_then_reduced(truth, world)),
            "issued_in_backward": average.issued_in_backward,
            "issued_before_first_linear_final": seen[-1],
        })
    # a fourth step with one micro-batch more than the first step had
    model.zero_grad(set_to_none=True)
    average.begin()
    run_micro(model, [torch.randn(4, WIDTH) for _ in range(MICRO + 1)])
    try:
        average.finish(MICRO + 1)
        out["late"] = "no error"
    except RuntimeError as exc:
        out["late"] = str(exc)
    return out


def worker(rank: int, world: int, store: str, scenarios: list[dict[str, Any]], result_path: str) -> None:
    run_on_gloo(rank, world, store, scenarios, result_path, scenario, timeout_s=60)
