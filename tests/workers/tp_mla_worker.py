"""Worker for the multi-head latent attention tests (gloo on CPU, 2 ranks): tiny Hugging Face
DeepSeek-V3 and DeepSeek-V2 models (dense MLPs) sharded with megatron, compiled by the boost
backend (inner aot_eager), a few SGD steps.

As in tp_worker: each rank runs the unsharded model (eager fp32), its float64 copy (the truth)
and the sharded, compiled copy on the same tokens and steps, and reports the loss and gathered
gradient error pairs of every step (conftest.error_pair; the test applies conftest.assert_parity),
the parameters' ShardSpec roles and the check's repairs. A scenario with ``"expect"`` reports the
message parallelize_ refuses it with."""

from __future__ import annotations

import copy
import functools
import time
from typing import Any

import torch
import torch.distributed as dist
from conftest import fp64_copy
from scenario_runner import run_on_gloo
from tp_steps import sgd_steps

import boost_compile as bc
from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig

SEQ, BATCH, VOCAB = 16, 2, 128

#: hidden 64, 2 layers, 4 heads; q and kv latents of 24 and 16; the dense MLP in both layers
SIZES = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "first_k_dense_replace": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
}


def build(kind: str, **overrides: Any) -> torch.nn.Module:
    """A tiny MLA model: DeepSeek ``v3`` (interleaved real rope), ``v2`` (complex rope) or
    ``minicpm3`` (rotate-half rope, no experts)."""
    import transformers

    torch.manual_seed(0)
    config_cls, model_cls = {
        "v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "minicpm3": (transformers.MiniCPM3Config, transformers.MiniCPM3ForCausalLM),
    }[kind]
    sizes = SIZES if kind != "minicpm3" else {k: v for k, v in SIZES.items() if k in MLA_SIZES}
    return model_cls(config_cls(**{**sizes, **overrides})).float()

MLA_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def key_by_repeat(self: Any, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's ``expand_kv`` with the shared rope key copied to every head by ``repeat`` (a
    replicated tensor of all heads, not a broadcast view), then concatenated to the local heads'."""
    batch, _, seq, _ = kv_nope.shape
    kv = self.kv_b_proj(kv_nope).view(batch, seq, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
    k_nope, value_states = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    return torch.cat((k_nope, k_rot.repeat(1, self.num_heads, 1, 1)), dim=-1), value_states


def refusal(sc: dict[str, Any]) -> dict[str, Any]:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    model = build(sc["model"], **sc.get("config", {}))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    if sc.get("factorize_mlp"):  # the MLP low-rank, the attention dense
        bc.factorize_(model, bc.FactorizeConfig(rank_ratio=0.25), lambda _m, name: ".mlp." in name)
    original = DeepseekV3Attention.expand_kv
    if sc.get("key_by_repeat"):
        DeepseekV3Attention.expand_kv = key_by_repeat
    try:
        bc.parallelize_(model, (tokens,), dist.group.WORLD, plan=sc["plan"])
        return {"message": "no error"}
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return {"message": f"{type(exc).__name__}: {exc}"}
    finally:
        DeepseekV3Attention.expand_kv = original


def scenario(sc: dict[str, Any]) -> dict[str, Any]:
    if "expect" in sc:
        return refusal(sc)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    original = DeepseekV3Attention.expand_kv
    if sc.get("key_by_repeat"):
        DeepseekV3Attention.expand_kv = key_by_repeat
    try:
        return _trained(sc)
    finally:
        DeepseekV3Attention.expand_kv = original


def _trained(sc: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    ref = build(sc["model"], **sc.get("config", {}))
    truth = fp64_copy(ref)
    model = copy.deepcopy(ref)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    report = bc.parallelize_(model, (tokens,), dist.group.WORLD, plan=sc["plan"])
    rec = Recorder()
    config = BoostConfig.from_options({"inner": sc.get("inner", "aot_eager")})
    compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, recorder=rec))
    parity, missing = sgd_steps(ref, truth, model, compiled, lambda m: loss_of(m, tokens), sc.get("steps", 3))
    localize = [r for g in rec.graphs for r in g.reports if r.name == "tp_localize"]
    return {
        "parity": parity,
        "missing_grads": missing,
        "roles": {name: spec.role for name, spec in report.specs.items()},
        "report": str(report),
        "repairs": report.check.rewritten,
        "refused": [r.details.get("refused") for r in localize],
        "graphs": len(rec.graphs),
        "group_skipped": [f"{site}: {why}" for g in rec.graphs for r in g.reports if r.name == "group_linears"
                          for site, why in r.skipped],
        "seconds": time.perf_counter() - start,
    }


def worker(rank: int, world: int, store: str, scenarios: list[dict[str, Any]], result_path: str) -> None:
    run_on_gloo(rank, world, store, scenarios, result_path, scenario)
