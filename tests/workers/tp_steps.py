"""The steps the tensor-parallel workers share: SGD on the unsharded model, its float64 copy and
the sharded, compiled one, the loss and every gathered gradient of each step measured against
the float64 run (conftest.error_pair), the gathered weights after the last."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from conftest import error_pair, grads, params

import boost_compile as bc


def sgd_steps(ref: torch.nn.Module, truth: torch.nn.Module, model: torch.nn.Module, compiled: Callable[..., Any],
              loss_of: Callable[[Any], torch.Tensor], steps: int) -> tuple[dict[str, Any], list[str]]:
    """``steps`` SGD steps (momentum 0.9: it keeps the runs within rounding of each other, see
    tp_worker.make_optimizer) on the three models; ``loss_of(m)`` is a model's loss, ``compiled``
    the sharded model's compiled form. Returns the error pairs and the gradients the sharded run lacks."""
    runs = (ref, truth, model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in runs]
    parity: dict[str, Any] = {"loss": [], "grad": []}
    missing: list[str] = []
    for _ in range(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss_ref = loss_of(ref)
        loss_ref.backward()
        loss_truth = loss_of(truth)
        loss_truth.backward()
        loss = loss_of(compiled)
        loss.backward()
        parity["loss"].append(error_pair({"loss": loss}, {"loss": loss_ref}, {"loss": loss_truth}))
        gathered = bc.gather_full_grads(model)
        missing = sorted(n for n, g in gathered.items() if g is None)
        parity["grad"].append(error_pair(gathered, grads(ref), grads(truth)))
        for opt in opts:
            opt.step()
    parity["param"] = error_pair(bc.gather_full_state_dict(model), params(ref), params(truth))
    return parity, missing
