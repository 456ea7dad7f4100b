"""Activation checkpointing (passes/activation_checkpoint.py, checkpoint_partitioner.py, saved_tensors.py): \
parity, what is saved, collectives, reports.

Parity: with each mode (and with "none"), the loss and every parameter gradient follow the
suite's parity rule against the model's eager and float64 runs (conftest.assert_parity). Most cases
run with aot_eager (seconds); Inductor runs the three modes on one layer of the
tiny CoLA model (marked slow like the suite's other Inductor compiles).

What is saved is read from the partitioned graphs: the backward graph's inputs
other than the tangents are the saved values (``saved_tensors_report``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_parity as assert_parity_rule
from conftest import fp64_copy, step_errors, tiny_hf_llama, upcast
from torch.utils.checkpoint import CheckpointPolicy

import boost_compile as bc
from boost_compile.backend import GraphRecord, Recorder, compile_graph
from boost_compile.config import BoostConfig, ConfigError
from boost_compile.models import Llama, LlamaConfig
from boost_compile.pass_manager import PassReport
from boost_compile.passes import GRAPH_PASSES
from boost_compile.passes.activation_checkpoint import CheckpointPass
from boost_compile.passes.checkpoint_partitioner import CheckpointPartitioner, checkpoint_partitioner
from boost_compile.passes.saved_tensors import activation_bytes

BATCH, SEQ = 2, 16
MODELS = ("tiny", "tiny-lowrank", "tiny-dense", "hf")
MODES = ("lowrank", "full", "budget")
#: a saved value of these kinds holds no activation memory of its own (or a few KB)
NOT_ACTIVATIONS = ("input", "weight", "symint")


# ----------------------------------------------------------------------------- harness


def build(name: str) -> nn.Module:
    if name == "hf":
        return tiny_hf_llama()
    torch.manual_seed(0)
    if name == "tiny-1":  # one layer of tiny CoLA: the Inductor cases (compile time)
        return Llama(LlamaConfig.preset("tiny", n_layers=1))
    return Llama(LlamaConfig.preset(name))


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def loss_of(name: str, model: nn.Module, t: torch.Tensor) -> torch.Tensor:
    if name == "hf":
        return upcast(model(t).logits).logsumexp(-1).mean()
    return model(t, t)


@dataclass
class Run:
    loss: torch.Tensor
    model: nn.Module
    graph: GraphRecord

    @property
    def saved(self) -> PassReport:
        (report,) = self.graph.partition_reports
        return report

    def pass_report(self) -> PassReport:
        (report,) = [r for r in self.graph.reports if r.name == "checkpoint"]
        return report


_RUNS: dict[tuple, Run] = {}


def run(name: str, mode: str, inner: str = "aot_eager", **options: Any) -> Run:
    """Compile a fresh copy of model ``name`` with ``checkpoint=mode``, one forward+backward (cached)."""
    key = (name, mode, inner, repr(sorted(options.items())))
    if key not in _RUNS:
        torch._dynamo.reset()
        model = build(name)
        rec = Recorder(keep_view=False)
        config = BoostConfig.from_options({"inner": inner, "checkpoint": mode, **options})
        compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, recorder=rec), fullgraph=True)
        with no_caches():  # a cache hit would skip the partitioner whose report we read
            loss = loss_of(name, compiled, tokens())
            loss.backward()
        (graph,) = rec.graphs
        _RUNS[key] = Run(loss.detach(), model, graph)
    return _RUNS[key]


@contextlib.contextmanager
def no_caches():
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


_EAGER: dict[str, tuple[tuple[torch.Tensor, nn.Module], tuple[torch.Tensor, nn.Module]]] = {}


def assert_parity(got: Run, name: str) -> None:
    """The parity rule for ``got``, a compiled run of model ``name``, against its eager and fp64 runs."""
    if name not in _EAGER:
        model = build(name)
        runs = []
        for m in (fp64_copy(model), model):
            loss = loss_of(name, m, tokens())
            loss.backward()
            runs.append((loss.detach(), m))
        _EAGER[name] = (runs[1], runs[0])
    eager, truth = _EAGER[name]
    assert torch.isfinite(eager[0])
    assert_parity_rule(step_errors((got.loss, got.model), eager, truth), what=name)


def per_block(run_: Run) -> dict[str, list[dict]]:
    """Saved activations (and RNG states) grouped by decoder block; "-" is outside the blocks."""
    out: dict[str, list[dict]] = {}
    for s in run_.saved.details["saved"]:
        if s["kind"] not in NOT_ACTIVATIONS:
            out.setdefault(s["block"], []).append(s)
    return out


def layers(run_: Run) -> list[str]:
    return sorted(b for b in per_block(run_) if b != "-")


# ----------------------------------------------------------------------------- config


def test_config_names_the_valid_modes():
    assert BoostConfig().checkpoint == "none"
    assert BoostConfig.from_options({"checkpoint": "budget", "checkpoint_budget": 0.3}).checkpoint_budget == 0.3
    with pytest.raises(ConfigError, match="'none', 'lowrank', 'full', 'budget'"):
        BoostConfig.from_options({"checkpoint": "selective"})
    with pytest.raises(ConfigError, match=r"checkpoint_budget must be in \[0, 1\]"):
        BoostConfig.from_options({"checkpoint": "budget", "checkpoint_budget": 1.5})
    with pytest.raises(ConfigError, match="wrong type"):
        BoostConfig.from_options({"checkpoint": True})


def test_pass_runs_last_and_only_when_asked():
    assert GRAPH_PASSES[-1] is CheckpointPass
    assert not CheckpointPass(BoostConfig()).enabled()
    assert CheckpointPass(BoostConfig(checkpoint="lowrank")).enabled()
    # "none" wraps the inner compiler's own partitioner (for the weight copies, below)
    assert checkpoint_partitioner(BoostConfig(inner="aot_eager")).base == "default"
    assert checkpoint_partitioner(BoostConfig(inner="inductor")).base == "min_cut"
    assert checkpoint_partitioner(BoostConfig(checkpoint="full")).base == "min_cut"


def test_partitioner_uuid_follows_mode_and_budget():
    def uuid(**kw):
        return CheckpointPartitioner(BoostConfig(**kw)).uuid()

    assert uuid(checkpoint="lowrank") == uuid(checkpoint="lowrank")
    assert uuid(checkpoint="lowrank") != uuid(checkpoint="full")
    assert uuid(checkpoint="budget", checkpoint_budget=0.5) != uuid(checkpoint="budget", checkpoint_budget=0.3)
    # whether it records is part of the key (a cache hit would skip the partitioner and its report);
    # the sink itself is run-time state (and survives Inductor's config deepcopy)
    sink: list = []
    p = CheckpointPartitioner(BoostConfig(checkpoint="lowrank"), sink=sink)
    assert p.uuid() != uuid(checkpoint="lowrank") and copy.deepcopy(p).sink is sink
    assert p.uuid() == CheckpointPartitioner(BoostConfig(checkpoint="lowrank"), sink=[]).uuid()


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODELS)
def test_parity_aot_eager(name, mode):
    assert_parity(run(name, mode), name)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [m if m == "lowrank" else pytest.param(m, marks=pytest.mark.extended) for m in MODES])
def test_parity_inductor(mode):
    assert_parity(run("tiny-1", mode, "inductor"), "tiny-1")
    if mode == "lowrank":  # the same tensors as under aot_eager (Inductor may keep the 2-D GEMM output)
        def kept(r: Run) -> list:
            return sorted((s["block"], s["role"], s["bytes"]) for s in r.saved.details["saved"] if s["role"] != "partitioner")

        assert kept(run("tiny-1", mode, "inductor")) == kept(run("tiny-1", mode))


def test_parity_with_the_fused_norm_op():
    """boost::rms_norm (the rmsnorm pass, here on CPU) is recomputed like any other op."""
    got = run("tiny", "lowrank", rmsnorm={"devices": ["cpu"]})
    assert_parity(got, "tiny")
    assert got.saved.details["recomputed"]["layers.0"]["boost.rms_norm"] == 2


# ----------------------------------------------------------------------------- what is saved


@pytest.mark.parametrize("name, inner", [
    ("tiny-dense", "aot_eager"), ("tiny", "aot_eager"),
    pytest.param("tiny-1", "inductor", marks=[pytest.mark.slow, pytest.mark.extended]),
])
def test_no_checkpointing_keeps_no_copy_of_the_weights(name, inner):
    """checkpoint="none": group_linears' concatenated weights (q/k/v, gate/up; their down factors
    when low-rank) are recomputed in backward, not saved. Saved, they are a second copy of the
    grouped weights for the whole backward, and under FSDP2 an unsharded one. Both inner
    partitioners saved them before (aot_eager's default and Inductor's min-cut)."""
    got = run(name, "none", inner)
    assert [s for s in got.saved.details["saved"] if s["kind"] == "weight"] == []
    n_layers = 1 if name == "tiny-1" else LlamaConfig.preset(name).n_layers
    assert got.saved.details["recomputed"]["-"]["aten.cat"] == 2 * n_layers  # q/k/v and gate/up
    assert_parity(got, name)


@pytest.mark.parametrize("name", ["tiny", "tiny-lowrank", "tiny-lax"])
def test_lowrank_saves_the_bottleneck_and_the_residual(name):
    """Per layer: 7 x [T, r] (q/k/v and gate/up as grouped tensors) + 2 x [T, d] of residual.
    LaX saves the same: its latents are the down outputs, and the crossing's add is recomputed.

    Allowed besides, with the reason:
    - parameters and inputs (kind "input"): not activation memory;
    - the generator state of each recomputed SDPA (kind "rng_state", 5 KB on CPU):
      attention is recomputed and SDPA counts as a random op;
    - outside the blocks (block "-"): the stream's source (the embedding output,
      role residual) and what the head and the loss keep (final-norm statistic,
      the head's input, log-softmax): left to the partitioner, as without
      checkpointing. RoPE tables and concatenated group weights are recomputed.
    """
    cfg = LlamaConfig.preset(name)
    got = run(name, "lowrank")
    blocks = per_block(got)
    assert layers(got) == [f"layers.{i}" for i in range(cfg.n_layers)]
    r, d, kv = cfg.rank_attn, cfg.dim, cfg.kv_dim
    assert cfg.rank_mlp == r
    for layer in layers(got):
        kept = blocks[layer]
        assert {s["kind"] for s in kept} == {"activation", "rng_state"}
        acts = [s for s in kept if s["kind"] == "activation"]
        assert all(s["role"].startswith(("down ", "down (grouped) ", "residual")) for s in acts), acts
        widths = sorted(s["shape"][-1] for s in acts if s["role"].startswith("down"))
        assert widths == [r, r, 2 * r, 3 * r]  # o, down_proj, gate+up, q+k+v
        assert sorted(s["shape"] for s in acts if s["role"] == "residual") == [[BATCH, SEQ, d]] * 2
        assert sum(s["bytes"] for s in acts) == BATCH * SEQ * 4 * (7 * r + 2 * d)
        assert len([s for s in kept if s["kind"] == "rng_state"]) == 1
    outside = blocks["-"]
    assert [s["role"] for s in outside if s["role"] != "partitioner"] == ["residual"]
    # norm statistic, the head's input, log-softmax, the loss: nothing of q/k/v or MLP width
    assert all(s["shape"] == [] or s["shape"][-1] in (1, d, 256) for s in outside), outside
    assert all(s["shape"] == [] or s["shape"][-1] not in (kv, cfg.ffn_dim) for s in outside)
    # the backward recomputes the five up GEMMs whose outputs it needs (q, k, v, gate, up) and attention
    redo = got.saved.details["recomputed"]["layers.0"]
    assert redo["aten.mm"] == 5 and redo["aten._scaled_dot_product_flash_attention_for_cpu"] == 1


def test_lowrank_without_grouping_keeps_seven_down_outputs():
    got = run("tiny", "lowrank", group={"enabled": False})
    r = LlamaConfig.preset("tiny").rank_attn
    for layer in layers(got):
        downs = [s for s in per_block(got)[layer] if s["role"].startswith("down ")]
        assert [s["shape"][-1] for s in downs] == [r] * 7


@pytest.mark.parametrize("name", ["tiny-dense", "hf"])
def test_lowrank_on_dense_blocks_keeps_residual_and_qkv(name):
    """Dense policy: outputs no wider than the residual are kept (q/k/v as one grouped tensor,
    [T, d + 2 d_kv]); gate/up ([T, d_ff]) are recomputed with the norms and attention."""
    got, none = run(name, "lowrank"), run(name, "none")
    d = 64
    for layer in layers(got):
        acts = [s for s in per_block(got)[layer] if s["kind"] == "activation"]
        assert sorted(s["role"].split(" ")[0] for s in acts) == ["dense", "residual", "residual"]
        (qkv,) = [s for s in acts if s["role"].startswith("dense (grouped)")]
        assert qkv["shape"] == [BATCH, SEQ, d + 2 * 32]
        redo = got.saved.details["recomputed"][layer]
        assert redo["aten.mm"] == 1  # gate+up, grouped
    assert sum(activation_bytes(got.saved).values()) < 0.4 * sum(activation_bytes(none.saved).values())


@pytest.mark.parametrize("name", ["tiny", "hf"])
def test_full_keeps_only_block_outputs(name):
    got = run(name, "full")
    for layer in layers(got):
        kept = per_block(got)[layer]
        assert [s["role"] for s in kept if s["kind"] == "activation"] == ["block output"]
    lowrank = run(name, "lowrank")
    assert sum(activation_bytes(got.saved).values()) < sum(activation_bytes(lowrank.saved).values())
    redo = got.saved.details["recomputed"][layers(got)[0]]
    assert redo["aten.mm"] > lowrank.saved.details["recomputed"][layers(got)[0]]["aten.mm"]


def test_budget_is_pytorchs_partitioner():
    none, got = run("tiny", "none"), run("tiny", "budget")
    assert "activation_memory_budget=0.5" in got.pass_report().not_applicable
    assert sum(activation_bytes(got.saved).values()) < sum(activation_bytes(none.saved).values())
    assert all(s["role"] == "partitioner" for s in got.saved.details["saved"])


def test_saved_values_are_the_forward_outputs_after_the_user_outputs():
    """The backward's non-tangent inputs, in order, are the forward's outputs after its
    user outputs (an RNG state is renamed on the way: ``rng_state_output_*``)."""
    for mode in ("none", "lowrank"):
        details = run("tiny", mode).saved.details
        extra = details["fw_output_names"][details["num_fwd_outputs"]:]
        saved = [s["name"] for s in details["saved"]]
        assert len(extra) == len(saved)
        assert [a for a, s in zip(extra, details["saved"], strict=True) if s["kind"] != "rng_state"] == [
            s for s in saved if not s.startswith("rng_state")
        ]


def test_inference_graph_is_left_alone():
    model = build("tiny")
    rec = Recorder(keep_view=False)
    config = BoostConfig(inner="aot_eager", checkpoint="lowrank", strict=True)
    with torch.no_grad():
        torch.compile(model, backend=functools.partial(compile_graph, config=config, recorder=rec))(tokens())
    (report,) = [r for r in rec.graphs[0].reports if r.name == "checkpoint"]
    assert "not differentiated" in report.not_applicable
    assert rec.graphs[0].partition_reports == []  # no joint graph, nothing partitioned


def test_strict_without_a_residual_stream():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    config = BoostConfig.from_options(
        {"inner": "aot_eager", "checkpoint": "lowrank", "strict": True, "group": {"enabled": False}, "rmsnorm": {"enabled": False}}
    )
    with pytest.raises(Exception, match="'checkpoint' is enabled but found no site"):
        torch.compile(model, backend=functools.partial(compile_graph, config=config))(torch.randn(2, 8, requires_grad=True))


# ----------------------------------------------------------------------------- collectives


_funcol = torch.ops._c10d_functional


class _Reduce(torch.autograd.Function):
    """All-reduce in forward, identity in backward (after a row-parallel GEMM)."""

    @staticmethod
    def forward(ctx, x):
        return _funcol.wait_tensor(_funcol.all_reduce(x.contiguous(), "sum", dist.group.WORLD.group_name))

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Copy(torch.autograd.Function):
    """Identity in forward, all-reduce in backward (before a column-parallel GEMM)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _funcol.wait_tensor(_funcol.all_reduce(grad.contiguous(), "sum", dist.group.WORLD.group_name))


class _TPBlock(nn.Module):
    """Bottlenecks whose down outputs are all-reduced, as a tensor-parallel plan makes them."""

    def __init__(self, d: int, r: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.a, self.b = nn.Linear(d, r, bias=False), nn.Linear(r, d, bias=False)
        self.c, self.e = nn.Linear(d, r, bias=False), nn.Linear(r, 4 * d, bias=False)
        self.f = nn.Linear(4 * d, d, bias=False)

    def forward(self, h):
        h = h + self.b(F.silu(_Reduce.apply(self.a(_Copy.apply(self.n1(h))))))
        return h + self.f(F.gelu(self.e(F.silu(_Reduce.apply(self.c(self.n2(h)))))))


class _TPModel(nn.Module):
    def __init__(self, d: int = 32, r: int = 8, n: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.layers = nn.ModuleList(_TPBlock(d, r) for _ in range(n))
        self.head = nn.Linear(d, 64)

    def forward(self, t):
        h = self.emb(t)
        for layer in self.layers:
            h = layer(h)
        return upcast(self.head(h)).logsumexp(-1).mean()


@pytest.fixture(scope="module")
def one_rank_group():
    """A single-process gloo group: functional collectives trace and run, summing over one rank."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def _collectives(graph: GraphRecord, kind: str) -> int:
    (census,) = [r for r in graph.aten_reports if r.name == "op_census" and r.details["graph"] == kind]
    return sum(v for k, v in census.details["op_counts"].items() if k.startswith("_c10d_functional."))


_TP_TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def _tp_run(mode: str | None) -> tuple[torch.Tensor, nn.Module, GraphRecord | None]:
    """One forward and backward of _TPModel compiled with ``checkpoint=mode``; None: eagerly,
    "fp64": eagerly in float64."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, rec = _TPModel(), Recorder(keep_view=False)
    if mode == "fp64":
        model = model.double()
    if mode in (None, "fp64"):
        compiled = model
    else:
        config = BoostConfig(inner="aot_eager", checkpoint=mode)
        compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, recorder=rec), fullgraph=True)
    loss = compiled(_TP_TOKENS)
    loss.backward()
    return loss.detach(), model, rec.graphs[0] if rec.graphs else None


def test_backward_issues_the_same_collectives(one_rank_group):
    """No collective is recomputed: the backward holds exactly the collectives of "none".

    Single process, so the all-reduces sum over one rank; the graphs carry them all
    the same (4 all_reduce+wait in forward, 2 in backward from the column-parallel
    inputs). Under tensor parallelism the same check compares real collectives.
    """
    eager, truth = _tp_run(None)[:2], _tp_run("fp64")[:2]
    ref_loss, ref_model, ref = _tp_run("none")
    assert_parity_rule(step_errors((ref_loss, ref_model), eager, truth), what="none")
    assert _collectives(ref, "forward") == 8 and _collectives(ref, "backward") == 4
    for mode in ("lowrank", "full"):
        loss, model, got = _tp_run(mode)
        assert_parity_rule(step_errors((loss, model), eager, truth), what=mode)
        for kind in ("forward", "backward"):
            assert _collectives(got, kind) == _collectives(ref, kind), (mode, kind)
        (report,) = got.partition_reports
        assert report.details["collectives"] == {"forward": 8, "backward": 4}
        # the down outputs are kept after their all-reduce
        kept = [s for s in report.details["saved"] if s["role"] == "collective"]
        assert len(kept) == 4 and all(s["shape"] == [2, 8, 8] for s in kept)


def test_partitioner_never_recomputes_a_collective(one_rank_group):
    """Negative control: a collective whose tag says "recompute" (inherited from an op
    that wraps it) is recomputed by plain min-cut, and kept by CheckpointPartitioner."""
    from functorch.compile import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def f(x, w1, w2):
        return (F.silu(_Reduce.apply(x @ w1)) @ w2).sum()

    def backward_collectives(partition) -> int:
        seen: list[int] = []

        def tag_then_partition(joint, inputs, **kwargs):
            outputs = joint.graph.find_nodes(op="output")[0].args[0][: kwargs["num_fwd_outputs"]]
            forward = set().union(*(_ancestors(o) for o in outputs))
            for node in forward:
                if node.op == "call_function":
                    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            fw, bw = partition(joint, inputs, **kwargs)
            seen.append(sum(1 for n in bw.graph.nodes if "_c10d_functional" in str(n.target)))
            return fw, bw

        def boxed(gm, _inputs):
            return make_boxed_func(gm.forward)

        fn = aot_function(f, fw_compiler=boxed, bw_compiler=boxed, partition_fn=tag_then_partition)
        x, w1, w2 = (torch.randn(*s, requires_grad=True) for s in ((4, 8), (8, 2), (2, 8)))
        fn(x, w1, w2).backward()
        return seen[0]

    assert backward_collectives(min_cut_rematerialization_partition) == 2  # all_reduce + wait, again
    assert backward_collectives(CheckpointPartitioner(BoostConfig(checkpoint="lowrank"))) == 0


def test_random_ops_are_kept_beside_an_opaque_input(monkeypatch):
    """Under DTensor (an opaque DeviceMesh input) SDPA is kept, not recomputed: recomputing a
    random op threads RNG state through the graphs, which in torch 2.13 puts the mesh among
    the saved tensors (found with the "vanilla" TP plan, two processes)."""
    import operator

    from torch._functorch._aot_autograd import graph_compile

    from boost_compile.passes.checkpoint_partitioner import keep_random_ops_beside_opaque_inputs

    def joint() -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        g.placeholder("mesh")
        q = g.placeholder("q")
        sdpa = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q))
        out = g.call_function(operator.getitem, (sdpa, 0))
        g.output(out)
        for node in (sdpa, out):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        return torch.fx.GraphModule({}, g)

    plain = joint()
    assert keep_random_ops_beside_opaque_inputs(plain) == 0  # no opaque input: attention is recomputed
    monkeypatch.setattr(graph_compile, "is_opaque_node", lambda n: n.name == "mesh")
    dtensor = joint()
    assert keep_random_ops_beside_opaque_inputs(dtensor) == 2
    assert {n.meta["recompute"] for n in dtensor.graph.nodes if n.op == "call_function"} == {CheckpointPolicy.MUST_SAVE}


