"""Expert parallelism (``boost_compile.distributed.expert_parallel``): two gloo processes
(``mp.spawn``) shard transformers' tiny mixtures of experts by expert, each rank runs its own rows of
the batch, and the losses and every gradient (the replicated ones averaged over the ranks, the
experts' gathered) are judged by the parity rule against the whole batch in one process (eager
fp32) and its float64 truth. One group runs several architectures in turn. Extended: the same
under EP2 x TP2 (4 processes, megatron over tp, compiled by boost).

The experts run transformers' "eager" implementation in every run (its grouped GEMM has no
float64); a planted bug (the experts' gradients not divided by ep) must break the rule.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

#: routed experts, a latent-attention model with a dense first layer, experts with biases and a
#: clamped gate, and Llama 4's every-token-through-every-expert form
MAIN = ("qwen3_moe", "gpt_oss", "llama4_text")
EXTENDED = ("mixtral", "deepseek_v3")


def _references(eager: torch.nn.Module, truth: torch.nn.Module, ids: torch.Tensor) -> tuple[dict, dict]:
    """The whole batch in one process: eager fp32 and its float64 truth, each loss and gradient by name."""
    from boost_compile.parity import Float64Program

    out = []
    for model, fp64 in ((eager, False), (truth, True)):
        with Float64Program() if fp64 else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        out.append({**{n: p.grad for n, p in model.named_parameters()}, "loss": loss.detach()})
    return out[0], out[1]


def _worker(rank: int, world: int, port: int, types: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    import transformers

    from boost_compile.bench.zoo_models import tiny_config, zero_dropout
    from boost_compile.distributed.expert_parallel import expert_parallel_, is_expert_parameter
    from boost_compile.parity import compare
    from boost_compile.process_exit import exit_without_finalizing

    results = {}
    for model_type in types:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type)).float()
        zero_dropout(model)
        with contextlib.suppress(Exception):  # an architecture without the choice keeps its own
            model.set_experts_implementation("eager")
        eager, truth = copy.deepcopy(model), copy.deepcopy(model).double()
        report = expert_parallel_(model)
        vocab = model.get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (2 * world, 16), generator=torch.Generator().manual_seed(1))
        mine = ids[2 * rank:2 * rank + 2]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        tested, experts = {}, []
        for name, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)  # no rows reached this rank's expert
            if is_expert_parameter(p):
                parts = [torch.empty_like(g) for _ in range(world)]
                dist.all_gather(parts, g.contiguous())
                tested[name] = torch.cat(parts)
                experts.append(name)
            else:
                tested[name] = g.clone()
                dist.all_reduce(tested[name])
                tested[name] /= world
        tested["loss"] = loss.detach().clone()
        dist.all_reduce(tested["loss"])
        tested["loss"] /= world
        e, t = _references(eager, truth, ids)
        planted = {**tested, **{n: tested[n] * world for n in experts}}
        results[model_type] = {
            "bad": [str(b) for b in compare(tested, e, t, torch.float32)],
            "planted": sorted(b.name for b in compare(planted, e, t, torch.float32)),
            "experts": experts, "layers": report.layers,
            "local": report.local_numel, "total": report.total_numel, "shapes": {
                n: list(p.shape) for n, p in model.named_parameters() if is_expert_parameter(p)},
            "whole": {n: list(p.shape) for n, p in eager.named_parameters() if n in experts},
        }
    results["skewed"] = _skewed(rank, world)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalizing(0)


def _skewed(rank: int, world: int) -> dict:
    """Every token routed to rank 0's experts: rank 1 receives no rows, yet runs both all-to-alls'
    backward and gives its experts a zero gradient. Judged on the experts module alone: outputs,
    input gradients and expert gradients (times ep: the hook's data-parallel mean of a summed loss)."""
    import torch.distributed as dist
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from boost_compile.bench.zoo_models import tiny_config
    from boost_compile.distributed.expert_parallel import shard_experts
    from boost_compile.parity import Float64Program, compare

    config = tiny_config("qwen3_moe")
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    whole = Qwen3MoeExperts(config)
    with torch.no_grad():
        for p in whole.parameters():
            p.normal_(0, 0.1)
    tested_module, truth_module = copy.deepcopy(whole), copy.deepcopy(whole).double()
    shard_experts(tested_module, "routed", dist.group.WORLD)
    g = torch.Generator().manual_seed(2)
    rows = 4 * world
    hidden = torch.randn(rows, config.hidden_size, generator=g)
    index = torch.stack([torch.zeros(rows, dtype=torch.long), torch.ones(rows, dtype=torch.long)], 1)
    weights, probe = torch.rand(rows, 2, generator=g), torch.randn(rows, config.hidden_size, generator=g)

    def run(module, x, idx, w, pr):
        x = x.clone().requires_grad_()
        out = module(x, idx, w)
        (out * pr).sum().backward()
        return out.detach(), x.grad

    mine = slice(4 * rank, 4 * rank + 4)
    out, x_grad = run(tested_module, hidden[mine], index[mine], weights[mine], probe[mine])
    received: list = [None] * world
    dist.all_gather_object(received, all(p.grad is not None for p in tested_module.parameters()))
    tested = {}
    for name, t in [("out", out), ("x_grad", x_grad)] + [(n, p.grad * world) for n, p in tested_module.named_parameters()]:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        tested[name] = torch.cat(parts)
    eager = dict(zip(("out", "x_grad"), run(whole, hidden, index, weights, probe), strict=True))
    eager.update({n: p.grad for n, p in whole.named_parameters()})
    with Float64Program():
        truth = dict(zip(("out", "x_grad"), run(truth_module, hidden.double(), index, weights.double(), probe.double()),
                         strict=True))
    truth.update({n: p.grad for n, p in truth_module.named_parameters()})
    return {"bad": [str(b) for b in compare(tested, eager, truth, torch.float32)], "grads": all(received)}


def _tp_worker(rank: int, world: int, port: int, types: list[str], out: str) -> None:
    """EP2 x TP2 on a (dp 2, tp 2) mesh: ``parallelize_`` (megatron) over tp first, then the experts
    over dp, compiled by boost; each dp pair its batch row. Judged as in :func:`_worker`, the TP
    shards gathered first."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world)
    import transformers

    import boost_compile as bc
    from boost_compile import _torch_compat as compat
    from boost_compile.bench.zoo_models import tiny_config, zero_dropout
    from boost_compile.distributed.expert_parallel import expert_parallel_, is_expert_parameter
    from boost_compile.distributed.shard import full_tensor
    from boost_compile.parity import compare
    from boost_compile.process_exit import exit_without_finalizing
    from boost_compile.train.fsdp import tp_specs_by_name

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    results = {}
    for model_type in types:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type)).float()
        zero_dropout(model)
        with contextlib.suppress(Exception):  # one graph (parallelize_ captures the model whole), float64 too
            model.set_experts_implementation("batched_mm")
        eager, truth = copy.deepcopy(model), copy.deepcopy(model).double()
        vocab = model.get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
        mine = ids[dp_rank:dp_rank + 1]
        bc.parallelize_(model, (mine,), mesh["tp"], plan="megatron")
        expert_parallel_(model, dp_group)
        specs = tp_specs_by_name(model)
        compat.reset_dynamo()  # the previous architecture's graphs and their guards gone
        loss = torch.compile(model, backend="boost", options={"inner": "aot_eager"})(input_ids=mine, labels=mine).loss
        loss.backward()
        tested = {}
        for name, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            g = full_tensor(g, specs[name]) if name in specs else g.clone()
            if is_expert_parameter(p):
                parts = [torch.empty_like(g) for _ in range(2)]
                dist.all_gather(parts, g.contiguous(), group=dp_group)
                tested[name] = torch.cat(parts)
            else:
                dist.all_reduce(g, group=dp_group)
                tested[name] = g / 2
        tested["loss"] = loss.detach().clone()
        dist.all_reduce(tested["loss"], group=dp_group)
        tested["loss"] /= 2
        e, t = _references(eager, truth, ids)
        results[model_type] = {"bad": [str(b) for b in compare(tested, e, t, torch.float32)],
                               "tp": len(specs), "experts": sum(is_expert_parameter(p) for p in model.parameters())}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalizing(0)


def _run(types: tuple[str, ...], tmp_path: Path, worker=_worker, world: int = 2) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "results.json"
    mp.spawn(worker, args=(world, port, list(types), str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())


def _check(results: dict, model_type: str) -> None:
    r = results[model_type]
    assert r["bad"] == [], f"{model_type} under EP2 breaks the parity rule: {r['bad']}"
    assert r["layers"] and set(r["layers"].values()) == ({"dense"} if model_type == "llama4_text" else {"routed"})
    # each rank holds half of every expert tensor, cut on the expert dim
    assert r["total"] == 2 * r["local"] > 0
    for name in r["experts"]:
        assert r["shapes"][name] == [r["whole"][name][0] // 2, *r["whole"][name][1:]]
    # the rule can fail: expert gradients left summed over the ranks break it, and only those
    assert r["planted"] and set(r["planted"]) <= set(r["experts"])


def test_ep2_matches_one_process(tmp_path):
    results = _run(MAIN, tmp_path)
    for model_type in MAIN:
        _check(results, model_type)
    assert results["skewed"] == {"bad": [], "grads": True}


@pytest.mark.extended
def test_ep2_matches_one_process_more_architectures(tmp_path):
    results = _run(EXTENDED, tmp_path)
    for model_type in EXTENDED:
        _check(results, model_type)


@pytest.mark.extended
def test_ep2_x_tp2_matches_one_process(tmp_path):
    """The issue's five: routed experts, latent attention, biases, Llama 4's form, under megatron."""
    results = _run(MAIN + EXTENDED, tmp_path, _tp_worker, 4)
    for model_type, r in results.items():
        assert r["bad"] == [], f"{model_type} under EP2 x TP2 breaks the parity rule: {r['bad']}"
        assert r["tp"] > 0 and r["experts"] > 0


def test_experts_of_another_form_are_refused_by_name():
    """A list of expert modules (older code) is named in the refusal; a model without experts too."""
    from torch import nn

    from boost_compile.distributed.expert_parallel import ExpertParallelError, find_experts

    class Moe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    model = nn.Sequential(nn.Linear(8, 8), Moe())
    with pytest.raises(ExpertParallelError, match=r"1\.experts \(ModuleList\)"):
        find_experts(model)
    assert find_experts(nn.Sequential(nn.Linear(8, 8))) == {}
