"""What balances the reference MoE's router (``router_aux_loss_coef``, ``expert_capacity_factor``,
``router_bias_rate``), each per sequence, and the counts boost-train's metrics read:

- the balance loss is ``E * sum_e f_e * P_e`` per sequence, written out here from the router's own
  probabilities (fp64), averaged over sequences and layers; the model's loss keeps the
  cross-entropy's value and its gradient gains ``coef * d aux`` (through the probabilities only);
  backend="boost" follows the parity rule with all three on, and counts as eager does;
- a capacity drops exactly the later assignments of an expert over it (token order, per sequence),
  the output is the formula without them (grouped kernel and loop), and a large one drops nothing
  (bitwise the dropless output);
- the bias changes which experts are chosen, not their weights, and moves as DeepSeek-V3's rule
  from the step's counts; it stays float32 in a bf16 model and is saved in the state dict;
- the configs that cannot work are refused.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import FAST, cfg_of, check_against_eager

from boost_compile.config import ConfigError
from boost_compile.models import Llama, LlamaConfig
from boost_compile.models.moe import MoE, within_capacity
from boost_compile.train.moe_balance import after_step
from boost_compile.train.validate import validate

TOKENS = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
TARGETS = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
BALANCE = {"router_aux_loss_coef": 0.01, "expert_capacity_factor": 1.0, "router_bias_rate": 0.001}


def moe_model(**overrides) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset("tiny-moe", **overrides))


def expert_by_formula(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of ``x`` [d]: down(silu(gate(x)) * up(x)), each matrix two CoLA factors."""
    ex = moe.experts

    def matrix(name: str, v: torch.Tensor) -> torch.Tensor:
        return F.silu(v @ getattr(ex, f"{name}_down")[e]) @ getattr(ex, f"{name}_up")[e]

    return matrix("down", F.silu(matrix("gate", x)) * matrix("up", x))


def aux_by_formula(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per sequence of ``x`` [b, s, d]: E * sum_e f_e P_e, f from the top_k the router chose, P its
    softmax averaged over the sequence's tokens; the mean over sequences."""
    b, s, _ = x.shape
    e, k = moe.num_experts, moe.top_k
    losses = []
    for i in range(b):
        probs = (x[i] @ moe.router.weight.T).softmax(-1)  # [s, E]
        chosen = probs.detach().topk(k, dim=-1).indices
        f = [sum(int(e_ in chosen[t]) for t in range(s)) / (s * k) for e_ in range(e)]
        p = [probs[:, e_].mean() for e_ in range(e)]
        losses.append(e * sum(f[e_] * p[e_] for e_ in range(e)))
    return torch.stack(losses).mean()


def test_aux_loss_is_the_formula_per_sequence():
    moe = moe_model(router_aux_loss_coef=0.5).double().layers[0].mlp
    x = torch.randn(3, 16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    moe(x)
    torch.testing.assert_close(moe.aux_loss, aux_by_formula(moe, x))
    # the counts: 3 sequences' losses summed, and every (token, slot) chosen and kept (dropless)
    assert moe.aux_stats[1] == 3 and moe.routed_tokens.sum(1).tolist() == [96, 96]
    # uniform probabilities and choices: the minimum, 1
    assert aux_by_formula(moe, torch.zeros(1, 4, 64, dtype=torch.float64)).item() == pytest.approx(1.0)


def test_the_model_loss_keeps_its_value_and_gains_the_aux_gradient():
    """fp64: coef * mean over layers of the aux loss enters the gradient; the value is the cross-entropy;
    the last layer's experts, which no balance loss depends on, get the cross-entropy's gradient alone."""
    coef = 0.5
    model = moe_model(router_aux_loss_coef=coef).double()
    plain = moe_model().double()
    plain.load_state_dict(model.state_dict())
    loss = model(TOKENS, TARGETS)
    loss.backward()
    inputs = []
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out: inputs.append((m, args[0]))) for layer in plain.layers]
    ce = plain(TOKENS, TARGETS)
    for h in hooks:
        h.remove()
    assert torch.equal(loss.detach(), ce.detach())
    aux = torch.stack([aux_by_formula(m, x) for m, x in inputs]).mean()
    (ce + coef * aux).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    # without the coefficient the router's gradient differs; the last experts' does not
    last = len(plain.layers) - 1
    plain.zero_grad()
    plain(TOKENS, TARGETS).backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    named = dict(model.named_parameters())
    assert not torch.allclose(named["layers.0.mlp.router.weight"].grad, grads["layers.0.mlp.router.weight"])
    for n in (n for n in grads if n.startswith(f"layers.{last}.mlp.experts.")):
        torch.testing.assert_close(named[n].grad, grads[n], rtol=0, atol=1e-15)


def _routed(moe: MoE, index: torch.Tensor, weights: torch.Tensor) -> None:
    """Make ``moe`` route by hand: ``index`` / ``weights`` [b * s, k] whatever the scores."""
    moe.route = lambda scores: (index, weights)


