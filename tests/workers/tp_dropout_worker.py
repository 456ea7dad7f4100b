"""Worker for the TP dropout tests (gloo on CPU, 2 ranks): nanoGPT with dropout (attention
probabilities through SDPA's dropout_p, the residual and MLP dropouts, the embedding dropout),
heads 0 and 2 made identical (their q/k/v rows and their c_proj columns), sharded with
megatron (dense) or btp (low-rank), compiled by the boost backend, one AdamW step.

Each rank reports the gathered gradients of the two heads' rows (equal to the last bit when
the two heads draw the same mask), a digest of every replicated parameter and its gradient
after the step (equal across ranks when the shared stream stays in step), and the graph's
rank-local dropout sites."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch
import torch.distributed as dist
from scenario_runner import run_on_gloo
from style_models import GPT, GPTConfig, _factorize, nanogpt_loss

import boost_compile as bc
from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig

SEQ, BATCH, HEAD_DIM = 16, 2, 16


def twin_heads(model: torch.nn.Module) -> None:
    """Head 2 := head 0 in every block: the same q/k/v rows and c_proj columns."""
    a, b = slice(0, HEAD_DIM), slice(2 * HEAD_DIM, 3 * HEAD_DIM)
    with torch.no_grad():
        for block in model.transformer.h:
            for name in ("q_attn", "k_attn", "v_attn"):
                w = getattr(block.attn, name).weight
                w[b] = w[a]
            block.attn.c_proj.weight[:, b] = block.attn.c_proj.weight[:, a]


def hand_written_dropout() -> dict[str, Any]:
    """A mask drawn with rand_like on btp's d-sharded stream: refused, naming the op."""
    from boost_compile.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.preset("tiny"))
    model.layers[0].register_forward_hook(lambda _m, _i, out: out * (torch.rand_like(out) > 0.1))
    tokens = torch.zeros(2, 16, dtype=torch.long)
    try:
        bc.parallelize_(model, (tokens,), dist.group.WORLD, "btp")
        return {"message": "no error"}
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return {"message": f"{type(exc).__name__}: {exc}"}


def scenario(sc: dict[str, Any]) -> dict[str, Any]:
    if sc["plan"] == "hand":
        return hand_written_dropout()
    torch.manual_seed(0)
    model = GPT(GPTConfig(fused_qkv=False, dropout=sc["dropout"]))
    twin_heads(model)
    if sc["plan"] == "btp":
        _factorize(model)
    model.train()
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    bc.parallelize_(model, (tokens,), dist.group.WORLD, plan=sc["plan"])
    rec = Recorder()
    config = BoostConfig.from_options({"inner": sc.get("inner", "aot_eager")})
    compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, recorder=rec))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(sc.get("seed", 5))  # every rank alike, as boost-train and users seed
    nanogpt_loss(compiled, tokens).backward()
    grads = bc.gather_full_grads(model)
    out: dict[str, Any] = {"twins": []}
    if sc["plan"] == "megatron":
        a, b = slice(0, HEAD_DIM), slice(2 * HEAD_DIM, 3 * HEAD_DIM)
        for i in range(len(model.transformer.h)):
            g = grads[f"transformer.h.{i}.attn.q_attn.weight"]
            out["twins"].append({"equal": bool(torch.equal(g[a], g[b])), "diff": float((g[a] - g[b]).abs().max())})
    replicated = {n: p for n, p in model.named_parameters() if getattr(p, "_boost_tp", None) is None
                  or p._boost_tp.dim is None}
    out["replicated_grads"] = {n: p.grad.double().sum().item() if p.grad is not None else None for n, p in replicated.items()}
    opt.step()
    out["replicated_params"] = {n: p.detach().double().sum().item() for n, p in replicated.items()}
    out["replicated_bytes"] = {n: hashlib.sha256(p.detach().numpy().tobytes()).hexdigest() for n, p in replicated.items()}
    out["sites"] = [line for g in rec.graphs for r in g.reports if r.name == "tp_localize"
                    for line in r.rewritten if line.startswith("rank-local dropout")]
    out["graphs"] = len(rec.graphs)
    out["verify"] = [g.verify.lines() for g in rec.graphs if g.verify is not None]
    return out


def worker(rank: int, world: int, store: str, scenarios: list[dict[str, Any]], result_path: str) -> None:
    run_on_gloo(rank, world, store, scenarios, result_path, scenario)
