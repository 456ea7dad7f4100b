"""Worker for the two-process pipeline-parallel tests (gloo on CPU).

Every rank builds the same reference model (one seed), cuts its own stages out of
it with ``split_model``, compiles each with ``backend="boost"`` and runs SGD steps
through a ``torch.distributed.pipelining`` schedule, while stepping the whole
reference model on the same batch. Each rank compares the gradients of the
parameters it holds with the reference's (same FQN); the rank with the last stage
compares the losses. Rank 0 writes every rank's figures to JSON.
"""

from __future__ import annotations

import os

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import datetime  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import error_pair, fp64_copy, grads, params, upcast  # noqa: E402
from scenario_runner import run_scenarios  # noqa: E402

from boost_compile.distributed.pipeline import build_schedule, pipeline_step, split_model  # noqa: E402
from boost_compile.models import Llama, LlamaConfig  # noqa: E402

SEQ, BATCH, LR = 16, 4, 0.1


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(upcast(logits.flatten(0, 1)), targets.flatten())


def build(kind: str) -> tuple[torch.nn.Module, Any]:
    """(reference model, logits of a batch of tokens)."""
    torch.manual_seed(0)
    if kind == "hf":
        from conftest import tiny_hf_llama

        return tiny_hf_llama(), lambda m, t: m(input_ids=t).logits
    n_layers = int(kind.partition(":")[2] or 2)
    return Llama(LlamaConfig.preset("tiny", n_layers=n_layers)), lambda m, t: m(t)


def compile_stage(stage: torch.nn.Module, how: str) -> torch.nn.Module:
    options = {"inner": "aot_eager"}
    if how == "wrap":
        return torch.compile(stage, backend="boost", options=options)
    if how == "inplace":
        stage.compile(backend="boost", options=options)
        return stage
    return stage  # "eager"


def scenario(sc: dict[str, Any]) -> dict[str, Any]:
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch._dynamo.utils.counters.clear()
    ref, logits_of = build(sc["model"])
    truth = fp64_copy(ref)
    num_stages = pp * sc.get("virtual", 1)
    indices = list(range(rank, num_stages, pp))  # stage i on rank i % pp
    stages = [split_model(ref, i, num_stages) for i in indices]
    runs = [compile_stage(s, sc.get("compile", "wrap")) for s in stages]
    n_mb = sc["microbatches"]
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    schedule = build_schedule(runs, indices, num_stages, dist.group.WORLD, n_mb, sc["schedule"], loss_fn,
                              tokens[: BATCH // n_mb], batch_size=BATCH)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (ref, truth)]
    opts.append(torch.optim.SGD([p for s in stages for p in s.parameters()], lr=LR))
    parity: dict[str, list] = {"loss": [], "grad": []}
    out: dict[str, Any] = {"parity": parity, "losses": [], "stages": indices,
                           "layers": [list(s.layer_range) for s in stages]}

    def mine(values: dict[str, Any]) -> dict[str, Any]:
        """The entries of the parameters this rank's stages hold."""
        names = {n for s in stages for n, _ in s.named_parameters()}
        return {n: v for n, v in values.items() if n in names}

    for _ in range(sc.get("steps", 5)):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss_ref = loss_fn(logits_of(ref, tokens), targets)
        loss_ref.backward()
        loss_truth = loss_fn(logits_of(truth, tokens), targets)
        loss_truth.backward()
        loss = pipeline_step(schedule, tokens, targets)
        if loss is not None:
            parity["loss"].append(error_pair({"loss": loss}, {"loss": loss_ref}, {"loss": loss_truth}))
            out["losses"].append(loss.item())
        held = {n: p.grad for s in stages for n, p in s.named_parameters()}
        out.setdefault("missing_grads", sorted(n for n, g in held.items() if g is None))
        out.setdefault("names", sorted(held))
        parity["grad"].append(error_pair(held, mine(grads(ref)), mine(grads(truth))))
        for opt in opts:
            opt.step()
    parity["param"] = error_pair({n: p.detach() for s in stages for n, p in s.named_parameters()},
                                 mine(params(ref)), mine(params(truth)))
    if not parity["loss"]:
        del parity["loss"]  # only the last stage's rank sees the loss
    out["ref_names"] = sorted(dict(ref.named_parameters()))
    out["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # Dynamo graphs compiled here
    return out


def worker(rank: int, world: int, store: str, scenarios: list[dict[str, Any]], result_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            # a failing rank must not hang the other
                            timeout=datetime.timedelta(seconds=int(os.environ.get("PP_TIMEOUT", "120"))))
    torch._dynamo.config.cache_size_limit = 64
    torch.set_num_threads(1)
    run_scenarios(rank, world, scenarios, result_path, scenario)
