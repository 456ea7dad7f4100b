"""Worker for the tests of parameters read by a rank's heads (tests/models/head_param_models.py)
under tensor parallelism: gloo on CPU, 2 ranks, the boost backend with inner aot_eager.

As in tp_worker: each rank runs the unsharded model (eager fp32), its float64 copy (the truth)
and the sharded, compiled copy on the same tokens and SGD steps, and reports the loss and the
gathered gradients' error pairs of every step (conftest.error_pair; the test applies
conftest.assert_parity), the parameters' ShardSpec roles and tp_localize's repairs. A scenario
with ``"expect"`` reports the message parallelize_ refuses it with; ``"unfixed"`` runs it with the
partial-gradient rule of tp_localize switched off (a planted bug); ``"dtype": "float64"`` runs
the model in float64 throughout (``parity.Float64Program``), where the sharded program must equal
the unsharded one to float64's rounding."""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from conftest import fp64_copy
from head_param_models import head_param_lm
from scenario_runner import run_on_gloo
from tp_steps import sgd_steps

import boost_compile as bc
from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig
from boost_compile.parity import Float64Program
from boost_compile.passes import tp_localize

SEQ, BATCH, VOCAB = 16, 2, 128


def _unfixed(sc: dict[str, Any]) -> contextlib.AbstractContextManager:
    """The planted bug: no replicated tensor's gradient summed over the group."""
    if not sc.get("unfixed"):
        return contextlib.nullcontext()
    return mock.patch.object(tp_localize._Localizer, "_sum_partial_gradients", lambda self: None)


def build(sc: dict[str, Any], tokens: torch.Tensor) -> torch.nn.Module:
    model = head_param_lm(**sc.get("switches", {}))
    if sc["plan"] == "btp":  # every block linear a bottleneck first; the reference is the factorized model
        bc.factorize_(model, bc.FactorizeConfig(rank_ratio=0.25), example_inputs=(tokens, tokens))
    return model


def refusal(sc: dict[str, Any], tokens: torch.Tensor) -> dict[str, Any]:
    model = build(sc, tokens)
    try:
        with _unfixed(sc):
            bc.parallelize_(model, (tokens, tokens), dist.group.WORLD, plan=sc["plan"])
        return {"message": "no error"}
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return {"message": f"{type(exc).__name__}: {exc}"}


def scenario(sc: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    if "expect" in sc:
        return refusal(sc, tokens)
    ref = build(sc, tokens)
    float64 = sc.get("dtype") == "float64"
    if float64:
        ref = ref.double()
    truth = fp64_copy(ref)
    model = copy.deepcopy(ref)
    options = sc.get("options", {})
    with _unfixed(sc):
        report = bc.parallelize_(model, (tokens, tokens), dist.group.WORLD, plan=sc["plan"],
                                 verify=options.get("verify", True))
        rec = Recorder()
        backend = functools.partial(compile_graph, config=BoostConfig.from_options({"inner": "aot_eager", **options}),
                                    recorder=rec)
        if sc.get("unit") == "block":  # each block compiled on its own, the code around them eager on the shards
            bc.compile_blocks(model, backend=backend)
            compiled = model
        else:
            compiled = torch.compile(model, backend=backend)
        # a float64 model runs float64 throughout: its norms' x.float() kept in float64
        with Float64Program() if float64 else contextlib.nullcontext():
            parity, missing = sgd_steps(ref, truth, model, compiled, lambda m: m(tokens, tokens), sc.get("steps", 3))
    localize = [r for g in rec.graphs for r in g.reports if r.name == "tp_localize"]
    return {
        "parity": parity,
        "missing_grads": missing,
        "roles": {name: spec.role for name, spec in report.specs.items()},
        "repairs": [line for r in localize for line in r.rewritten],
        "graphs": len(rec.graphs),
        "verified_at_parallelize": report.verify is not None and not report.verify.unavailable,
        "seconds": time.perf_counter() - start,
    }


def worker(rank: int, world: int, store: str, scenarios: list[dict[str, Any]], result_path: str) -> None:
    run_on_gloo(rank, world, store, scenarios, result_path, scenario)
