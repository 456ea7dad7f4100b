"""The pipeline stages' data-parallel gradient average, issued bucket by bucket during the
backward (boost_compile/train/dp_buckets.py), on 2 gloo ranks (tests/workers/dp_buckets_worker.py).

The averaged gradients follow the parity rule against the micro-batches' sums all-reduced after
the backward, in fp32 and fp64, for one bucket and for buckets of a few KiB; from the second step
on the buckets go out during the backward, the later layers' before the first layer's gradient
is final; a parameter accumulated once more than in the first step fails the step by name.
boost-train's PP2 x DP2 run (test_train_pp) trains through it."""

from __future__ import annotations

import pytest
from conftest import assert_parity
from scenario_runner import per_rank, spawn_scenarios

from boost_compile.train.dp_buckets import cut_buckets

SCENARIOS = [{"name": "small", "bucket_mb": 0.005}, {"name": "one", "bucket_mb": 25.0}]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from dp_buckets_worker import worker

    return spawn_scenarios(worker, 2, SCENARIOS, tmp_path_factory.mktemp("dp_buckets"))


def test_buckets_are_cut_in_reverse_order_one_dtype_each():
    import torch

    params = [torch.zeros(256), torch.zeros(256), torch.zeros(256, dtype=torch.float64), torch.zeros(2048)]
    got = cut_buckets(params, bucket_mb=2048 / 2**20)  # 2 KiB: two fp32 vectors of 256
    assert [[p.numel() for p in b] for b in got] == [[2048], [256], [256, 256]]
    assert got[1][0] is params[2] and got[2] == [params[1], params[0]]


@pytest.mark.parametrize("name", ["small", "one"])
def test_the_average_is_the_reduced_sum(results, name):
    for rank in per_rank(results, name):
        for i, step in enumerate(rank["steps"]):
            assert_parity({"grad": step["parity"]}, "float32", f"bucketed dp average, {name}, step {i}")


def test_buckets_are_issued_during_the_backward(results):
    for rank in per_rank(results, "small"):
        assert rank["buckets"] >= 4, rank["buckets"]
        first, *later = rank["steps"]
        assert first["issued_in_backward"] == 0  # the first step learns the accumulation counts
        for step in later:
            assert step["issued_in_backward"] == rank["buckets"]
            # the later layers' buckets left before the first layer's last gradient was final
            assert 1 <= step["issued_before_first_linear_final"] < rank["buckets"], step
    for rank in per_rank(results, "one"):
        assert rank["buckets"] == 2 and [s["issued_in_backward"] for s in rank["steps"]] == [0, 2, 2]


def test_a_gradient_accumulated_once_more_fails_by_name(results):
    for rank in per_rank(results, "small"):
        assert "0.weight" in rank["late"] and "more times this step than in the first (3)" in rank["late"], rank["late"]
