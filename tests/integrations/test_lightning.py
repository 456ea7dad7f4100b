"""Lightning's Trainer and Fabric train a model compiled with backend="boost" as they train it eagerly.

The runs (tests/integrations/lightning_script.py): a tiny CoLA Llama, 6 AdamW steps on fixed
batches, ``logger=False``, ``deterministic=True``, CPU. Each tested run (boost, ``aot_eager``,
float32) follows the suite's parity rule (conftest.assert_parity) on the loss of every step and on
every parameter after the last step, against two eager runs on the same model and batches:

- the yardstick: the same framework eagerly in float32;
- the truth: the Trainer with ``precision="64-true"`` (Lightning's DoublePrecision: the module,
  AdamW's state and the loss in float64). It is the truth of the Fabric runs too: Fabric's
  "64-true" casts what the forward returns to the default dtype, so the loss a Fabric loop sees
  is rounded to float32; the model, the batches and the steps are the same.

On two processes (torchrun, gloo, ``strategy="ddp"``; both frameworks in one launch) each rank
trains on half of every batch; the mean of the ranks' losses and the parameters on rank 0 are
checked against the same one-process references, which see the whole batch per step. There the
gradient buckets are small: Dynamo's DDP optimizer cuts the Trainer's model into one graph per
bucket (boost compiles each piece), and the Fabric run, with ``checkpoint="lowrank"``, shows that
compile_module keeps that mode's model one graph.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ParityError, _free_port, assert_parity, error_pair, loss_errors
from torch import nn

pytest.importorskip("lightning")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import lightning as L  # noqa: E402
import lightning_script as script  # noqa: E402

from boost_compile import _torch_compat as compat  # noqa: E402
from boost_compile.config import ConfigError  # noqa: E402
from boost_compile.integrations.lightning import compile_module  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _torch_flags():
    """``Trainer(deterministic=True)`` switches torch's deterministic algorithms on for the
    process; the other tests of this worker get them back as they were."""
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    """The eager runs: each framework in float32, and the Trainer in float64 (the truth)."""
    runs = {"trainer": script.trainer_run(None), "fabric": script.fabric_run(None),
            "truth": script.trainer_run(None, precision="64-true")}
    assert all(r["graphs"] == 0 for r in runs.values())
    assert all(p.dtype == torch.float64 for p in runs["truth"]["params"].values())
    return runs


def check_run(tested: dict, eager: dict, truth: dict, what: str) -> float:
    """The parity rule on every step's loss and on the parameters after the last step."""
    errors = {"loss": loss_errors(tested["losses"], eager["losses"], truth["losses"]),
              "param": [error_pair(tested["params"], eager["params"], truth["params"])]}
    return assert_parity(errors, what=what)


def test_trainer_parity(references: dict) -> None:
    tested = script.trainer_run(script.OPTIONS)
    assert tested["graphs"] == 1, "the Llama is one graph: no graph break inside the model"
    check_run(tested, references["trainer"], references["truth"], "Trainer, boost")


def test_fabric_parity(references: dict) -> None:
    tested = script.fabric_run(script.OPTIONS)
    assert tested["graphs"] == 1
    check_run(tested, references["fabric"], references["truth"], "Fabric, boost")


def test_fabric_recompiles_a_torch_compile_wrapper(references: dict) -> None:
    """``fabric.setup(torch.compile(model, backend="boost", options=...))`` also works: Fabric takes
    the wrapper off and compiles its own wrapper with the same arguments (lightning imported first)."""
    tested = script.fabric_run(script.OPTIONS, wrapper=True)
    assert tested["graphs"] == 1
    check_run(tested, references["fabric"], references["truth"], "Fabric, torch.compile wrapper, boost")


