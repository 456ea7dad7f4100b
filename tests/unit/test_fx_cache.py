"""The ATen pass pipeline keeps Inductor's FX graph cache valid and hitting.

``AtenPipeline`` goes into Inductor as ``post_grad_custom_post_pass``; Inductor puts
its ``uuid()`` into the FX graph cache key, and bypasses the cache when it is None.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import boost_compile.backend
from boost_compile import passes
from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig
from boost_compile.pass_manager import AtenPipeline


def _pipeline(options: dict | None = None, *, only_enabled: bool = False) -> AtenPipeline:
    aten = passes.aten_passes(BoostConfig.from_options(options))
    if only_enabled:  # as the backend builds it
        aten = [p for p in aten if p.enabled()]
    return AtenPipeline(aten, sink=[])


# --- uuid --------------------------------------------------------------------------


def test_uuid_is_set_and_stable_for_identical_configs() -> None:
    a, b = _pipeline(), _pipeline()
    assert a.uuid() is not None
    assert isinstance(a.uuid(), (bytes, str))
    assert a.uuid() == b.uuid()
    assert a.uuid() == a.uuid()
    # the report sink is run-time state, not part of the key
    b.sink.append("anything")
    assert a.uuid() == b.uuid()


def test_uuid_is_stable_across_processes() -> None:
    """The on-disk cache is shared between processes, so the key must not depend on one."""
    code = (
        "from boost_compile.config import BoostConfig\n"
        "from boost_compile.pass_manager import AtenPipeline\n"
        "from boost_compile.passes import aten_passes\n"
        "u = AtenPipeline(aten_passes(BoostConfig())).uuid()\n"
        "print(u.hex() if isinstance(u, bytes) else u)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    here = _pipeline().uuid()
    here = here.hex() if isinstance(here, bytes) else here
    assert out.stdout.strip().splitlines()[-1] == here


@pytest.mark.parametrize("only_enabled", [False, True], ids=["all_passes", "enabled_passes"])
def test_uuid_changes_with_aten_pass_config(only_enabled: bool) -> None:
    on = _pipeline(only_enabled=only_enabled)
    off = _pipeline({"op_census": {"enabled": False}}, only_enabled=only_enabled)
    assert on.uuid() != off.uuid()


def test_uuid_ignores_settings_no_aten_pass_reads() -> None:
    # the inner compiler choice is not an input of any ATen pass: sharing the key is fine
    assert _pipeline({"inner": "inductor"}).uuid() == _pipeline({"inner": "aot_eager"}).uuid()


# --- the FX graph cache, end to end ------------------------------------------------


def _compile_and_train_step() -> None:
    """Compile a small model with backend="boost" (inner inductor) and run fwd + bwd."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    compiled = torch.compile(model, backend="boost", options={"inner": "inductor"})
    loss = compiled(x).square().mean()
    loss.backward()
    torch.testing.assert_close(loss, model(x).square().mean())


def _two_compiles() -> tuple[dict[str, int], dict[str, int]]:
    """Inductor counters of a first and a second compile of the same model, fresh cache dir."""
    with inductor_config.patch(fx_graph_cache=True), fresh_cache():
        runs = []
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            _compile_and_train_step()
            runs.append(dict(counters["inductor"]))
    return runs[0], runs[1]


@pytest.mark.slow
@pytest.mark.parametrize("autograd_cache", [False, True], ids=["fx_cache_only", "with_aot_cache"])
def test_second_compile_hits_fx_graph_cache(autograd_cache: bool) -> None:
    with functorch_config.patch(enable_autograd_cache=autograd_cache):
        first, second = _two_compiles()
    # forward and backward graph: both compiled on the first run, both found on the second
    assert first.get("fxgraph_cache_miss", 0) >= 2, first
    assert first.get("fxgraph_cache_hit", 0) == 0, first
    assert second.get("fxgraph_cache_hit", 0) == first["fxgraph_cache_miss"], second
    assert second.get("fxgraph_cache_miss", 0) == 0, second
    assert second.get("fxgraph_cache_bypass", 0) == 0, second


@pytest.mark.slow
def test_a_recorder_shares_the_cache_only_without_partition_reports() -> None:
    """A Recorder wraps the partitioner (to report what it saves), and so keys the compile apart
    from an unrecorded one; with keep_partitions=False the graphs are the unrecorded compile's:
    its FX graph cache entries are found (the Torch-IR passes still report; the ATen passes,
    which run inside Inductor, do not)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    config = BoostConfig.from_options({"inner": "inductor"})

    def compile_once(recorder: Recorder | None) -> dict[str, int]:
        torch._dynamo.reset()
        counters.clear()
        backend = functools.partial(compile_graph, config=config, recorder=recorder)
        torch.compile(copy.deepcopy(model), backend=backend)(x).sum().backward()
        return dict(counters["inductor"])

    with inductor_config.patch(fx_graph_cache=True), functorch_config.patch(enable_autograd_cache=False), fresh_cache():
        first = compile_once(None)
        wrapped, kept = Recorder(), Recorder(keep_partitions=False)
        runs = {"wrapped": compile_once(wrapped), "kept": compile_once(kept)}
    assert first.get("fxgraph_cache_miss", 0) == 2, first
    assert runs["wrapped"].get("fxgraph_cache_hit", 0) == 0 and len(wrapped.graphs[0].partition_reports) == 1, runs
    assert runs["kept"].get("fxgraph_cache_hit", 0) == 2 and kept.graphs[0].partition_reports == [], runs
    assert kept.graphs[0].reports, "the graph passes' reports come from Python, before the cache"
    assert kept.graphs[0].aten_reports == [] and wrapped.graphs[0].aten_reports, "a hit runs no ATen pass"


class _PipelineWithoutUuid(AtenPipeline):
    def uuid(self) -> None:
        return None


@pytest.mark.slow
def test_pipeline_without_uuid_bypasses_cache(monkeypatch) -> None:
    """Negative control: without a uuid Inductor cannot key the pass, so it never caches.

    Shows that the pipeline is really part of the cache key in the test above.
    """
    monkeypatch.setattr(boost_compile.backend, "AtenPipeline", _PipelineWithoutUuid)
    first, second = _two_compiles()
    for run in (first, second):
        assert run.get("fxgraph_cache_bypass", 0) >= 2, run
        assert run.get("fxgraph_cache_hit", 0) == 0, run
