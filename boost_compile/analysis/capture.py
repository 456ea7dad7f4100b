"""Capture a model's graphs with Dynamo only to look at them (no compile, no entry left behind)."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from boost_compile.analysis.view import GraphView
from boost_compile.config import AnalysisConfig


@contextlib.contextmanager
def private_forward(model: Any) -> Iterator[None]:
    """Run ``model``'s ``forward`` from a copy of its code object while inside.

    Dynamo keeps compiled entries on the code object, and every instance of a
    class shares one. A capture made only to look at the graph (``capture_views``,
    ``parallelize_``'s check) would otherwise leave an entry on the class's
    ``forward``: it counts against Dynamo's recompile limit for every instance
    (pipeline stages of one class on one rank) and is evaluated before each call.
    The copy, and its entries, are dropped on exit.
    """
    method = getattr(model, "forward", None)
    func = getattr(method, "__func__", None)
    if not isinstance(model, torch.nn.Module) or not isinstance(func, types.FunctionType) or "forward" in vars(model):
        yield
        return
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__, copy.__dict__ = func.__kwdefaults__, dict(func.__dict__)
    copy.__qualname__, copy.__module__ = func.__qualname__, func.__module__
    model.forward = types.MethodType(copy, model)
    try:
        yield
    finally:
        del model.forward


def capture_views(
    model: Any, *example_inputs: Any, config: AnalysisConfig | None = None, grad: bool = False
) -> list[GraphView]:
    """Capture ``model(*example_inputs)`` with Dynamo and analyse each graph (no compile)."""
    views: list[GraphView] = []

    def backend(gm: fx.GraphModule, inputs: Sequence[Any]) -> Any:
        views.append(GraphView(gm, inputs, config))
        return gm.forward

    with torch.set_grad_enabled(grad), private_forward(model):
        torch.compile(model, backend=backend, dynamic=False)(*example_inputs)
    return views
