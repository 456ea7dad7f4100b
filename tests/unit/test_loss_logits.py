"""The loss of a model compiled block by block, compiled too (boost_compile/loss_logits.py).

Which ops keep the :class:`LossLogits` wrapper and which see the plain tensor (the same values
either way); ``F.cross_entropy`` handed to the compiled loss with all its arguments; the output
head found on the reference, Hugging Face and style models (none where there is none or two);
``compile_blocks`` hooking the head only when the blocks' code ends in Inductor. On every style
model the hooked step follows the parity rule, and the loss is routed exactly where the logits
reach ``F.cross_entropy`` through ops that keep the vocabulary dim (modded-nanogpt caps them with
a sigmoid first: eager). The Inductor-compiled loss itself runs under the parity rule in
test_compile_blocks.test_inductor_parity_per_block.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import check_against_eager, tiny_hf_llama
from style_models import STYLES
from torch import nn

import boost_compile.loss_logits as loss_logits
from boost_compile import compile_blocks
from boost_compile.blocks import _compile_head_loss, find_blocks, find_head
from boost_compile.loss_logits import LossLogits
from boost_compile.models import Llama, LlamaConfig


class Spy:
    """A stand-in for the compiled loss: eager ``F.cross_entropy``, its calls recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return F.cross_entropy(*args, **kwargs)


def _logits() -> torch.Tensor:
    return torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0)).requires_grad_()


KEPT = {
    "float": lambda t: t.float(), "detach": lambda t: t.detach(), "contiguous": lambda t: t.contiguous(),
    "to_dtype": lambda t: t.to(torch.float64), "flatten_01": lambda t: t.flatten(0, 1),
    "view_vocab": lambda t: t.view(-1, 7), "reshape": lambda t: t.reshape(10, 7),
    "shift": lambda t: t[:, :-1, :], "ellipsis": lambda t: t[..., :], "row": lambda t: t[0],
}
PLAIN = {
    "softmax": lambda t: t.softmax(-1), "scale": lambda t: t * 2, "vocab_slice": lambda t: t[..., :3],
    "view_across": lambda t: t.view(2, 35), "flatten_all": lambda t: t.flatten(), "cat": lambda t: torch.cat([t, t]),
    "sigmoid_cap": lambda t: 30 * torch.sigmoid(t / 30), "index_tensor": lambda t: t[:, torch.tensor([0, 2])],
}


@pytest.mark.parametrize("op", sorted(KEPT) + sorted(PLAIN))
def test_ops_keep_the_wrapper_only_when_they_keep_the_vocabulary_dim(op: str) -> None:
    x = _logits()
    fn = KEPT.get(op) or PLAIN[op]
    got = fn(LossLogits.wrap(x, Spy()))
    assert type(got) is (LossLogits if op in KEPT else torch.Tensor), type(got)
    assert torch.equal(got.as_subclass(torch.Tensor), fn(x))


def test_cross_entropy_goes_to_the_compiled_loss_with_its_arguments() -> None:
    x, spy = _logits(), Spy()
    y = torch.tensor([0, 3, 6, 1, 2, 5, 4, 3, 3, 0])
    kwargs = {"ignore_index": 3, "reduction": "sum", "label_smoothing": 0.1}
    got = F.cross_entropy(LossLogits.wrap(x, spy).flatten(0, 1), y, **kwargs)
    ((args, seen),) = spy.calls
    assert type(args[0]) is torch.Tensor and args[1] is y
    assert {k: seen[k] for k in kwargs} == kwargs
    got.backward()
    grad, x.grad = x.grad, None
    want = F.cross_entropy(x.flatten(0, 1), y, **kwargs)
    want.backward()
    assert type(got) is torch.Tensor and torch.equal(got, want) and torch.equal(grad, x.grad)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.lm_head, self.aux_head = nn.Linear(8, 16), nn.Linear(8, 16)


class RawHead(TwoHeads):
    """The head a raw parameter (``h @ W``), no module"""

    def __init__(self) -> None:
        super().__init__()
        del self.lm_head, self.aux_head
        self.head = nn.Parameter(torch.zeros(8, 16))


@pytest.mark.parametrize("build,head", [
    (lambda: Llama(LlamaConfig.preset("tiny")), "output"),
    (lambda: tiny_hf_llama(), "lm_head"),
    (lambda: STYLES["nanogpt-fused-lowrank"]()[0], "lm_head"),  # tied to the embedding
    (lambda: STYLES["meta-llama-lowrank"]()[0], "output"),
    (TwoHeads, None),
    (RawHead, None),
])
def test_the_output_head_is_found_or_none(build, head) -> None:
    model = build()
    assert find_head(model, find_blocks(model)) == head


def test_compile_blocks_hooks_the_head_only_for_inductor() -> None:
    """The hook is installed at compile_blocks (nothing compiles before the first call)."""
    for options, hooked in (({"inner": "aot_eager"}, False), ({"inner": "inductor"}, True), (None, True)):
        model = Llama(LlamaConfig.preset("tiny"))
        compile_blocks(model, options)
        out = model.output(torch.zeros(1, model.config.dim))
        assert (type(out) is LossLogits) is hooked, (options, type(out))
    model = Llama(LlamaConfig.preset("tiny"))
    compile_blocks(model, backend="inductor")
    compile_blocks(model, backend="inductor")  # again: one hook
    assert type(model.output(torch.zeros(1, model.config.dim))) is LossLogits
    assert len(model.output._forward_hooks) == 1


#: a sigmoid cap between the head and the loss: the logits reach F.cross_entropy plain
EAGER_LOSS = {"modded-dense", "modded-lowrank", "modded-layernorm-lowrank"}


@pytest.mark.parametrize("name", sorted(STYLES))
def test_style_models_route_their_loss_and_keep_parity(name: str) -> None:
    model, loss_fn = STYLES[name]()
    spy = Spy()

    def hooked(m):
        with mock.patch.object(loss_logits, "compiled_cross_entropy", lambda: spy):
            _compile_head_loss(m, find_blocks(m))
        return m

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    check_against_eager(model, hooked, lambda m, _: loss_fn(m, tokens), what=f"{name}, the hooked loss")
    assert len(spy.calls) == (0 if name in EAGER_LOSS else 1), len(spy.calls)


def test_a_loss_the_user_compiles_takes_the_logits() -> None:
    """The hooked logits passed to the user's own ``torch.compile``d loss: Dynamo traces through the
    wrapper (the cross-entropy still routed to the compiled loss) and the numbers follow the rule."""
    spy = Spy()

    def hooked(m):
        with mock.patch.object(loss_logits, "compiled_cross_entropy", lambda: spy):
            _compile_head_loss(m, find_blocks(m))
        return m

    @torch.compile(backend="aot_eager")
    def user_loss(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 0.01 * logits.float().pow(2).mean()

    gen = torch.Generator().manual_seed(2)
    tokens, targets = torch.randint(0, 256, (2, 2, 16), generator=gen)
    model = Llama(LlamaConfig.preset("tiny"))
    check_against_eager(model, hooked, lambda m, _: user_loss(m(tokens), targets), what="a compiled user loss")
    assert len(spy.calls) == 1