def _ancestors(node) -> set:
    out, stack = set(), [node]
    while stack:
        n = stack.pop()
        if isinstance(n, torch.fx.Node) and n not in out:
            out.add(n)
            stack.extend(n.all_input_nodes)
    return out


# ----------------------------------------------------------------------------- caches


class _Residual(nn.Module):
    """The smallest model with a residual stream and a bottleneck (fast to compile)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm = nn.Embedding(32, 16), nn.RMSNorm(16)
        self.down, self.up, self.head = nn.Linear(16, 4), nn.Linear(4, 16), nn.Linear(16, 32)

    def forward(self, t):
        h = self.emb(t)
        h = h + self.up(F.silu(self.down(self.norm(h))))
        return self.head(h).logsumexp(-1).mean()


@pytest.mark.slow
def test_inductor_caches_keep_modes_apart():
    """The graph code is the same with and without tags; the partitioner's uuid keys the
    AOT-autograd and FX graph caches, so "lowrank" never reuses a "none" compile, and a
    second "lowrank" compile still hits the cache."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    def step(mode: str) -> Recorder:
        torch._dynamo.reset()
        torch.manual_seed(0)
        rec = Recorder(keep_view=False)
        config = BoostConfig(inner="inductor", checkpoint=mode)
        backend = functools.partial(compile_graph, config=config, recorder=rec) if mode != "none" else "boost"
        kwargs = {} if mode != "none" else {"options": {"inner": "inductor"}}
        torch.compile(_Residual(), backend=backend, **kwargs)(torch.arange(8).view(2, 4)).backward()
        return rec

    with inductor_config.patch(fx_graph_cache=True), functorch_config.patch(enable_autograd_cache=True), fresh_cache():
        step("none")
        counters.clear()
        first = step("lowrank")
        assert len(first.graphs[0].partition_reports) == 1  # partitioned: not the "none" artifact
        assert counters["aot_autograd"].get("autograd_cache_hit", 0) == 0
        counters.clear()
        second = step("lowrank")
        assert counters["aot_autograd"].get("autograd_cache_hit", 0) == 1
        assert second.graphs[0].partition_reports == []


# ----------------------------------------------------------------------------- explain


def test_explain_shows_what_is_saved_and_recomputed(tmp_path):
    model = build("tiny")
    report = bc.explain(model, tokens()[:1], options={"inner": "aot_eager", "checkpoint": "lowrank"})
    text = str(report)
    assert "### Saved for backward" in text and "checkpoint: `lowrank`" in text
    assert "down (grouped) layers.0.attention.q_proj.down+layers.0.attention.k_proj.down" in text
    assert "| layers.1 | 20,416 |" in text  # (7 r + 2 d) * 16 tokens * 4 bytes + one 5,056-byte RNG state
    assert "_scaled_dot_product_flash_attention_for_cpu x1" in text
    assert "checkpoint: found 2, rewritten 2" in text
    data = report.to_dict()["graphs"][0]["saved_tensors"][0]["details"]
    assert {s["role"] for s in data["saved"]} >= {"residual", "down layers.0.attention.o_proj"}
    report.save(tmp_path)

