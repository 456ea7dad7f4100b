"""Worker for pipelines on four gloo processes, a 2 x 2 mesh ("pp", "x"): PP x TP, where each
stage is parallelized over its pair with btp (the stream between stages d-sharded) or megatron,
and PP x DP, where each pair splits the batch and averages the stage gradients. Every stage is
compiled with backend="boost". The whole model runs beside them in one process, eagerly in fp32
and in fp64 (the truth): each rank measures its stages' gathered gradients, the reference's and,
on the last stage, the losses against the truth (conftest.error_pair)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import error_pair, fp64_copy, grads, upcast
from scenario_runner import run_scenarios

import boost_compile as bc
from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig
from boost_compile.distributed.pipeline import (
    PipelineError,
    build_schedule,
    pipeline_step,
    split_model,
    vocab_parallel_loss,
)
from boost_compile.models import Llama, LlamaConfig

SEQ, BATCH, MICRO = 16, 4, 2


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(upcast(logits.flatten(0, 1)), targets.flatten())


def average_grads(modules: list[torch.nn.Module], group: Any) -> None:
    for module in modules:
        for p in module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad /= dist.get_world_size(group)


def scenario(sc: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """``sc["mode"]``: "tp" (the pair is a TP group) or "dp" (a data-parallel pair)."""
    pp_rank, pp = mesh["pp"].get_local_rank(), mesh["pp"].size()
    pair, mode = mesh["x"], sc.get("mode", "tp")
    virtual = sc.get("virtual", 1)
    num_stages = pp * virtual
    indices = list(range(pp_rank, num_stages, pp))
    if sc["preset"] == "hf":  # a Hugging Face LlamaForCausalLM (2 blocks, GQA)
        from conftest import tiny_hf_llama

        ref = tiny_hf_llama()
        dim = ref.config.hidden_size

        def ref_loss(m: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
            return loss_fn(m(input_ids=t).logits, t)
    else:
        torch.manual_seed(0)
        ref = Llama(LlamaConfig.preset(sc["preset"], n_kv_heads=4, n_layers=4))
        dim = ref.config.dim

        def ref_loss(m: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
            return m(t, t)
    truth = fp64_copy(ref)
    stages = [split_model(ref, i, num_stages) for i in indices]
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    local = tokens.chunk(pair.size())[pair.get_local_rank()] if mode == "dp" else tokens
    mb = local.shape[0] // MICRO
    out: dict[str, Any] = {}
    if mode == "tp":
        for i, stage in zip(indices, stages, strict=True):
            example = local[:mb] if i == 0 else torch.randn(mb, SEQ, dim)
            shard_logits = sc.get("shard_logits", False) and i == num_stages - 1
            bc.parallelize_(stage, (example,), pair, plan=sc["plan"], stream_io=True, shard_logits=shard_logits)
            try:  # run eagerly, a TP stage must refuse (its collectives exist only in the compiled graph)
                stage(example)
                out.setdefault("eager_refused", []).append(False)
            except RuntimeError as exc:
                out.setdefault("eager_refused", []).append("torch.compile(" in str(exc))
    if sc.get("explain"):  # what explain reports of each stage's point-to-point traffic
        for i, stage in zip(indices, stages, strict=True):
            x = local[:mb] if i == 0 else torch.randn(mb, SEQ, dim // getattr(stage, "_boost_stream_shards", 1))
            out.setdefault("explain", []).append(bc.explain(stage, x, options={"inner": "aot_eager"}).pipeline)
    rec = Recorder()
    config = BoostConfig.from_options({"inner": "aot_eager"})
    # dynamic=False: a rank's stages share LlamaStage.forward, and Dynamo would otherwise make the
    # second stage's shapes symbolic (automatic dynamic shapes on a recompile of the same code)
    backend = functools.partial(compile_graph, config=config, recorder=rec)
    compiled = [torch.compile(s, backend=backend, dynamic=False) for s in stages]
    last = num_stages - 1 in indices
    loss = loss_fn
    if sc.get("shard_logits"):
        try:  # a plain loss on the vocabulary slice is refused
            build_schedule(compiled, indices, num_stages, mesh["pp"].get_group(), MICRO, sc["schedule"], loss_fn,
                           example_microbatch=local[:mb])
            out["plain_loss_refused"] = False
        except PipelineError as exc:
            out["plain_loss_refused"] = "vocab_parallel_loss(stage)" in str(exc)
        if last:
            loss = vocab_parallel_loss(compiled[indices.index(num_stages - 1)])
    schedule = build_schedule(compiled, indices, num_stages, mesh["pp"].get_group(), MICRO, sc["schedule"], loss,
                              example_microbatch=local[:mb])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, truth, *stages)]
    parity: dict[str, list] = {"loss": [], "grad": []}
    out["parity"] = parity
    for _ in range(sc.get("steps", 5)):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss_ref = ref_loss(ref, tokens)
        loss_ref.backward()
        loss_truth = ref_loss(truth, tokens)
        loss_truth.backward()
        loss = pipeline_step(schedule, local, local)
        if mode == "dp":
            average_grads(stages, pair.get_group())
            if last:  # the whole batch's loss: the mean of the pair's halves
                dist.all_reduce(loss, group=pair.get_group())
                loss /= pair.size()
        if loss is not None:
            parity["loss"].append(error_pair({"loss": loss}, {"loss": loss_ref}, {"loss": loss_truth}))
        gathered = {n: g for s in stages for n, g in bc.gather_full_grads(s).items()}
        held = set(gathered)
        parity["grad"].append(error_pair(gathered, {n: g for n, g in grads(ref).items() if n in held},
                                         {n: g for n, g in grads(truth).items() if n in held}))
        out.setdefault("missing_grads", [n for n, g in gathered.items() if g is None])
        for opt in opts:
            opt.step()
    if not parity["loss"]:
        del parity["loss"]  # only the last stage's ranks see the loss
    census = [r for g in rec.graphs for r in g.aten_reports if r.name == "collective_census"]
    out["collectives"] = {k: [c for r in census if r.details["graph"] == k for c in r.details["collectives"]]
                          for k in ("forward", "backward")}
    out["stages"], out["graphs"] = indices, len(rec.graphs)
    out["stream_shards"] = [getattr(s, "_boost_stream_shards", 1) for s in stages]
    return out


def worker(rank: int, world: int, store: str, scenarios: list[dict[str, Any]], result_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch._dynamo.config.cache_size_limit = 64
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "x"))  # a TP (or DP) pair is consecutive ranks

    def run(sc: dict[str, Any]) -> dict[str, Any]:
        # the collective census runs inside the compile: a cache hit would skip it
        with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
            return scenario(sc, mesh)

    run_scenarios(rank, world, scenarios, result_path, run)
