"""Lightning Trainer and Fabric runs of a tiny CoLA Llama, for tests/integrations/test_lightning.py.

The test imports it for the single-process runs (eager fp32, eager fp64 with precision="64-true",
boost); under torchrun it is the script of the two-process (DDP, gloo) boost runs:

    python -m torch.distributed.run --nproc-per-node 2 lightning_script.py OUT_DIR

Every run trains the same model (a tiny CoLA ``Llama``, CONFIG, seed 0) for STEPS AdamW
steps on the same GLOBAL_BATCH sequences per step. The loaders read the rows in order; on two
ranks a DistributedSampler without shuffling gives rank r rows r, r+2, ..., so step i reads rows
4i..4i+3 on both layouts, two per rank, and the mean of the two ranks' losses is the loss of the
whole batch. (Fabric's own sampler shuffles only a shuffling loader; the Trainer's always shuffles
a training loader, so the Trainer gets ``use_distributed_sampler=False`` and the sampler here.)

Under torchrun both frameworks run with small gradient buckets (BUCKET_MB: the model fills
several), so Dynamo's DDP optimizer cuts the Trainer's model into several graphs, one per bucket,
while the Fabric run, with ``checkpoint="lowrank"`` (DDP_OPTIONS), stays one graph: compile_module
turns the cut off for that mode. Rank 0 writes ``OUT_DIR/{trainer,fabric}.json`` (the loss of every step, the mean
over ranks; the graphs the boost backend compiled on rank 0) and ``OUT_DIR/{trainer,fabric}_params.pt``
(the parameters after the last step).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from boost_compile import backend
from boost_compile.integrations import in_place
from boost_compile.integrations.lightning import compile_module
from boost_compile.models import Llama, LlamaConfig

STEPS = 6
GLOBAL_BATCH = 4
SEQ = 16
LR = 3e-3
#: the boost options of the tested runs (aot_eager: the passes run, no Inductor compile)
OPTIONS = {"inner": "aot_eager"}
#: the options of each framework's run on two processes
DDP_OPTIONS = {"trainer": OPTIONS, "fabric": {**OPTIONS, "checkpoint": "lowrank"}}
#: the model: the tiny CoLA preset with a vocabulary large enough for the embedding and the head
#: to fill a gradient bucket each (2.2 MB of parameters)
CONFIG = LlamaConfig.preset("tiny", vocab_size=4096)
#: DDP's gradient bucket size on two processes, in MB: the smallest Dynamo's DDP optimizer
#: accepts (DDP's first bucket holds 1 MiB), three buckets for the model
BUCKET_MB = 1.0


def dataset() -> TensorDataset:
    """STEPS * GLOBAL_BATCH fixed sequences ``start + stride * k (mod 256)`` (learnable: the loss
    falls within the six steps), as (tokens, next tokens)."""
    gen = torch.Generator().manual_seed(1)
    n = STEPS * GLOBAL_BATCH
    start = torch.randint(0, 256, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    rows = (start + stride * torch.arange(SEQ + 1)) % 256
    return TensorDataset(rows[:, :-1], rows[:, 1:])


def build_model() -> Llama:
    torch.manual_seed(0)
    return Llama(CONFIG)


class LitLlama(L.LightningModule):
    """The model as a LightningModule; ``options`` not None: compiled with boost in ``configure_model``."""

    def __init__(self, options: dict[str, Any] | None = None, lr: float = LR) -> None:
        super().__init__()
        self.model = build_model()
        self.options = options
        self.lr = lr
        self.losses: list[torch.Tensor] = []
        self.gathered: torch.Tensor | None = None

    def configure_model(self) -> None:
        if self.options is not None:
            compile_module(self, self.options)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = self.model(tokens, targets)
        self.log("train_loss", loss)
        self.losses.append(loss.detach())
        return loss

    def on_train_end(self) -> None:
        # [world, steps] on several ranks, [steps] on one
        self.gathered = self.all_gather(torch.stack(self.losses))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def _result(gathered: torch.Tensor, model: torch.nn.Module, graphs: list[int]) -> dict[str, Any]:
    losses = gathered.mean(0) if gathered.dim() == 2 else gathered
    return {"losses": losses.tolist(), "graphs": len(graphs),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@contextmanager
def counting_graphs() -> Iterator[list[int]]:
    """A list that gets one entry per graph the boost backend compiles while inside: through
    compile_module (integrations.in_place) or the registered "boost" backend (a torch.compile wrapper)."""
    seen: list[int] = []
    originals = [(module, module.compile_graph) for module in (in_place, backend)]

    def counting(original: Any) -> Any:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            seen.append(1)
            return original(*args, **kwargs)

        return counted

    for module, original in originals:
        module.compile_graph = counting(original)
    try:
        yield seen
    finally:
        for module, original in originals:
            module.compile_graph = original


def trainer_run(options: dict[str, Any] | None, precision: str = "32-true", world: int = 1,
                lr: float = LR) -> dict[str, Any]:
    """STEPS steps of ``lightning.Trainer``: the losses, the graphs boost compiled, the final parameters."""
    module = LitLlama(options, lr)
    data, parallel, sampler = dataset(), {"devices": 1}, None
    if world > 1:  # under torchrun: the Trainer finds the ranks in its environment
        parallel = {"devices": world, "num_nodes": 1, "strategy": DDPStrategy(bucket_cap_mb=BUCKET_MB),
                    "use_distributed_sampler": False}
        sampler = DistributedSampler(data, num_replicas=world, rank=int(os.environ["RANK"]), shuffle=False)
    trainer = L.Trainer(max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True, accelerator="cpu", precision=precision,
                        **parallel)
    with counting_graphs() as graphs:
        trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler))
    return _result(module.gathered, module.model, graphs)


def fabric_run(options: dict[str, Any] | None, precision: str = "32-true", world: int = 1,
               wrapper: bool = False) -> dict[str, Any]:
    """STEPS steps of a ``lightning.Fabric`` loop: the losses, the graphs boost compiled, the final parameters.

    ``wrapper``: hand ``fabric.setup`` ``torch.compile(model, backend="boost", options=options)``
    (Fabric compiles again around its own wrapper) instead of the model compiled by compile_module.
    """
    strategy = FabricDDPStrategy(bucket_cap_mb=BUCKET_MB) if world > 1 else "auto"
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision=precision)
    fabric.launch()
    losses = []
    with counting_graphs() as graphs:
        model = build_model()
        given = model
        if wrapper:
            given = torch.compile(model, backend="boost", options=options)
        elif options is not None:
            compile_module(model, options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        wrapped, optimizer = fabric.setup(given, optimizer)
        loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=GLOBAL_BATCH // world))
        for tokens, targets in loader:
            loss = wrapped(tokens, targets)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return _result(fabric.all_gather(torch.stack(losses)), model, graphs)


def main(out: Path) -> None:
    world = int(os.environ["WORLD_SIZE"])
    for name, run in (("trainer", trainer_run), ("fabric", fabric_run)):
        result = run(DDP_OPTIONS[name], world=world)
        if int(os.environ["RANK"]) == 0:
            torch.save(result.pop("params"), out / f"{name}_params.pt")
            (out / f"{name}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from boost_compile.process_exit import exit_without_finalizing

    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)
