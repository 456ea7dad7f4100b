"""Parameters that a rank's heads read, under tensor parallelism, against one process.

A replicated parameter whose use reads this rank's slice of a head-sharded tensor gets, on each
rank, the gradient of that rank's heads only; tp_localize finds every such use from its
placements and sums the gradient over the group (``copy_to_tp``). A per-head parameter is cut by
heads, a norm over a column-parallel projection's whole output is cut like it with its
statistic summed (tests/models/head_param_models.py: Qwen3's and OLMo 2's q/k norms,
gpt-oss's sinks, a shared score scale, a per-head score bias; tests/workers/
tp_head_param_worker.py: 2 gloo ranks, megatron and btp after factorize_, whole model and per
block, 3 SGD steps). The loss and every gathered gradient of every step, and the weights after
the last, follow the parity rule (conftest.assert_parity) against the unsharded eager run and
its float64 copy; with the rule switched off, the same check fails and parallelize_ refuses."""

from __future__ import annotations

import pytest
from conftest import ParityError, assert_parity, extended_deselected
from scenario_runner import per_rank, spawn_scenarios

ALL_HEAD = {"qk_norm": "head", "sinks": True, "score_scale": True, "head_bias": True}
ALL_WHOLE = {**ALL_HEAD, "qk_norm": "whole"}
#: each construct alone (megatron, whole model), then all of them in every layout
TRAINED = {
    "head-qk-norm": {"switches": {"qk_norm": "head"}, "plan": "megatron"},
    # Gemma's 1 + w: the partial gradient is that of a tensor computed from the parameter
    "head-qk-norm-gemma": {"switches": {"qk_norm": "head_gemma"}, "plan": "megatron"},
    "whole-qk-norm": {"switches": {"qk_norm": "whole"}, "plan": "megatron"},
    "sinks": {"switches": {"sinks": True}, "plan": "megatron"},
    "score-scale": {"switches": {"score_scale": True}, "plan": "megatron"},
    "head-bias": {"switches": {"head_bias": True}, "plan": "megatron"},
    "all-megatron-block": {"switches": ALL_HEAD, "plan": "megatron", "unit": "block"},
    "all-whole-megatron-block": {"switches": ALL_WHOLE, "plan": "megatron", "unit": "block"},
    "all-btp": {"switches": ALL_HEAD, "plan": "btp"},
    "all-whole-btp-block": {"switches": ALL_WHOLE, "plan": "btp", "unit": "block"},
}
#: compiled block by block: make test-extended (make test runs the same constructs on the whole model)
EXTENDED = {"all-megatron-block", "all-whole-megatron-block", "all-whole-btp-block"}
#: a float64 model under btp: its norms' statistics, summed over the group, stay float64
FLOAT64 = {"name": "all-whole-btp-float64", "switches": ALL_WHOLE, "plan": "btp", "dtype": "float64", "steps": 2}
PLANTED = [
    # the rule off and verify off: the q/k norms' gradients are one rank's heads' alone
    {"name": "unfixed-no-verify", "switches": {"qk_norm": "head"}, "plan": "megatron", "unfixed": True, "steps": 1,
     "options": {"verify": False}},
    # the rule off, verify on: parallelize_ runs the rank's program and refuses it before any step
    {"name": "unfixed-refused", "switches": {"qk_norm": "head"}, "plan": "megatron", "unfixed": True, "expect": "refused"},
]


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    from tp_head_param_worker import worker

    skip = EXTENDED if extended_deselected(request.config) else set()
    scenarios = [{"name": name, **sc} for name, sc in TRAINED.items() if name not in skip] + PLANTED + [FLOAT64]
    return spawn_scenarios(worker, 2, scenarios, tmp_path_factory.mktemp("tp_head_params"))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if n in EXTENDED else n for n in sorted(TRAINED)])
def test_trains_like_one_process(results, name):
    for rank, r in enumerate(per_rank(results, name)):
        assert r["missing_grads"] == [], r["missing_grads"]
        assert_parity(r["parity"], "float32", f"{name} rank {rank}")
        assert r["verified_at_parallelize"]


def _summed(r):
    return [line for line in r["repairs"] if line.startswith("sum the gradient")]


def test_replicated_parameters_read_by_local_heads_have_their_gradients_summed(results):
    # q_norm and k_norm's weights, one each per block: two sums per block, nothing else summed
    r = per_rank(results, "head-qk-norm")[0]
    summed = _summed(r)
    assert len(summed) == 4, summed
    assert all("norm" in line for line in summed)
    assert r["roles"].get("layers.0.self_attn.q_norm.weight") is None  # replicated: no ShardSpec
    assert len(_summed(per_rank(results, "head-qk-norm-gemma")[0])) == 4
    # the scalar scale: one sum per block
    assert len(_summed(per_rank(results, "score-scale")[0])) == 2
    # a per-head parameter is cut, not summed: its broadcast [1, H, 1, 1] sliced on the heads dim
    for name in ("head-bias", "sinks"):
        r = per_rank(results, name)[0]
        assert _summed(r) == [], _summed(r)
        assert sum("this rank's slice of dim 1" in line for line in r["repairs"]) == 2, r["repairs"]


def test_a_norm_over_the_whole_projection_is_cut_like_it(results):
    r = per_rank(results, "whole-qk-norm")[0]
    for block in (0, 1):
        for norm in ("q_norm", "k_norm"):
            assert r["roles"][f"layers.{block}.self_attn.{norm}.weight"] == "shard"
    assert _summed(r) == []


@pytest.mark.extended
def test_per_block_the_norm_is_cut_in_the_one_block_graph(results):
    r = per_rank(results, "all-whole-btp-block")[0]
    assert r["roles"]["layers.0.self_attn.q_norm.weight"] == "shard"
    assert r["graphs"] == 1  # the blocks share one compiled graph


def test_the_planted_bug_breaks_the_parity_rule(results):
    r = per_rank(results, "unfixed-no-verify")[0]
    with pytest.raises(ParityError, match=r"at \[\(.grad., 0\)"):  # the loss is right, the gradients not
        assert_parity(r["parity"], "float32", "unfixed", record=False)


def test_parallelize_refuses_a_rank_program_that_differs(results):
    for r in per_rank(results, "unfixed-refused"):
        assert r["message"].startswith("ParallelizeError: this rank's program does not compute the unsharded model"), r
        assert "q_norm.weight" in r["message"] or "k_norm.weight" in r["message"], r["message"]


def test_a_float64_model_stays_float64_under_btp(results):
    # The truth here is the unsharded float64 run itself (eager's error is 0), so the parity
    # rule has nothing to scale: a float64 program that sums its partial results in another
    # order stays within about 1e-14 of it, while a statistic rounded through fp32 (the online
    # norm's .float() before it kept the input's dtype) is off by about 1e-7 and a missing term
    # by far more. 1e-11 sits between the two.
    for rank, r in enumerate(per_rank(results, FLOAT64["name"])):
        assert r["missing_grads"] == []
        for kind in ("loss", "grad"):
            for step, (tested, eager) in enumerate(r["parity"][kind]):
                assert eager == 0.0
                assert tested <= 1e-11, f"rank {rank} {kind} step {step + 1}: {tested:.3e}"