def test_ddp_parity(references: dict, tmp_path: Path) -> None:
    """Trainer and Fabric with strategy="ddp" on two CPU processes (torchrun, gloo)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(HERE / "lightning_script.py"), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    graphs = {}
    for name in ("trainer", "fabric"):
        tested = json.loads((tmp_path / f"{name}.json").read_text())
        graphs[name] = tested["graphs"]
        tested["params"] = torch.load(tmp_path / f"{name}_params.pt")
        check_run(tested, references[name], references["truth"], f"{name}, DDP on 2 processes, boost")
    assert graphs["trainer"] >= 2, f"the DDP optimizer did not cut the model at its buckets: {graphs}"
    assert graphs["fabric"] == 1, f"checkpoint='lowrank' under DDP should compile uncut: {graphs}"


def test_parity_check_sees_a_wrong_step(references: dict) -> None:
    """The check above fails for a run whose steps are slightly off (a learning rate 1% higher)."""
    wrong = script.trainer_run(None, lr=script.LR * 1.01)
    with pytest.raises(ParityError, match="FAILS"):
        check_run(wrong, references["trainer"], references["truth"], "Trainer, lr off by 1%")


def test_whole_lightning_module_does_not_compile() -> None:
    """Why compile_module compiles the inner model: ``trainer.fit(torch.compile(lightning_module))``
    makes Lightning compile ``training_step``, and Dynamo fails inside ``self.log`` (torch 2.13,
    Lightning 2.6; any backend). When this starts to pass, docs/integrations.md needs updating."""
    compiled = torch.compile(script.LitLlama(), backend="boost", options=script.OPTIONS)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1)
    loader = torch.utils.data.DataLoader(script.dataset(), batch_size=script.GLOBAL_BATCH)
    with pytest.raises(torch._dynamo.exc.InternalTorchDynamoError, match=r"(?s)__dict__.*self\.log"):
        trainer.fit(compiled, loader)


# ----------------------------------------------------------------------------- compile_module


class TwoModels(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 4)
        self.loss_fn = nn.MSELoss()  # no parameters: not a candidate


def test_compiles_the_model_in_place() -> None:
    lit = script.LitLlama()
    keys = list(lit.state_dict())
    assert compile_module(lit, script.OPTIONS) is lit.model
    assert compat.is_compiled_module(lit.model) and not compat.is_compiled_module(lit)
    assert list(lit.state_dict()) == keys  # no _orig_mod. in the checkpoint's keys
    assert compile_module(lit, dict(script.OPTIONS)) is lit.model  # configure_model runs once per stage
    with pytest.raises(ValueError, match="other options"):
        compile_module(lit, {"inner": "eager"})


def test_plain_module_is_compiled_itself() -> None:
    model = nn.Linear(4, 4)
    assert compile_module(model) is model and compat.is_compiled_module(model)


def test_options_are_checked_now() -> None:
    with pytest.raises(ConfigError, match="innr"):
        compile_module(script.LitLlama(), {"innr": "aot_eager"})
    with pytest.raises(ValueError, match=r"factorize_\(model"):
        compile_module(script.LitLlama(), {"factorize": {"rank": 4}})


def test_which_child() -> None:
    with pytest.raises(ValueError, match=r"has 2 \(\['encoder', 'decoder'\]\).*submodule="):
        compile_module(TwoModels())
    lit = TwoModels()
    assert compile_module(lit, submodule="decoder") is lit.decoder
    assert compat.is_compiled_module(lit.decoder) and not compat.is_compiled_module(lit.encoder)
    with pytest.raises(ValueError, match="'head'"):
        compile_module(lit, submodule="head")
    with pytest.raises(ValueError, match="has none"):
        compile_module(L.LightningModule())


def test_refuses_what_is_compiled_already() -> None:
    with pytest.raises(ValueError, match="torch.compile wrapper"):
        compile_module(torch.compile(nn.Linear(4, 4), backend="eager"))
    lit = script.LitLlama()
    lit.model.compile(backend="eager")
    with pytest.raises(ValueError, match="compiled already"):
        compile_module(lit)


def test_refuses_a_tensor_parallel_model() -> None:
    model = nn.Linear(4, 4)
    model._boost_tp_plan = object()  # what parallelize_ leaves on a model it shards
    with pytest.raises(ValueError, match="tensor-parallel"):
        compile_module(model)


def test_without_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError) as info:
        compile_module(nn.Linear(4, 4))
    message = str(info.value)
    assert "pip install 'boost-compile[lightning]'" in message and "\n" not in message
