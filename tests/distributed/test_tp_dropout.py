"""Dropout under tensor parallelism by Megatron's rule: a tensor cut across the TP ranks
draws its mask from each rank's own stream, a replicated one from the stream all ranks
share (tests/workers/tp_dropout_worker.py: nanoGPT with dropout 0.1, heads 0 and 2 made
identical, 2 gloo ranks). Heads 0 and 2 live on different ranks under TP2: in one process
they get different masks, so their gradients differ; with one stream for both they would be
equal to the last bit. The replicated parameters and their gradients stay equal on both ranks."""

from __future__ import annotations

import pytest
from conftest import extended_deselected
from scenario_runner import per_rank, spawn_scenarios

SCENARIOS = [
    {"name": "megatron", "plan": "megatron", "dropout": 0.1},
    # Inductor's own RNG draws the seed (its philox lowering of randint): still one for all ranks
    {"name": "megatron-inductor", "plan": "megatron", "dropout": 0.1, "inner": "inductor"},
    {"name": "megatron-no-dropout", "plan": "megatron", "dropout": 0.0},
    {"name": "btp", "plan": "btp", "dropout": 0.1},
    {"name": "hand", "plan": "hand"},
]
#: the same claims under a second compiler: make test-extended
EXTENDED = {"megatron-inductor"}


def params(names: list[str]) -> list:
    return [pytest.param(n, marks=pytest.mark.extended) if n in EXTENDED else n for n in names]


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    from tp_dropout_worker import worker

    skip = EXTENDED if extended_deselected(request.config) else set()
    scenarios = [s for s in SCENARIOS if s["name"] not in skip]
    return spawn_scenarios(worker, 2, scenarios, tmp_path_factory.mktemp("tp_dropout"))


@pytest.mark.parametrize("name", params(["megatron", "megatron-inductor"]))
def test_twin_heads_on_two_ranks_draw_different_masks(results, name):
    for rank in per_rank(results, name):
        assert rank["twins"] and not any(t["equal"] for t in rank["twins"]), rank["twins"]
        assert min(t["diff"] for t in rank["twins"]) > 1e-6
        # per block: the attention's dropout (in SDPA on local heads); the residual, MLP and
        # embedding dropouts read replicated tensors under megatron and keep the shared stream
        assert len(rank["sites"]) == 2 and all("attention" in s for s in rank["sites"]), rank["sites"]
    # the same construction without dropout: the twins' gradients are equal, so the check can tell
    for rank in per_rank(results, "megatron-no-dropout"):
        assert all(t["equal"] for t in rank["twins"]) and rank["sites"] == []


@pytest.mark.parametrize("name", params(["megatron", "megatron-inductor", "btp"]))
def test_replicated_parameters_stay_equal_across_ranks(results, name):
    first, second = per_rank(results, name)
    assert first["replicated_params"], "no replicated parameter to compare"
    assert first["replicated_grads"] == second["replicated_grads"]
    assert first["replicated_params"] == second["replicated_params"]
    assert first["replicated_bytes"] == second["replicated_bytes"]


def test_btp_draws_per_rank_on_the_sharded_stream(results):
    """Under btp the residual stream is cut on d: every dropout in the model reads a sharded tensor
    (the embedding's, and per block the attention's, the residual's and the MLP's)."""
    for rank in per_rank(results, "btp"):
        kinds = [s.split("(")[1].split(",")[0] for s in rank["sites"]]
        assert kinds.count("attention") == 2 and kinds.count("dropout") == 1 + 2 * 2, rank["sites"]
        assert rank["graphs"] == 1


def test_a_mask_drawn_by_hand_on_a_sharded_tensor_is_refused(results):
    for rank in per_rank(results, "hand"):
        assert rank["message"].startswith("ParallelizeError"), rank["message"]
        assert "rand_like draws random values shaped like a tensor cut across the TP ranks" in rank["message"]
        assert "use F.dropout or nn.Dropout there" in rank["message"]


@pytest.mark.parametrize("name", params(["megatron", "megatron-inductor", "btp", "megatron-no-dropout"]))
def test_verify_says_per_rank_masks_are_not_compared(results, name):
    """A rank's own masks are no one-process run's: verify reports the rank's program unverified,
    naming the dropout, and compares nothing after it (the finished compile draws them too); without
    dropout the same program is verified."""
    for rank in per_rank(results, name):
        (lines,) = rank["verify"]
        if name == "megatron-no-dropout":
            assert lines[0].startswith("tp_localize + ") and ": verified (" in lines[0], lines
            assert lines[-1].startswith("compiled (") and ": verified (" in lines[-1], lines
        else:
            (line,) = lines
            assert line.startswith("tp_localize + ") and ": unverified (" in line, line
            assert "dropout on a sharded tensor draws each rank's own mask by design" in line, line
