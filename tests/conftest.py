"""Shared test helpers: one intra-op thread, a Dynamo reset around every test, the parity rule
against a float64 reference, tiny Hugging Face Llama, and the boost-train launch helpers.

The parity rule (``assert_parity``): a tested run (compiled, sharded, pipelined, resumed ...)
and eager PyTorch in the same dtype both run the same model, data and steps as a float64
eager run, the truth. On any CPU,

    err(tested, fp64) <= C * err(eager, fp64) + floor        (C and floor per dtype: PARITY)

where err is the largest norm-wise relative error over the tensors of one quantity (the loss,
every parameter's gradient, every parameter) at one step. Rounding differences keep the ratio
err(tested) / err(eager) near 1 on every machine; a bug (a dropped collective, a wrong shard, a
scaled gradient) puts it orders of magnitude above.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# One intra-op thread in this process and every process it starts (they inherit the
# environment): on a shared 2-core machine two OpenMP threads crawl as soon as anything
# else wants a core. Set before torch is imported.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# boost-train's token cache: one throwaway folder per test session (subprocesses inherit it),
# never the user's ~/.cache
os.environ.setdefault("BOOST_COMPILE_CACHE", tempfile.mkdtemp(prefix="boost-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)

TESTS = Path(__file__).resolve().parent
# the worker code that spawned processes run, and the models written in other styles
for _folder in ("workers", "models"):
    if str(TESTS / _folder) not in sys.path:
        sys.path.insert(0, str(TESTS / _folder))

#: The parity rule per dtype of the tested run, (C, floor) in
#: err(tested, fp64) <= C * err(eager, fp64) + floor, and the denominator floor of the
#: relative error: one definition, the package's (``verify`` judges rewrites by it too).
from boost_compile.parity import PARITY, TINY  # noqa: E402


def extended_deselected(config: pytest.Config) -> bool:
    """Whether this run leaves out the tests marked extended (``make test``: ``-m "not extended"``):
    a fixture that spawns scenarios for every test of its file need not run theirs."""
    return "not extended" in (config.getoption("markexpr") or "")


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Every test starts and ends with empty Dynamo caches (no recompile-limit noise)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- parity


def rel_err(value: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error ``||value - ref|| / max(||ref||, TINY)``, computed in fp64."""
    value, ref = value.detach().double(), ref.detach().double()
    return ((value - ref).norm() / ref.norm().clamp_min(TINY)).item()


def max_rel_err(values: Mapping[str, torch.Tensor | None], truth: Mapping[str, torch.Tensor]) -> float:
    """The largest ``rel_err`` over ``truth``'s names (inf where ``values`` lacks one)."""
    errors = [rel_err(values[n], t) if values.get(n) is not None else float("inf") for n, t in truth.items()]
    return max(errors, default=0.0)


