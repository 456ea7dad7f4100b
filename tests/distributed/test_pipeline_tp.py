"""Pipelines on four gloo processes (a 2 x 2 mesh), every stage compiled with backend="boost",
against one process running the whole model:

* PP x TP: each pipeline stage parallelized over its TP pair (the reference model, and a
  Hugging Face LlamaForCausalLM under megatron). Under btp the activation between
  stages is this rank's d-slice of the residual stream ([mb, s, d/2]: the point-to-point bytes
  halve); under megatron it is whole.
* PP x DP: each pair of ranks holding the same stages splits the batch; the stage gradients are
  averaged over the pair.

Each runs 1F1B (two stages) or interleaved 1F1B (four stages, two per rank), 5 SGD steps
(lr 0.1) with 2 micro-batches: every step's loss and every gathered gradient follow the
parity rule (conftest.assert_parity) against the whole model run eagerly in fp32 and fp64.
"""

from __future__ import annotations

import os

import pytest
from conftest import assert_parity

pytestmark = pytest.mark.extended  # make test-extended (CI runs it after make test)

SCENARIOS = [
    {"name": "btp", "preset": "tiny", "plan": "btp", "schedule": "1f1b", "explain": True},
    {"name": "btp-shard-logits", "preset": "tiny", "plan": "btp", "schedule": "1f1b", "shard_logits": True,
     "explain": True},
    {"name": "btp-interleaved", "preset": "tiny", "plan": "btp", "schedule": "interleaved_1f1b", "virtual": 2},
    {"name": "megatron", "preset": "tiny-dense", "plan": "megatron", "schedule": "1f1b", "explain": True},
    {"name": "hf-megatron", "preset": "hf", "plan": "megatron", "schedule": "1f1b"},
    {"name": "dp", "preset": "tiny", "mode": "dp", "schedule": "1f1b"},
    {"name": "dp-interleaved", "preset": "tiny", "mode": "dp", "schedule": "interleaved_1f1b", "virtual": 2},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from pp_tp_worker import worker
    from scenario_runner import spawn_scenarios

    return spawn_scenarios(worker, 4, SCENARIOS, tmp_path_factory.mktemp("pptp"))


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_matches_single_process(results, name):
    sc = next(s for s in SCENARIOS if s["name"] == name)
    per_rank = [r[name] for r in results]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, r.get("error")
        assert r["missing_grads"] == []
        if sc.get("mode", "tp") == "tp":  # every TP stage, with or without the embedding, refuses eager runs
            assert r["eager_refused"] == [True] * sc.get("virtual", 1)
        assert_parity(r["parity"], what=f"{name}, rank {rank}")
    # ranks 0, 1: stage 0 (and 2); ranks 2, 3: stage 1 (and 3), the last, which sees the loss
    virtual = sc.get("virtual", 1)
    expected = [list(range(0, 2 * virtual, 2))] * 2 + [list(range(1, 2 * virtual, 2))] * 2
    assert [r["stages"] for r in per_rank] == expected
    for r in per_rank[2:]:
        assert len(r["parity"]["loss"]) == 5
    # one compiled graph per stage and direction (forward, backward): no recompiles over the steps
    assert all(r["graphs"] == virtual for r in per_rank), [r["graphs"] for r in per_rank]


def test_btp_sends_the_stream_sliced(results):
    # btp: the stages exchange [mb, s, d/2]; stage 0 returns its slice without gathering it, and
    # stage 1 gathers the stream only before the final norm (plus the logits for the loss)
    btp = [r["btp"] for r in results]
    assert all(r["stream_shards"] == [2] for r in btp)
    assert not [c for c in btp[0]["collectives"]["forward"] if c["kind"] == "all_gather_into_tensor"]
    gathers = [c["shape"] for c in btp[2]["collectives"]["forward"] if c["kind"] == "all_gather_into_tensor"]
    assert gathers == [[2, 16, 32], [2, 16, 128]]  # the stream's d/2 slice, the logits' V/2 slice
    # interleaved: only the last stage (3, on ranks 2 and 3) gathers; stages 0-2 pass slices on
    inter = [r["btp-interleaved"] for r in results]
    assert all(r["stream_shards"] == [2, 2] for r in inter)
    for r in inter[:2]:
        assert not [c for c in r["collectives"]["forward"] if c["kind"] == "all_gather_into_tensor"]
    assert all(r["stream_shards"] == [1] for r in (r["megatron"] for r in results))
    # shard_logits: the last stage returns its [2, 16, 128] vocabulary slice, gathered nowhere (the
    # schedule's vocab_parallel_loss all-reduces [N] and [N, 2] outside the graph); a plain loss is refused
    sliced = [r["btp-shard-logits"] for r in results]
    gathers = [c["shape"] for c in sliced[2]["collectives"]["forward"] if c["kind"] == "all_gather_into_tensor"]
    assert gathers == [[2, 16, 32]]
    assert [r["plain_loss_refused"] for r in sliced] == [False, False, True, True]
    assert all(r["stream_shards"] == [1] and not r["collectives"]["forward"] for r in (r["dp"] for r in results))


os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def test_explain_reports_the_point_to_point_bytes(results):
    """explain on a stage: the stream a btp stage sends and receives is its d/2 slice, so its
    point-to-point bytes are half a megatron stage's; a shard_logits stage gives the loss V/2."""
    def tensors(name, rank):
        (p,) = results[rank][name]["explain"]
        return p, {t["what"]: t for t in p["tensors"]}

    btp0, btp0_t = tensors("btp", 0)
    meg0, meg0_t = tensors("megatron", 0)
    assert btp0_t["sent: the stream"]["shape"] == [2, 16, 32] and btp0_t["sent: the stream"]["fraction"] == 0.5
    assert meg0_t["sent: the stream"]["shape"] == [2, 16, 64] and meg0_t["sent: the stream"]["fraction"] == 1.0
    assert 2 * btp0["p2p_bytes"] == meg0["p2p_bytes"] == 2 * 2 * 16 * 64 * 4
    btp1, btp1_t = tensors("btp", 2)
    assert btp1_t["received: the stream"]["shape"] == [2, 16, 32]
    assert btp1_t["to the loss: the logits"]["shape"] == [2, 16, 256]  # gathered for a plain loss
    _, sliced = tensors("btp-shard-logits", 2)
    assert sliced["to the loss: the logits"]["shape"] == [2, 16, 128]
