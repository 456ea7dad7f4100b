"""backend="boost" computes the same loss and gradients as eager PyTorch.

Two identical copies of a model run one forward + backward: one eagerly, one
compiled with ``backend="boost"``. The loss and every parameter gradient are
compared norm-wise, ``||g - g_ref|| / max(||g_ref||, tiny) <= TOLERANCE[dtype]``.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import assert_grads_close, rel_err, tiny_hf_llama

import boost_compile
from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig
from boost_compile.models import Llama, LlamaConfig

#: Norm-wise relative tolerance of the loss and of each gradient, per dtype.
#:   dtype      tolerance
#:   float32    1e-5
#:   bfloat16   2e-2
TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
}

REFERENCE_PRESETS = ("tiny-dense", "tiny-lowrank", "tiny")  # "tiny" is CoLA
BATCH, SEQ, VOCAB = 2, 16, 256

INNERS = [
    pytest.param("aot_eager", id="aot_eager"),
    pytest.param("inductor", id="inductor", marks=pytest.mark.slow),
]


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, targets


def _reference_model(preset: str, dtype: torch.dtype = torch.float32) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset(preset)).to(dtype)


def _check_parity(eager, compiled, loss_fn, dtype: torch.dtype = torch.float32) -> None:
    """Eager loss+backward on ``eager``, ``loss_fn(compiled)`` on the compiled copy, compare."""
    tol = TOLERANCE[dtype]
    ref = loss_fn(eager)
    ref.backward()
    loss = loss_fn(compiled)
    loss.backward()
    assert torch.isfinite(ref), ref
    assert rel_err(loss, ref) <= tol, f"loss {loss.item()} vs eager {ref.item()}"
    assert_grads_close(eager, _unwrap(compiled), tol)


def _unwrap(module):
    """The original module behind a ``torch.compile`` wrapper."""
    return getattr(module, "_orig_mod", module)


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("preset", REFERENCE_PRESETS)
def test_reference_model_parity(preset: str, inner: str) -> None:
    model = _reference_model(preset)
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="boost", options={"inner": inner}, fullgraph=True)
    tokens, targets = _batch()
    _check_parity(model, compiled, lambda m: m(tokens, targets))


@pytest.mark.parametrize(
    ("inner", "attn"),
    [
        pytest.param("aot_eager", "sdpa", id="aot_eager-sdpa"),
        pytest.param("aot_eager", "eager", id="aot_eager-eager_attn"),
        pytest.param("inductor", "sdpa", id="inductor-sdpa", marks=pytest.mark.slow),
    ],
)
def test_hf_llama_parity(inner: str, attn: str) -> None:
    model = tiny_hf_llama(attn_implementation=attn)
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="boost", options={"inner": inner})
    tokens, _ = _batch()
    _check_parity(model, compiled, lambda m: m(input_ids=tokens, labels=tokens).loss)


def test_bf16_cola_parity() -> None:
    dtype = torch.bfloat16
    model = _reference_model("tiny", dtype)
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="boost", options={"inner": "aot_eager"}, fullgraph=True)
    tokens, targets = _batch()
    _check_parity(model, compiled, lambda m: m(tokens, targets), dtype)
    assert all(p.grad.dtype == dtype for p in twin.parameters())


def test_python_api_parity() -> None:
    model = _reference_model("tiny")
    twin = copy.deepcopy(model)
    compiled = boost_compile.compile(twin, {"inner": "aot_eager"}, fullgraph=True)
    tokens, targets = _batch()
    _check_parity(model, compiled, lambda m: m(tokens, targets))


@pytest.mark.parametrize("preset", REFERENCE_PRESETS)
def test_reference_model_is_one_graph(preset: str) -> None:
    """The backend sees each reference model as exactly one graph (no graph break).

    All passes keep their default settings; the inner compiler is aot_eager only to
    keep the test cheap (the graph capture does not depend on it).
    """
    config = BoostConfig.from_options({"inner": "aot_eager"})
    recorder = Recorder(keep_view=False)
    backend = functools.partial(compile_graph, config=config, recorder=recorder)
    model = _reference_model(preset)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    tokens, targets = _batch()
    compiled(tokens, targets).backward()

    assert len(recorder.graphs) == 1, f"expected one graph, the backend got {len(recorder.graphs)}"
    record = recorder.graphs[0]
    assert record.stages and record.stages[0].name == "captured"
    # the default ATen pass (op census) ran on the forward and on the backward graph
    kinds = sorted(r.details["graph"] for r in record.aten_reports if r.name == "op_census")
    assert kinds == ["backward", "forward"], kinds