def error_pair(tested: Mapping[str, torch.Tensor | None], eager: Mapping[str, torch.Tensor | None],
               truth: Mapping[str, torch.Tensor]) -> list[float]:
    """``[err(tested), err(eager)]`` against ``truth`` for one quantity (dicts of tensors by name)."""
    return [max_rel_err(tested, truth), max_rel_err(eager, truth)]


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient by name (None where it has none)."""
    return {n: p.grad for n, p in model.named_parameters()}


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def step_errors(tested: tuple[torch.Tensor, Mapping[str, Any]], eager: tuple[torch.Tensor, nn.Module],
                truth: tuple[torch.Tensor, nn.Module]) -> dict[str, list[float]]:
    """One step's loss and gradient error pairs: each run as (loss, model), the tested run's
    model may instead be a dict of its (gathered) gradients by name."""
    tested_grads = tested[1] if isinstance(tested[1], Mapping) else grads(tested[1])
    return {
        "loss": error_pair({"loss": tested[0]}, {"loss": eager[0]}, {"loss": truth[0]}),
        "grad": error_pair(tested_grads, grads(eager[1]), grads(truth[1])),
    }


def fp64_copy(model: nn.Module) -> nn.Module:
    """The float64 truth: a copy of ``model`` (its weights as they are, rounded or not) in fp64."""
    import copy

    return copy.deepcopy(model).double()


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32 (a loss on bf16 outputs), never down to fp32 (the fp64 truth's)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _fresh(inputs: Any, fp64: bool) -> tuple[Any, list[torch.Tensor]]:
    """A new copy of ``inputs`` per run (in fp64 for the truth); the leaves that want a gradient."""
    leaves: list[torch.Tensor] = []

    def copy_of(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            y = (x.double() if fp64 else x).detach().clone().requires_grad_(x.requires_grad)
            if x.requires_grad:
                leaves.append(y)
            return y
        if isinstance(x, (tuple, list)):
            return type(x)(copy_of(v) for v in x)
        if isinstance(x, dict):
            return {k: copy_of(v) for k, v in x.items()}
        return x

    return copy_of(inputs), leaves


def check_against_eager(model: nn.Module, compile_fn: Any, run: Any, inputs: Any = (), what: str = "") -> float:
    """The parity rule for one forward and backward of ``compile_fn(copy of model)``.

    ``run(callable, inputs) -> loss`` runs on ``model`` itself (eager, its dtype), on an fp64 copy
    (the truth, with floating ``inputs`` in fp64) and on the compiled copy; the loss, every
    parameter gradient and the gradient of each floating input that requires one are checked.
    Returns the largest ratio err(tested) / err(eager).
    """
    import copy

    dtype = next(model.parameters()).dtype
    truth, tested = fp64_copy(model), copy.deepcopy(model)
    runs = []
    for m, fp64 in ((model, False), (truth, True), (compile_fn(tested), False)):
        x, leaves = _fresh(inputs, fp64)
        loss = run(m, x)
        loss.backward()
        runs.append((loss, leaves))
    (eager_loss, eager_x), (truth_loss, truth_x), (loss, tested_x) = runs
    assert torch.isfinite(eager_loss), eager_loss
    errors = step_errors((loss, tested), (eager_loss, model), (truth_loss, truth))
    if truth_x:
        names = [str(i) for i in range(len(truth_x))]
        errors["input_grad"] = error_pair(*({n: t.grad for n, t in zip(names, xs, strict=True)}
                                            for xs in (tested_x, eager_x, truth_x)))
    return assert_parity(errors, dtype, what)


# ----------------------------------------------------------------------------- trace logger

#: torch's structured-trace logger. ``trace_structured`` builds its payloads (tensor
#: descriptions, graph dumps) whenever this logger has a handler, and pytest attaches its
#: capture handlers to every non-propagating logger as each phase of a test starts: without
#: the wrappers below, every compile of the suite would build a trace nobody reads.
_TRACE_LOGGER = logging.getLogger("torch.__trace")


def _detach_capture_handlers() -> None:
    """Drop from the trace logger the handlers pytest put there (those it also put on root);
    a handler a test installs itself (a captured trace) stays."""
    for handler in list(_TRACE_LOGGER.handlers):
        if handler in logging.getLogger().handlers:
            _TRACE_LOGGER.removeHandler(handler)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_setup(item):
    _detach_capture_handlers()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item):
    _detach_capture_handlers()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    _detach_capture_handlers()
    return (yield)


def pytest_configure(config) -> None:
    """The controller (or a run without workers) makes the folder where every process of the
    run records its parity ratios; pytest-xdist's workers inherit it."""
    if not hasattr(config, "workerinput"):
        os.environ["BOOST_PARITY_DIR"] = tempfile.mkdtemp(prefix="boost-parity-")


