"""boost in Hugging Face's Trainer and in accelerate (boost_compile.integrations.hf).

The parity rule (conftest.assert_parity) on whole Trainer runs: a tested run (BoostTrainer, one
process or DDP over two) and the eager ``transformers.Trainer`` in fp32 against the same Trainer
in float64, the truth, all on the same model, data and AdamW steps (hf_trainer_script.py). Each
run gives per step the loss and gradient norm the Trainer logs (logging_steps=1) and, after the
last step, its parameters. The truth is a real Trainer run in float64: the model cast to fp64 with
a loss that stays in fp64 (hf_trainer_script.causal_lm_loss; Hugging Face's own casts the logits
to fp32). Its logged loss still passes through the Trainer's fp32 accumulator, which rounds it
to fp32: a relative 6e-8, well below the rule's fp32 floor (8 eps = 9.5e-7); its gradient norms
and parameters stay fp64. The two-process run is compared with the one-process references: the
same rows make each step's global batch.

accelerate without the Trainer: the same model and batches in a plain AdamW loop, through
``accelerator.prepare`` (tested) and without accelerate in fp32 and float64 (the references).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import hf_trainer_script as script  # noqa: E402
from conftest import _free_port, assert_parity, error_pair, loss_errors  # noqa: E402

from boost_compile.config import ConfigError  # noqa: E402
from boost_compile.integrations.hf import BoostTrainer, check_training_args, compile_for_trainer  # noqa: E402

AOT = {"inner": "aot_eager"}


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps its process state in class attributes: every test starts from none."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The eager Trainer in fp32 (the yardstick) and in float64 (the truth), each with the bytes
    autograd saved for backward over its steps."""
    out = tmp_path_factory.mktemp("hf_refs")
    runs = []
    for dtype in (torch.float32, torch.float64):
        saved = SavedBytes()
        runs.append((*script.train(out / str(dtype), dtype=dtype, callbacks=[saved]), saved.total))
    return runs


class SavedBytes(transformers.TrainerCallback):
    """Counts the bytes of the tensors autograd saves for backward during the Trainer's steps."""

    def __init__(self) -> None:
        self.total = 0
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.total += t.numel() * t.element_size()
        return t

    def on_step_begin(self, args, state, control, **kwargs):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self._hooks.__exit__(None, None, None)


def assert_trainer_parity(tested: tuple, references: list, what: str) -> float:
    """The parity rule on a run's logged losses and gradient norms and on its final parameters."""
    (logged, final), ((eager, eager_final, _), (truth, truth_final, _)) = tested, references
    errors = {
        "loss": loss_errors(logged["losses"], eager["losses"], truth["losses"]),
        "grad_norm": loss_errors(logged["grad_norms"], eager["grad_norms"], truth["grad_norms"]),
        "params": error_pair(final, eager_final, truth_final),
    }
    return assert_parity(errors, what=what)


# ----------------------------------------------------------------------------- the Trainer


def test_boost_trainer_matches_eager(references, tmp_path):
    """BoostTrainer on the factorize_d Llama: the backend compiled the model's graph (the eager
    references compiled none) and the low-rank parameters kept their names (in-place compile)."""
    logged, final = tested = script.train(tmp_path, AOT)
    assert logged["boost_graphs"] >= 1 and references[0][0]["boost_graphs"] == 0
    assert logged["ddp_cuts_on"] == logged["boost_graphs"]  # Dynamo's default; lowrank turns it off
    assert sum(name.endswith(".down.weight") for name in final) == 14 and final.keys() == references[0][1].keys()
    assert_trainer_parity(tested, references, "BoostTrainer aot_eager")


def test_lowrank_checkpointing_through_the_trainer(references, tmp_path):
    """options={"checkpoint": "lowrank"} reaches the backend: the run matches eager, its steps
    save fewer bytes for backward than eager's (which keeps every activation), and its graph
    compiled with Dynamo's DDP cuts off (under DDP they would split the blocks it must see)."""
    saved = SavedBytes()
    tested = script.train(tmp_path, {**AOT, "checkpoint": "lowrank"}, callbacks=[saved])
    assert tested[0]["boost_graphs"] >= 1 and tested[0]["ddp_cuts_on"] == 0
    assert_trainer_parity(tested, references, "BoostTrainer checkpoint=lowrank")
    eager_saved = references[0][2]
    assert 0 < saved.total < 0.5 * eager_saved, (saved.total, eager_saved)