def test_capacity_drops_the_later_assignments_per_sequence():
    moe = moe_model(expert_capacity_factor=1.0).double().layers[0].mlp
    assert moe.capacity(4) == 2  # ceil(1.0 * 4 tokens * 2 slots / 4 experts)
    # sequence 0: expert 0 chosen by tokens 0, 1, 2 (slot 1) and 3: its third and fourth are dropped;
    # sequence 1: the same choices shifted, expert 0 twice: nothing dropped there
    index = torch.tensor([[0, 1], [0, 2], [3, 0], [0, 1],
                          [1, 0], [2, 3], [3, 0], [1, 2]])
    weights = torch.rand(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    weights = weights / weights.sum(-1, keepdim=True)
    keep = within_capacity(index.view(2, 8), torch.stack([torch.bincount(r, minlength=4) for r in index.view(2, 8)]), 2)
    dropped = [(2, 1), (3, 0)]
    assert [(t, j) for t in range(8) for j in range(2) if not keep.view(8, 2)[t, j]] == dropped
    seen = {}
    moe.experts.register_forward_hook(lambda m, args, out: seen.update(index=args[1], weights=args[2]))
    _routed(moe, index, weights)
    x = torch.randn(2, 4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out = moe(x).view(8, 64)
    assert [(t, j) for t in range(8) for j in range(2) if seen["index"][t, j] == 4] == dropped
    assert all(seen["weights"][t, j] == 0 for t, j in dropped)
    # the kept weights are not renormalised again
    kept = [(t, j) for t in range(8) for j in range(2) if (t, j) not in dropped]
    assert all(seen["weights"][t, j] == weights[t, j] for t, j in kept)
    want = torch.stack([sum((weights[t, j] * expert_by_formula(moe, int(index[t, j]), x.view(8, 64)[t])
                             for j in range(2) if (t, j) in kept), torch.zeros(64, dtype=torch.float64))
                        for t in range(8)])
    torch.testing.assert_close(out, want)
    # the counts: chosen and kept per expert over both sequences
    assert moe.routed_tokens.tolist() == [[6, 4, 3, 3], [4, 4, 3, 3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dropped_rows_add_exactly_nothing_in_both_kernels(dtype):
    """fp32 eager runs the grouped kernel (which leaves the rows past the last offset unwritten),
    fp64 the loop: the output and the input's gradient are those of the kept assignments alone."""
    moe = moe_model(expert_capacity_factor=1.0).to(dtype).layers[0].mlp
    index = torch.tensor([[0, 1], [0, 2], [3, 0], [0, 1]])
    weights = torch.full((4, 2), 0.5, dtype=dtype)
    x = torch.randn(1, 4, 64, dtype=dtype, generator=torch.Generator().manual_seed(5), requires_grad=True)
    _routed(moe, index, weights)
    out = moe(x)
    out.square().sum().backward()
    # the same tokens with the dropped slots sent to no expert at all: weight 0 on a kept expert
    ref = moe_model().to(dtype).layers[0].mlp
    y = x.detach().clone().requires_grad_(True)
    _routed(ref, index, torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.0], [0.0, 0.5]], dtype=dtype))
    want = ref(y)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12)
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in moe.experts.parameters())


def test_a_large_capacity_drops_nothing_bitwise():
    dropless, large = moe_model(), moe_model(expert_capacity_factor=4.0)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(6))
    assert torch.equal(dropless.layers[0].mlp(x), large.layers[0].mlp(x))
    assert torch.equal(dropless(TOKENS, TARGETS), large(TOKENS, TARGETS))
    assert large.layers[0].mlp.routed_tokens[0].tolist() == large.layers[0].mlp.routed_tokens[1].tolist()


def test_the_bias_chooses_the_experts_not_their_weights():
    moe = moe_model(router_bias_rate=0.001).layers[0].mlp
    x = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(7))
    seen = {}
    moe.experts.register_forward_hook(lambda m, args, out: seen.update(index=args[1], weights=args[2]))
    with torch.no_grad():
        scores = moe.router(x.reshape(8, 64)).softmax(-1)
        moe(x)
        assert torch.equal(seen["index"], scores.topk(2, dim=-1).indices)  # a zero bias changes nothing
        moe.router_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))  # expert 3 on every token
        moe(x)
    assert (seen["index"] == 3).any(-1).all()
    assert torch.equal(seen["index"], (scores + moe.router_bias).topk(2, dim=-1).indices)
    chosen = scores.gather(-1, seen["index"])
    torch.testing.assert_close(seen["weights"], chosen / chosen.sum(-1, keepdim=True))