def pytest_unconfigure(config) -> None:
    """The controller removes that folder once the summary has been written."""
    folder = os.environ.get("BOOST_PARITY_DIR")
    if folder and not hasattr(config, "workerinput"):
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def _record(what: str, dtype: torch.dtype, ratio: float) -> None:
    import json

    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].rpartition("/")[2]
    row = {"check": f"{test} {what}".strip(), "dtype": str(dtype).removeprefix("torch."), "ratio": ratio}
    folder = Path(os.environ.get("BOOST_PARITY_DIR") or tempfile.gettempdir())
    with open(folder / f"parity-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter) -> None:
    """The largest ratios err(tested) / err(eager) the parity rule measured in this run (every
    one in $BOOST_PARITY_REPORT, when set)."""
    import json

    folder = os.environ.get("BOOST_PARITY_DIR")
    if not folder or hasattr(terminalreporter.config, "workerinput"):
        return
    rows = [json.loads(line) for f in sorted(Path(folder).glob("parity-*.jsonl")) for line in f.read_text().splitlines()]
    if not rows:
        return
    rows.sort(key=lambda r: -r["ratio"])
    terminalreporter.section("parity: largest err(tested) / err(eager) against float64")
    for r in rows[:12]:
        c, _ = PARITY[getattr(torch, r["dtype"])]
        terminalreporter.write_line(f"{r['ratio']:6.2f}  (C = {c:g}, {r['dtype']})  {r['check']}")
    terminalreporter.write_line(f"{len(rows)} checks passed")
    if os.environ.get("BOOST_PARITY_REPORT"):
        Path(os.environ["BOOST_PARITY_REPORT"]).write_text(json.dumps(rows, indent=1))


def check_recorded_compile(model: nn.Module, compile_recorded: Any, loss_fn: Any, inputs: Any = ()) -> Any:
    """``check_against_eager`` for ``compile_recorded(copy) -> (compiled, Recorder)`` with
    ``loss_fn(model(*inputs))``; the one graph the recorder kept (fullgraph: no break)."""
    recorders = []

    def compile_fn(test_model: nn.Module) -> Any:
        compiled, recorder = compile_recorded(test_model)
        recorders.append(recorder)
        return compiled

    check_against_eager(model, compile_fn, lambda m, x: loss_fn(m(*x)), inputs)
    (graph,) = recorders[0].graphs
    return graph


class ParityError(AssertionError):
    """A tested run is further from the float64 truth than the parity rule allows."""


def parity_table(errors: Mapping[str, Any], dtype: torch.dtype = torch.float32) -> list[str]:
    """One line per (quantity, step): both errors, their ratio and the bound."""
    c, floor = PARITY[dtype]
    lines = []
    for quantity, steps in _by_step(errors).items():
        for i, (tested, eager) in enumerate(steps):
            bound = c * eager + floor
            ratio = tested / max(eager, floor / c)
            mark = "ok" if tested <= bound else "FAILS"
            lines.append(f"{quantity}[{i}]: tested {tested:.3e}, eager {eager:.3e}, ratio {ratio:.2f}, "
                         f"bound {bound:.3e} {mark}")
    return lines


def assert_parity(errors: Mapping[str, Any], dtype: torch.dtype | str = torch.float32, what: str = "",
                  record: bool = True) -> float:
    """Check the parity rule for every quantity and step of ``errors``.

    ``errors``: quantity -> ``[err_tested, err_eager]`` or a list of them, one per step
    (``error_pair``, ``step_errors``; the workers return the same as JSON). Returns the largest
    ratio err(tested) / err(eager), eager's error counted as at least floor / C (below that, a
    scalar's rounding is luck); the message of a failure lists every pair. ``record``: list the
    ratio in the run's summary (off for made-up numbers).
    """
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    c, floor = PARITY[dtype]
    steps = _by_step(errors)
    assert steps and all(steps.values()), f"{what}: no errors to check"
    bad = [(q, i) for q, pairs in steps.items() for i, (t, e) in enumerate(pairs) if not t <= c * e + floor]
    if bad:
        table = "\n  ".join(parity_table(errors, dtype))
        raise ParityError(f"{what} differs from the float64 truth by more than {c:g} x eager {dtype} + {floor:.1e} "
                          f"at {bad}:\n  {table}")
    ratios = [t / max(e, floor / c) for pairs in steps.values() for t, e in pairs]
    if record:
        _record(what, dtype, max(ratios))
    return max(ratios)


def _by_step(errors: Mapping[str, Any]) -> dict[str, list[tuple[float, float]]]:
    out = {}
    for quantity, value in errors.items():
        pairs = [value] if value and not isinstance(value[0], (list, tuple)) else value
        out[quantity] = [(float(t), float(e)) for t, e in pairs]
    return out


def assert_same_state(a: torch.nn.Module | dict, b: torch.nn.Module | dict, prefix: str = "") -> None:
    """Bitwise equal parameters (``prefix`` stripped from ``a``'s names)."""
    sa = a if isinstance(a, dict) else dict(a.named_parameters())
    sb = b if isinstance(b, dict) else dict(b.named_parameters())
    sa = {k.removeprefix(prefix): v for k, v in sa.items()}
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


# ----------------------------------------------------------------------------- models


def tiny_hf_llama(attn_implementation: str = "sdpa", seed: int = 0, vocab_size: int = 256) -> nn.Module:
    """A randomly initialised two-layer ``transformers.LlamaForCausalLM`` (nothing downloaded)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def save_hf_folder(folder: Path, tie: bool = False, seed: int = 1) -> list[str]:
    """A pretrained Hugging Face folder as ``save_pretrained`` writes one: hf-tiny's Llama config,
    bf16 safetensors in several shards with their index; the overrides that train from it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(
        folder, max_shard_size="50KB")
    assert (folder / "model.safetensors.index.json").exists()
    return ["model=hf-tiny", "model.hf_config=null", f"model.hf_path={folder}", "model.pretrained=true"]


# ----------------------------------------------------------------------------- boost-train

# small and fast: 4 x 32 tokens, a 200 kB corpus, eager Dynamo capture
FAST = (
    "trainer=quick",
    "trainer.steps=6",
    "trainer.eval_every=0",
    "trainer.eval_batches=2",
    "trainer.save_every=0",
    "trainer.plot=false",
    "trainer.progress=none",
    "trainer.threads=1",  # as under torchrun; two threads crawl on a shared 2-core machine
    "data.max_bytes=200000",
    "passes=eager",
)

#: the starting weights saved too (step_000000), kept beside two later checkpoints
AT_START = ("checkpoint.at_start=true", "checkpoint.keep=3")
#: the tiny preset's tensors: the embedding, 2 blocks of 2 norms and 7 projections of 2 factors each,
#: the final norm and the head
TINY_TENSORS = 1 + 2 * (2 + 7 * 2) + 2

# FAST, 4 steps evaluated at 2 and 4, no checkpoints: a run for the metric writers' tests
METRICS_RUN = (*FAST, "trainer.steps=4", "trainer.eval_every=2", "checkpoint=off")


def cfg_of(*overrides: str):
    """boost-train's composed Hydra config for ``overrides``."""
    from hydra import compose, initialize_config_dir

    from boost_compile.train.config import config_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, overrides: list[str], out: Path, *, restarts: int = 0, env: Mapping[str, str] | None = None,
             output: list[str] | None = None) -> dict:
    """boost-train under torchrun on 127.0.0.1 (gloo, one thread per rank); its summary.json.

    ``restarts``: torchrun's ``--max-restarts``; ``env``: more environment variables;
    ``output``: a list that gets what the command printed (stdout, then stderr).
    """
    import json

    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", str(restarts),
        "--monitor-interval", "0.5",
        "-m", "boost_compile.train", *overrides, f"hydra.run.dir={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if output is not None:
        output[:] = [proc.stdout, proc.stderr]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "summary.json").read_text())


