"""Multi-head latent attention (DeepSeek-V2/V3) under tensor parallelism, against one process.

Sharded as Megatron-LM shards MLA: the down projections (q_a_proj, kv_a_proj_with_mqa) and
their latent norms replicated, the up projections (q_b_proj, kv_b_proj) column-parallel split
by heads, o_proj row-parallel, the rope key all heads share replicated and expanded to this
rank's heads (tests/workers/tp_mla_worker.py: tiny Hugging Face DeepSeek-V3 and -V2 with dense
MLPs, 2 gloo ranks, megatron, the boost backend with inner aot_eager, 3 SGD steps). The loss
and every gathered gradient of every step, and the weights after the last, follow the parity
rule (conftest.assert_parity) against the unsharded eager run and its float64 copy."""

from __future__ import annotations

import pytest
from conftest import assert_parity
from scenario_runner import per_rank, spawn_scenarios

pytestmark = pytest.mark.extended  # make test-extended (CI runs it after make test)

SCENARIOS = [
    {"name": "v3-megatron", "model": "v3", "plan": "megatron"},
    {"name": "v2-megatron", "model": "v2", "plan": "megatron", "steps": 2},
    # no q latent (DeepSeek-V2-Lite): q_proj column-parallel next to the replicated kv_a_proj_with_mqa on
    # one input, which group_linears leaves apart (one GEMM has one input gradient); no KV cache
    {"name": "v3-no-q-latent", "model": "v3", "plan": "megatron", "steps": 2,
     "config": {"q_lora_rank": None, "use_cache": False}},
    {"name": "minicpm3-megatron", "model": "minicpm3", "plan": "megatron", "steps": 2},
    {"name": "v3-btp", "model": "v3", "plan": "btp", "expect": "refused"},
    {"name": "v3-btp-factorized-mlp", "model": "v3", "plan": "btp", "factorize_mlp": True, "expect": "refused"},
    {"name": "v3-key-by-repeat", "model": "v3", "plan": "megatron", "key_by_repeat": True, "steps": 2},
]

MLA_ROLES = {
    "q_a_proj.weight": "replicate",
    "kv_a_proj_with_mqa.weight": "replicate",
    "q_b_proj.weight": "col",
    "kv_b_proj.weight": "col",
    "o_proj.weight": "row",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tp_mla_worker import worker

    return spawn_scenarios(worker, 2, SCENARIOS, tmp_path_factory.mktemp("tp_mla"))


TRAINED = ["v3-megatron", "v2-megatron", "v3-no-q-latent", "minicpm3-megatron"]


@pytest.mark.parametrize("name", TRAINED)
def test_mla_under_megatron_trains_like_one_process(results, name):
    for rank, r in enumerate(per_rank(results, name)):
        assert r["missing_grads"] == [], r["missing_grads"]
        assert_parity(r["parity"], "float32", f"{name} rank {rank}")
        assert r["graphs"] == 1 and r["refused"] == [0]


@pytest.mark.parametrize("name", TRAINED)
def test_mla_plan_is_megatron_lms(results, name):
    r = per_rank(results, name)[0]
    roles = dict(MLA_ROLES)
    if name == "v3-no-q-latent":
        del roles["q_a_proj.weight"], roles["q_b_proj.weight"]
        roles["q_proj.weight"] = "col"
        assert sum("different tensor-parallel roles" in line for line in r["group_skipped"]) == 2, r["group_skipped"]
    for layer in (0, 1):
        for param, role in roles.items():
            assert r["roles"][f"model.layers.{layer}.self_attn.{param}"] == role, (param, r["roles"])
        # the latent norms keep no spec: whole on every rank
        assert not any(f"layers.{layer}.self_attn.q_a_layernorm" in n or "kv_a_layernorm" in n for n in r["roles"])
        for mlp, role in (("gate_proj", "col"), ("up_proj", "col"), ("down_proj", "row")):
            assert r["roles"][f"model.layers.{layer}.mlp.{mlp}.weight"] == role
    # the head is vocabulary-parallel; MiniCPM3 ties it to the embedding, which keeps it whole
    assert r["roles"].get("lm_head.weight") == (None if name.startswith("minicpm3") else "col")
    # the key buffer holds this rank's heads; the shared rope key is expanded to them, its gradient summed
    repairs = "\n".join(r["repairs"])
    assert repairs.count("(2, 4, 16, 24) -> (2, 2, 16, 24)") == 2, repairs
    assert repairs.count("to this rank's part of dim 1") == 2, repairs


def test_btp_refuses_dense_mla_in_one_line(results):
    for name in ("v3-btp", "v3-btp-factorized-mlp"):
        for r in per_rank(results, name):
            message = r["message"]
            assert message.startswith("ParallelizeError: plan btp needs every block linear to be a bottleneck"), message
            assert "\n" not in message and "q_a_proj" in message


def test_a_rope_key_repeated_to_every_head_is_cut_to_this_ranks_heads(results):
    """A broadcast (``expand``) of the shared key is narrowed to this rank's heads; a ``repeat``
    holds all heads' copies on every rank, so this rank's heads' copies are sliced from it (dim 1)
    and their gradients gathered in backward, which the repeat's own backward sums."""
    for rank, r in enumerate(per_rank(results, "v3-key-by-repeat")):
        assert r["missing_grads"] == [], r["missing_grads"]
        assert_parity(r["parity"], "float32", f"v3-key-by-repeat rank {rank}")
        sliced = [line for line in r["repairs"] if line.startswith("scatter repeat") and "this rank's slice of dim 1" in line]
        assert len(sliced) == 2, r["repairs"]  # one per block