def test_ddp_two_processes_match_single_process_eager(references, tmp_path):
    """BoostTrainer with checkpoint="lowrank" under torchrun, 2 CPU processes (the Trainer's DDP
    over gloo, 2 sequences each per step), against the one-process eager references (4 sequences
    per step: the same rows); the model is one graph (no cut at DDP's buckets)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(Path(script.__file__)), str(tmp_path), json.dumps({**AOT, "checkpoint": "lowrank"})]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    logged = json.loads((tmp_path / "run.json").read_text())
    final = torch.load(tmp_path / "params.pt")
    assert logged["boost_graphs"] == 1 and logged["ddp_cuts_on"] == 0
    assert_trainer_parity((logged, final), references, "BoostTrainer DDP2 checkpoint=lowrank")


# ----------------------------------------------------------------------------- the one-line refusals


def test_torch_compile_backend_boost_gets_one_line_message(tmp_path):
    args = script.training_args(tmp_path, torch_compile=True, torch_compile_backend="boost")
    # where the enum error comes from: accelerate's TorchDynamoPlugin, built by Trainer.__init__
    with pytest.raises(ValueError, match="'BOOST' is not a valid DynamoBackend"):
        transformers.Trainer(model=script.build_model(), args=args)
    model = script.build_model()
    with pytest.raises(ValueError) as info:
        BoostTrainer(model=model, args=args, boost_options=AOT)
    message = str(info.value)
    assert "\n" not in message and "compile_for_trainer(model, options)" in message, message
    assert "torch_compile_backend='boost'" in message
    assert model._compiled_call_impl is None  # refused before anything was built


def test_accelerate_env_backend_gets_one_line_message(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "boost")
    with pytest.raises(ValueError, match="'BOOST' is not a valid DynamoBackend"):
        accelerate.Accelerator(cpu=True)
    with pytest.raises(ValueError, match="^ACCELERATE_DYNAMO_BACKEND=boost .*compile_for_trainer") as info:
        BoostTrainer(model=script.build_model(), args=script.training_args(tmp_path))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="^ACCELERATE_DYNAMO_BACKEND=boost"):
        check_training_args(None)  # for Accelerator() without a Trainer
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "no")
    check_training_args(None)


class TwoLayers(torch.nn.Module):
    """A model whose forward is user code (Dynamo does not start a frame inside torch.nn)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_a_second_compile_is_refused(tmp_path, monkeypatch):
    """torch_compile with any backend is refused: accelerate would put a second torch.compile
    around the model compiled in place, and that outer compile gets no graph (boost's compile of
    the forward takes it), so it only misleads about which compiler runs."""
    outer_graphs = []

    def outer(gm, example_inputs):
        outer_graphs.append(gm)
        return gm.forward

    with script.counting_boost_graphs() as graphs:
        model = compile_for_trainer(TwoLayers(), AOT)
        torch.compile(model, backend=outer)(torch.randn(2, 8)).sum().backward()
    assert len(graphs) == 1 and outer_graphs == []
    with pytest.raises(ValueError, match=r"^TrainingArguments\(torch_compile_backend='inductor'\) .*options=\{'inner'") as info:
        BoostTrainer(model=script.build_model(), args=script.training_args(tmp_path, torch_compile=True))
    assert "\n" not in str(info.value)
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")
    with pytest.raises(ValueError, match="^ACCELERATE_DYNAMO_BACKEND=inductor .*second torch.compile.*unset it"):
        check_training_args(None)


def test_refusals_name_what_to_do(tmp_path):
    args = script.training_args(tmp_path)
    with pytest.raises(ConfigError, match="inner='nope'"):
        BoostTrainer(model=script.build_model(), args=args, boost_options={"inner": "nope"})
    with pytest.raises(ValueError, match="^BoostTrainer compiles model=.*compile_for_trainer"):
        BoostTrainer(args=args, model_init=script.build_model)
    sharded = script.build_model()
    sharded._boost_tp_plan = "btp"  # what parallelize_ marks a tensor-parallel model with
    with pytest.raises(ValueError, match="^BoostTrainer cannot train a tensor-parallel model .*boost-train$"):
        BoostTrainer(model=sharded, args=args)


# ----------------------------------------------------------------------------- accelerate, no Trainer


def loop(model: torch.nn.Module, accelerator=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS AdamW steps on the script's batches, through ``accelerator.prepare`` when given;
    the loss of every step and the final parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=script.LR)
    loader = torch.utils.data.DataLoader(script.dataset(), batch_size=script.GLOBAL_BATCH)
    if accelerator is not None:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss) if accelerator is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_accelerate_prepare_of_a_boost_model_matches_eager():
    """compile_for_trainer, then accelerator.prepare(model, optimizer, loader) and a plain loop,
    against the same loop in eager fp32 and in float64 without accelerate."""
    with script.counting_boost_graphs() as graphs:
        tested = loop(compile_for_trainer(script.build_model(), AOT), accelerate.Accelerator(cpu=True))
    assert len(graphs) >= 1
    eager, truth = loop(script.build_model()), loop(script.build_model(torch.float64))
    assert_parity({"loss": loss_errors(tested[0], eager[0], truth[0]),
                   "params": error_pair(tested[1], eager[1], truth[1])}, what="accelerate prepare")


def test_without_transformers_the_import_names_the_extra(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "boost_compile.integrations.hf", raising=False)
    with pytest.raises(ImportError) as info:
        importlib.import_module("boost_compile.integrations.hf")
    message = str(info.value)
    assert "pip install 'boost-compile[hf]'" in message and "\n" not in message