def loss_errors(tested: Sequence[float], eager: Sequence[float], truth: Sequence[float]) -> list[list[float]]:
    """Per-step error pairs of scalar series (boost-train's losses, gradient norms)."""
    assert len(tested) == len(eager) == len(truth) and truth, (len(tested), len(eager), len(truth))
    return [[abs(t - r) / abs(r), abs(e - r) / abs(r)] for t, e, r in zip(tested, eager, truth, strict=True)]


def train_references(overrides: Sequence[str], folder: Path) -> tuple[dict, dict]:
    """One-process eager boost-train runs of ``overrides``: (fp32, fp64), the yardstick and the
    truth of the parity rule for the losses of a run of the same config in another layout."""
    from boost_compile.train import run

    base = (*overrides, "passes=none", "checkpoint.enabled=false")
    return (run(cfg_of(*base), folder / "fp32"),
            run(cfg_of(*base, "trainer.precision=fp64"), folder / "fp64"))


def rng_states(checkpoint: Path) -> dict[int, torch.Tensor]:
    """torch's default generator state each rank saved in a boost-train checkpoint, by rank."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as folder:
        dcp_to_torch_save(checkpoint, Path(folder) / "whole.pt")
        saved = torch.load(Path(folder) / "whole.pt", weights_only=False)
    return {int(key.removeprefix("rank")): state["torch"] for key, state in saved["rng"].items() if key != "layout"}


def grad_norms(summary: dict) -> list[float]:
    """The gradient norm (before clipping) of each step of a boost-train run, from metrics.jsonl."""
    from boost_compile.train.metrics import read_metrics

    return [r["grad_norm"] for r in read_metrics(Path(summary["run_dir"]) / "metrics.jsonl") if "grad_norm" in r]


def assert_train_parity(tested: dict, references: tuple[dict, dict], what: str = "", first: int = 0,
                        dtype: torch.dtype | str = torch.float32) -> float:
    """The parity rule on a boost-train run's per-step losses, gradient norms and val loss.

    ``first``: the step the tested run starts from (a resumed run), within the references';
    ``dtype``: the precision whose rounding the rule allows (bfloat16 for ``bf16-mixed`` runs).
    """
    eager, truth = references
    errors = {"loss": loss_errors(tested["losses"], eager["losses"][first:], truth["losses"][first:])}
    norms = [grad_norms(r) for r in (tested, eager, truth)]
    if all(norms):
        errors["grad_norm"] = loss_errors(norms[0], norms[1][first:], norms[2][first:])
    if truth.get("val_loss") is not None:
        errors["val_loss"] = loss_errors([tested["val_loss"]], [eager["val_loss"]], [truth["val_loss"]])
    return assert_parity(errors, dtype, what=what)


def checkpoint_model(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model state a boost-train checkpoint holds (whole tensors, whatever layout saved it)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as folder:
        dcp_to_torch_save(checkpoint, Path(folder) / "whole.pt")
        return torch.load(Path(folder) / "whole.pt", weights_only=False)["model"]


def assert_starts_like_one_process(run_dir: Path) -> int:
    """The starting weights a run saved (``checkpoint.at_start``: ``step_000000``) equal, bitwise,
    those one process builds from the same config (boost-train's ``build_model``, its cast). Returns
    the number of tensors compared."""
    from boost_compile.export import resolve
    from boost_compile.train.model import build_model, fit_vocab
    from boost_compile.train.parallel import cast_weights
    from boost_compile.train.validate import model_shape

    source = resolve(Path(run_dir) / "checkpoints" / "step_000000")
    tc = source.config
    shape = fit_vocab(model_shape(tc.model, tc.trainer.seq), tc.model, source.tokenizer().vocab_size)
    model = build_model(tc, shape, torch.device("cpu"))
    cast_weights(model, tc.trainer.precision)
    mine, saved = model.state_dict(), checkpoint_model(source.checkpoint)
    assert sorted(saved) == sorted(mine), (sorted(saved), sorted(mine))
    different = [k for k in mine if not torch.equal(saved[k], mine[k])]
    assert not different, f"starting weights differ from one process's: {different[:5]}"
    return len(mine)
