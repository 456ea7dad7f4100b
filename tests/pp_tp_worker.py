"""Worker for PP x TP on four gloo processes: a (pp=2, tp=2) mesh, each stage parallelized with
btp (the stream between stages d-sharded) or megatron, compiled with backend="boost"."""

from __future__ import annotations

import functools
import json
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import boost_compile as bc
from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig
from boost_compile.distributed.pipeline import build_schedule, pipeline_step, split_model
from boost_compile.models import Llama, LlamaConfig

SEQ, BATCH, MICRO = 16, 4, 2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def scenario(sc: dict[str, Any], mesh: Any) -> dict[str, Any]:
    pp_rank, pp = mesh["pp"].get_local_rank(), mesh["pp"].size()
    torch.manual_seed(0)
    ref = Llama(LlamaConfig.preset(sc["preset"], n_kv_heads=4, n_layers=4))
    stage = split_model(ref, pp_rank, pp)
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mb = BATCH // MICRO
    example = tokens[:mb] if pp_rank == 0 else torch.randn(mb, SEQ, ref.config.dim)
    bc.parallelize_(stage, (example,), mesh["tp"], plan=sc["plan"], stream_io=True)
    rec = Recorder()
    config = BoostConfig.from_options({"inner": "aot_eager"})
    compiled = torch.compile(stage, backend=functools.partial(compile_graph, config=config, recorder=rec))
    schedule = build_schedule([compiled], [pp_rank], pp, mesh["pp"].get_group(), MICRO, "1f1b", loss_fn,
                              example_microbatch=tokens[:mb])
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    out: dict[str, Any] = {"loss": [], "grad": []}
    for _ in range(sc.get("steps", 3)):
        opt_ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        loss_ref = ref(tokens, tokens)
        loss_ref.backward()
        loss = pipeline_step(schedule, tokens, tokens)
        if loss is not None:
            out["loss"].append(rel(loss, loss_ref.detach()))
        grads = bc.gather_full_grads(stage)
        reference = dict(ref.named_parameters())
        out["grad"].append(max(rel(g, reference[n].grad) for n, g in grads.items() if g is not None))
        out.setdefault("missing_grads", [n for n, g in grads.items() if g is None])
        opt_ref.step()
        opt.step()
    census = [r for g in rec.graphs for r in g.aten_reports if r.name == "collective_census"]
    out["collectives"] = {k: [c for r in census if r.details["graph"] == k for c in r.details["collectives"]]
                          for k in ("forward", "backward")}
    out["stage"], out["graphs"] = pp_rank, len(rec.graphs)
    out["stream_shards"] = getattr(stage, "_boost_stream_shards", 1)
    return out


def worker(rank: int, world: int, store: str, scenarios: list[dict[str, Any]], result_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch._dynamo.config.cache_size_limit = 64
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))  # a TP pair is consecutive ranks
    results: dict[str, Any] = {}
    for sc in scenarios:
        try:
            with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
                results[sc["name"]] = scenario(sc, mesh)
        except Exception:  # noqa: BLE001 - reported to the test
            results[sc["name"]] = {"error": traceback.format_exc()}
        torch._dynamo.reset()
        dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()