def test_the_bias_moves_by_the_rule_from_the_step_counts():
    model = moe_model(router_bias_rate=0.001)
    moe = model.layers[0].mlp
    moe.update_bias(torch.tensor([10, 2, 6, 6]))  # mean 6
    assert moe.router_bias.tolist() == pytest.approx([-0.001, 0.001, 0.0, 0.0])
    moe.router_bias.zero_()
    model(TOKENS, TARGETS).backward()
    chosen = [m.routed_tokens[0].clone() for m in (layer.mlp for layer in model.layers)]
    with torch.no_grad():
        model.eval()
        model(TOKENS, TARGETS)  # evaluation does not count
        model.train()
        model(TOKENS)  # nor a no-grad forward
    row = after_step(model)
    for layer, load in zip(model.layers, chosen, strict=True):
        want = 0.001 * torch.sign(load.double().mean() - load.double())
        torch.testing.assert_close(layer.mlp.router_bias, want.float())
        assert layer.mlp.routed_tokens.sum() == 0 and layer.mlp.aux_stats.sum() == 0  # reset
    assert row["experts_tokens"] == [c.tolist() for c in chosen]
    assert 1.0 <= row["experts_max_over_mean"] <= 2.0 and 0.5 < row["moe_aux_loss"] < 4.0
    assert "moe_dropped" not in row  # dropless


def test_the_bias_is_saved_and_stays_float32():
    model = moe_model(router_bias_rate=0.001)
    assert "layers.0.mlp.router_bias" in model.state_dict()
    assert not any("router_bias" in k for k in moe_model().state_dict())  # off: the state dict as before
    assert not any("routed_tokens" in k or "aux_stats" in k for k in model.state_dict())  # counts: not saved
    model.layers[0].mlp.router_bias.fill_(0.001)
    model.to(torch.bfloat16)
    assert model.layers[0].mlp.router_bias.dtype == torch.float32
    assert model.layers[0].mlp.router_bias[0].item() == pytest.approx(0.001, rel=1e-6)
    assert model.double().layers[0].mlp.router_bias.dtype == torch.float64


def _counts(model: Llama) -> list[list[list[int]]]:
    return [layer.mlp.routed_tokens.tolist() for layer in model.layers]


def test_backend_boost_follows_the_parity_rule_and_counts_with_balance_on():
    """The three together (the bias set to small values that change some choices), one graph through
    the boost passes (aot_eager inside), against eager and fp64; the compiled model counts its
    routing as eager does."""
    from boost_compile.backend import boost_backend

    model = moe_model(n_layers=1, **BALANCE)
    model.layers[0].mlp.router_bias.copy_(torch.tensor([0.02, -0.01, 0.0, 0.01]))
    graphs = []

    def compile_fn(m):
        graphs.append(m)
        return torch.compile(m, backend=lambda gm, inputs: boost_backend(gm, inputs, {"inner": "aot_eager"}),
                             fullgraph=True)

    check_against_eager(model, compile_fn, lambda m, _: m(TOKENS, TARGETS), what="tiny-moe balanced fp32")
    assert _counts(graphs[0]) == _counts(model) and graphs[0].layers[0].mlp.aux_stats[1] == 3
    assert 0 < model.layers[0].mlp.routed_tokens[1].sum() < model.layers[0].mlp.routed_tokens[0].sum()  # drops


def test_blocks_compiled_one_by_one_count_and_carry_the_aux_gradient():
    from boost_compile.blocks import compile_blocks

    eager, compiled = moe_model(**BALANCE), moe_model(**BALANCE)
    compile_blocks(compiled, {"inner": "aot_eager"}, fullgraph=True)
    for m in (eager, compiled):
        m(TOKENS, TARGETS).backward()
    assert _counts(compiled) == _counts(eager)
    router = "layers.0.mlp.router.weight"
    torch.testing.assert_close(dict(compiled.named_parameters())[router].grad, dict(eager.named_parameters())[router].grad)


@pytest.mark.parametrize(("overrides", "words"), [
    ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef must be a finite number >= 0"),
    ({"router_aux_loss_coef": math.nan}, "router_aux_loss_coef must be a finite number"),
    ({"router_bias_rate": -1e-3}, "router_bias_rate must be a finite number >= 0"),
    ({"expert_capacity_factor": 0.0}, "expert_capacity_factor must be a number > 0"),
    ({"expert_capacity_factor": "1"}, "expert_capacity_factor must be a number > 0"),
    ({"n_experts": 0, "router_bias_rate": 1e-3}, "balance a mixture of experts' router; set n_experts > 0"),
])
def test_balance_configs_that_cannot_work_are_refused(overrides, words):
    with pytest.raises(ValueError, match=words):
        LlamaConfig.preset("tiny-moe", **overrides)


def test_the_aux_loss_is_refused_with_pipeline_stages():
    with pytest.raises(ConfigError, match="only the last stage computes"):
        validate(cfg_of(*FAST, "model=tiny-moe", "+model.overrides.router_aux_loss_coef=0.01", "parallel.pp=2"),
                 world_size=2)
    validate(cfg_of(*FAST, "model=tiny-moe", "+model.overrides.router_bias_rate=0.001",
                    "+model.overrides.expert_capacity_factor=1.25", "parallel.pp=2"), world_size=2)
