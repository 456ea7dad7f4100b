"""Pipeline parallelism on torch.distributed.pipelining, over two gloo processes on CPU.

Each distributed scenario cuts one seeded model into stages (``split_model``),
compiles every stage with ``backend="boost"`` (inner ``aot_eager``), runs 5 SGD
steps (lr 0.1) through a PyTorch schedule and compares with the whole model
stepped in one process on the same batch, eagerly in fp32 and in fp64: every
step's loss (the mean of the micro-batch losses), every gradient of every step
(against the reference's of the same FQN) and the parameters after the last follow
the parity rule (conftest.assert_parity). The cut, the refusals and the schedule
checks that need no process group are in tests/unit/test_pipeline_split.py.
"""

from __future__ import annotations

import pytest
from conftest import assert_parity

SCENARIOS = [
    {"name": "1f1b", "model": "tiny", "schedule": "1f1b", "microbatches": 2, "compile": "wrap"},
    {"name": "gpipe", "model": "tiny", "schedule": "gpipe", "microbatches": 4, "compile": "inplace"},
    {"name": "interleaved_1f1b", "model": "tiny:4", "schedule": "interleaved_1f1b", "virtual": 2,
     "microbatches": 2, "compile": "wrap"},
    {"name": "hf-1f1b", "model": "hf", "schedule": "1f1b", "microbatches": 2, "compile": "wrap"},
    {"name": "zero_bubble-eager", "model": "tiny:4", "schedule": "zero_bubble", "virtual": 2,
     "microbatches": 2, "compile": "eager", "steps": 2},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from pp_worker import worker
    from scenario_runner import spawn_scenarios

    return spawn_scenarios(worker, 2, SCENARIOS, tmp_path_factory.mktemp("pp"))


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_matches_single_process(results, name):
    sc = next(s for s in SCENARIOS if s["name"] == name)
    per_rank = [r[name] for r in results]
    for r in per_rank:
        assert "error" not in r, r.get("error")
        assert r["missing_grads"] == []
        # one graph per local stage when compiled with backend="boost" (no recompiles across steps)
        assert r["graphs"] == (0 if sc["compile"] == "eager" else len(r["stages"])), r["graphs"]
        assert_parity(r["parity"], what=f"{name}, stages {r['stages']}")
    # the stages' parameters together are the reference's, each held once
    names = [n for r in per_rank for n in r["names"]]
    assert sorted(names) == per_rank[0]["ref_names"]
    (last,) = [r for r in per_rank if r["losses"]]  # only the last stage's rank sees the loss
    steps = sc.get("steps", 5)
    assert len(last["parity"]["loss"]) == steps
    assert last["losses"][-1] < last["losses"][0]  # it trains


def test_interleaved_layout(results):
    # 4 stages on 2 ranks: stage i on rank i % 2, one block each
    assert [r["interleaved_1f1b"]["stages"] for r in results] == [[0, 2], [1, 3]]
    assert [r["interleaved_1f1b"]["layers"] for r in results] == [[[0], [2]], [[1], [3]]]
