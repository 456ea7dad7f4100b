"""One ``transformers.Trainer`` run of a tiny low-rank HF Llama, for tests/integrations/test_hf_trainer.py.

The test imports it for the single-process runs (eager fp32, eager fp64, boost); under torchrun
it is the script of the two-process (DDP, gloo) boost run:

    python -m torch.distributed.run --nproc-per-node 2 hf_trainer_script.py OUT_DIR OPTIONS_JSON

Every run trains the same model (``tiny_hf_llama`` made low-rank by ``factorize_``) for STEPS
AdamW steps on the same GLOBAL_BATCH sequences per step (sequential sampling: step i reads rows
4i..4i+3; on two ranks accelerate gives rank r the per-device batch 2i+r, the same rows).
Rank 0 writes ``OUT_DIR/run.json`` (``train``'s dict: the logged loss and gradient norm of every
step, the graphs the boost backend compiled) and ``OUT_DIR/params.pt`` (the parameters after the
last step).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # run as a script: conftest's helpers
    sys.path.insert(0, str(TESTS))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import tiny_hf_llama  # noqa: E402

STEPS = 6
GLOBAL_BATCH = 4
SEQ = 16
LR = 1e-2


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                   **_: Any) -> torch.Tensor:
    """Llama's causal-LM loss (next-token cross-entropy, summed over the batch's targets and
    divided by their count) in the logits' own dtype. Hugging Face's default casts the logits to
    fp32 first, which would round the float64 truth to fp32."""
    targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    total = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), ignore_index=ignore_index,
                            reduction="sum")
    count = num_items_in_batch if num_items_in_batch is not None else (targets != ignore_index).sum()
    return total / (count.to(total.device) if torch.is_tensor(count) else count)


def build_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny HF Llama, low-rank (every block linear factorized at rank d/4), in ``dtype``;
    in float64 with a loss that stays in float64."""
    import boost_compile as bc

    model = tiny_hf_llama()
    bc.factorize_(model, bc.FactorizeConfig(rank_ratio=0.25))
    model.to(dtype)
    if dtype == torch.float64:
        model.loss_function = causal_lm_loss
    return model


def dataset() -> list[dict[str, torch.Tensor]]:
    """STEPS * GLOBAL_BATCH fixed token sequences (labels = inputs: the model shifts them)."""
    rows = torch.randint(0, 256, (STEPS * GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def training_args(out: Path, world: int = 1, **overrides: Any):
    """The runs' TrainingArguments: STEPS steps of GLOBAL_BATCH sequences over ``world`` processes."""
    import transformers

    settings = dict(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=GLOBAL_BATCH // world,
        learning_rate=LR, optim="adamw_torch", logging_steps=1, report_to=[], use_cpu=True,
        dataloader_num_workers=0, seed=0, save_strategy="no", train_sampling_strategy="sequential",
        disable_tqdm=True,
    )
    return transformers.TrainingArguments(**{**settings, **overrides})


def results(trainer: Any) -> dict[str, list[float]]:
    """The logged loss and gradient norm of every step (logging_steps=1)."""
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == list(range(1, STEPS + 1)), logs
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs]}


@contextlib.contextmanager
def counting_boost_graphs() -> Iterator[list[bool]]:
    """A list that gets an entry for every graph the boost backend compiles through
    ``compile_for_trainer`` (and so ``BoostTrainer``) while the context is open: whether Dynamo's
    DDP optimizer (``optimize_ddp``, graph cuts at DDP's gradient buckets) was on for it."""
    import torch._dynamo.config as dynamo_config

    import boost_compile.integrations.in_place as in_place

    graphs: list[bool] = []
    original = in_place.compile_graph

    def counted(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        graphs.append(bool(dynamo_config.optimize_ddp))
        return original(gm, example_inputs, **kwargs)

    with mock.patch.object(in_place, "compile_graph", counted):
        yield graphs


def train(out: Path, options: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32,
          world: int = 1, callbacks: list | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One run: with ``options`` through ``BoostTrainer`` (backend boost), else the plain eager
    ``transformers.Trainer``. Returns (the losses, gradient norms, the number of graphs the boost
    backend compiled and how many of them with Dynamo's DDP cuts on; the final parameters)."""
    import transformers

    from boost_compile.integrations.hf import BoostTrainer

    model = build_model(dtype)
    kwargs = dict(model=model, args=training_args(out, world), train_dataset=dataset(), callbacks=callbacks)
    with counting_boost_graphs() as graphs:
        trainer = transformers.Trainer(**kwargs) if options is None else BoostTrainer(**kwargs, boost_options=options)
        trainer.train()
    logged = {**results(trainer), "boost_graphs": len(graphs), "ddp_cuts_on": sum(graphs)}
    return logged, {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    import torch.distributed as dist

    out = Path(sys.argv[1])
    options = json.loads(sys.argv[2])
    torch.set_num_threads(1)
    logged, final = train(out, options, world=int(os.environ["WORLD_SIZE"]))
    if dist.get_rank() == 0:
        (out / "run.json").write_text(json.dumps(logged))
        torch.save(final, out / "params.pt")
    dist.barrier()


if __name__ == "__main__":
    from boost_compile.process_exit import exit_without_finalizing

    main()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)
