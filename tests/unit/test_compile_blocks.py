"""``compile_blocks``: every repeated block compiled on its own, one artifact for identical blocks.

Parity: a model compiled block by block follows the suite's parity rule against eager (loss,
every gradient) on the reference presets (dense, plain low-rank, CoLA, LaX) with checkpoint none
and lowrank, and on every model of the style zoo (nanoGPT, Meta's Llama, modded-nanogpt, raw
``x @ A`` parameters, Hugging Face classes). Structure: the blocks found, how many graphs the
backend compiled (one for identical blocks, whatever the depth), what each pass rewrote inside a
block, low-rank checkpointing keeping per block what it keeps in the whole-model graph, names and
state dict unchanged, and the refusals (no blocks, a tensor-parallel model, a bad option).
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
from conftest import assert_parity, check_against_eager, fp64_copy, step_errors
from style_models import BLOCKS, STYLES
from torch import nn

import boost_compile.loss_logits as loss_logits
from boost_compile import BlockCompileError, ConfigError, compile_blocks
from boost_compile.backend import Recorder, compile_graph
from boost_compile.blocks import compiled_blocks, find_blocks
from boost_compile.config import BoostConfig
from boost_compile.models import Llama, LlamaConfig

BATCH, SEQ, VOCAB = 2, 16, 256


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))


def _model(preset: str, n_layers: int = 2) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset(preset, n_layers=n_layers))


def _recorded(options: dict) -> tuple[Recorder, functools.partial]:
    rec = Recorder(keep_view=False)
    return rec, functools.partial(compile_graph, config=BoostConfig.from_options(options), recorder=rec)


def _report(graph, name: str):
    (report,) = [r for r in graph.reports if r.name == name]
    return report


# ----------------------------------------------------------------------------- finding blocks


def test_find_blocks_of_the_reference_and_style_models():
    assert find_blocks(_model("tiny", n_layers=3)) == ["layers.0", "layers.1", "layers.2"]
    gpt, _ = STYLES["nanogpt-fused-dense"]()
    assert find_blocks(gpt) == [f"transformer.h.{i}" for i in range(BLOCKS)]


def test_a_model_without_blocks_is_refused_by_name():
    class TwoLinears(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(BlockCompileError, match="TwoLinears has no nn.ModuleList"):
        compile_blocks(TwoLinears())
    with pytest.raises(BlockCompileError, match="no submodule 'layers.9'"):
        compile_blocks(_model("tiny"), blocks=["layers.9"])
    with pytest.raises(BlockCompileError, match="names no block"):
        compile_blocks(_model("tiny"), blocks=[])


def test_blocks_in_a_sequential_are_found_and_mixed_containers_are_not():
    """An nn.Sequential of identical blocks is a block list; one of mixed layers (an MLP) is not."""
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return x + self.proj(x).relu()

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))  # the most parameters
            self.trunk = nn.Sequential(*(Residual() for _ in range(3)))

        def forward(self, x):
            return self.trunk(self.mlp(x))

    model = Blocks()
    assert find_blocks(model) == ["trunk.0", "trunk.1", "trunk.2"]
    x = torch.randn(2, 8)
    expected = model(x)
    compile_blocks(model, backend="eager", fullgraph=True)
    assert compiled_blocks(model) == ["trunk.0", "trunk.1", "trunk.2"]
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_a_tensor_parallel_model_needs_parallelize_and_the_boost_backend():
    """A model marked as sharded with btp compiles per block only through parallelize_'s block layout
    and with the boost backend (tests/distributed/test_tp.py runs the real thing on two ranks)."""
    model = _model("tiny")
    model._boost_tp_plan = "btp"  # what parallelize_ leaves on a sharded model
    with pytest.raises(BlockCompileError, match=r"parallelized with 'btp' compiles only with the boost backend"):
        compile_blocks(model, backend="aot_eager")
    with pytest.raises(BlockCompileError, match=r"has no block layout \(parallelize it with parallelize_\)"):
        compile_blocks(model)
    assert compiled_blocks(model) == []


def test_a_bad_option_fails_before_any_step():
    with pytest.raises(ConfigError):
        compile_blocks(_model("tiny"), {"checkpoint": "sometimes"})


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("checkpoint", ["none", "lowrank"])
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-lowrank", "tiny", "tiny-lax"])
def test_reference_model_parity_per_block(preset: str, checkpoint: str) -> None:
    tokens, targets = _batch()
    options = {"inner": "aot_eager", "checkpoint": checkpoint}

    def compile_fn(m):
        compile_blocks(m, options)
        return m

    check_against_eager(_model(preset, n_layers=3), compile_fn, lambda m, _: m(tokens, targets),
                        what=f"{preset} per block, checkpoint {checkpoint}")


@pytest.mark.slow
def test_inductor_parity_per_block() -> None:
    """The blocks and the loss on the eager head's logits (loss_logits.py) compiled with Inductor."""
    tokens, targets = _batch()
    losses = []

    def counted():
        compiled = real()

        def loss(*args, **kwargs):
            losses.append(args[0].shape)
            return compiled(*args, **kwargs)
        return loss

    def compile_fn(m):
        with mock.patch.object(loss_logits, "compiled_cross_entropy", counted):
            compile_blocks(m, {"inner": "inductor", "checkpoint": "lowrank"})
        return m

    real = loss_logits.compiled_cross_entropy
    check_against_eager(_model("tiny"), compile_fn, lambda m, _: m(tokens, targets), what="CoLA per block, inductor")
    assert losses == [torch.Size([BATCH * SEQ, VOCAB])]


#: the low-rank styles, and two dense ones (the rest differ from their low-rank twin only in the factors)
PER_BLOCK_STYLES = sorted(n for n in STYLES if "dense" not in n) + ["hf-gpt2-dense", "nanogpt-fused-dense"]


@pytest.mark.parametrize("name", PER_BLOCK_STYLES)
def test_style_model_parity_per_block(name: str) -> None:
    ref, loss_fn = STYLES[name]()
    twin, _ = STYLES[name]()
    truth = fp64_copy(ref)
    rec, backend = _recorded({"inner": "aot_eager"})
    names = compile_blocks(twin, backend=backend, fullgraph=True)
    assert len(names) == BLOCKS and compiled_blocks(twin) == names
    tokens = _batch(1)[0]
    losses = []
    for m in (ref, twin, truth):
        loss = loss_fn(m, tokens)
        loss.backward()
        losses.append(loss)
    assert_parity(step_errors((losses[1], twin), (losses[0], ref), (losses[2], truth)), what=f"{name} per block")
    # identical blocks share the artifact; a model whose first block differs (LaX) compiles two
    assert 1 <= len(rec.graphs) <= 2, f"{len(rec.graphs)} graphs for {BLOCKS} blocks"


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("preset,graphs", [("tiny", 1), ("tiny-dense", 1), ("tiny-lax", 2)])
def test_identical_blocks_compile_once_whatever_the_depth(preset: str, graphs: int) -> None:
    """4 and 8 layers: the same number of graphs (LaX's first block takes no latents: two)."""
    for n_layers in (4, 8):
        torch._dynamo.reset()
        model = _model(preset, n_layers)
        rec, backend = _recorded({"inner": "aot_eager"})
        compile_blocks(model, backend=backend, fullgraph=True)
        tokens, targets = _batch()
        model(tokens, targets).backward()
        assert len(rec.graphs) == graphs, (preset, n_layers, len(rec.graphs))


def test_a_hugging_face_kv_cache_is_named_as_why_each_block_compiles(caplog) -> None:
    """config.use_cache=True: Hugging Face builds a KV cache every forward and each block's call
    guards on its layer index, so each block compiles its own graph (eager past Dynamo's recompile
    limit). compile_blocks logs that and the fix; with use_cache=False one graph, no warning."""
    from conftest import tiny_hf_llama

    graphs = {}
    for use_cache in (True, False):
        torch._dynamo.reset()
        caplog.clear()
        model = tiny_hf_llama()
        model.config.use_cache = use_cache
        rec, backend = _recorded({"inner": "aot_eager"})
        with caplog.at_level("WARNING", logger="boost_compile.blocks"):
            compile_blocks(model, backend=backend)
        warned = [r.getMessage() for r in caplog.records if "use_cache" in r.getMessage()]
        tokens, _ = _batch()
        model(input_ids=tokens, labels=tokens).loss.backward()
        graphs[use_cache] = len(rec.graphs)
        assert bool(warned) == use_cache, warned
        if use_cache:
            assert "each block's call guards on its own layer index" in warned[0]
            assert "model.config.use_cache = False" in warned[0]
    assert graphs == {True: 2, False: 1}  # two blocks: a graph each with the cache, one without


def test_each_pass_rewrites_inside_the_block():
    """Grouping and the RMSNorm rewrite find in the block graph what they find per block in the
    whole model's graph."""
    whole_rec, whole_backend = _recorded({"inner": "aot_eager", "rmsnorm": {"devices": ["cpu"]}})
    block_rec, block_backend = _recorded({"inner": "aot_eager", "rmsnorm": {"devices": ["cpu"]}})
    tokens, targets = _batch()
    torch.compile(_model("tiny"), backend=whole_backend, fullgraph=True)(tokens, targets).backward()
    blocks = _model("tiny")
    compile_blocks(blocks, backend=block_backend, fullgraph=True)
    blocks(tokens, targets).backward()
    (whole,), (block,) = whole_rec.graphs, block_rec.graphs
    n = len(find_blocks(blocks))
    assert len(_report(whole, "group_linears").rewritten) == n * len(_report(block, "group_linears").rewritten) == n * 2
    # the whole graph also holds the final norm, outside the blocks (eager per block)
    assert len(_report(whole, "rmsnorm").rewritten) == n * len(_report(block, "rmsnorm").rewritten) + 1


def test_lowrank_keeps_per_block_what_the_whole_graph_keeps():
    """checkpoint=lowrank: a block graph saves the roles (and bytes) one block saves in the whole
    model's graph: the bottleneck down outputs and the residual stream."""
    def kept(rec, block):
        (part,) = rec.graphs[0].partition_reports
        return sorted((s["role"].replace(f"{block}.", "") if block else s["role"], s["bytes"])
                      for s in part.details["saved"] if s["role"] != "partitioner" and s["block"] == (block or "-"))

    tokens, targets = _batch()
    whole_rec, whole_backend = _recorded({"inner": "aot_eager", "checkpoint": "lowrank"})
    torch.compile(_model("tiny"), backend=whole_backend, fullgraph=True)(tokens, targets).backward()
    block_rec, block_backend = _recorded({"inner": "aot_eager", "checkpoint": "lowrank"})
    model = _model("tiny")
    compile_blocks(model, backend=block_backend, fullgraph=True)
    model(tokens, targets).backward()
    per_block = kept(block_rec, None)
    # the middle add; the whole graph also keeps each block's output, which per block is the next
    # block's graph input (held by autograd, not an activation of that graph)
    assert [role for role, _ in per_block].count("residual") == 1
    assert [role for role, _ in kept(whole_rec, "layers.1")].count("residual") == 2
    assert [r for r in per_block if r[0] != "residual"] == [r for r in kept(whole_rec, "layers.1") if r[0] != "residual"]
    assert any(role.startswith("down") for role, _ in per_block)


def test_full_keeps_only_the_blocks_input_per_block():
    """checkpoint=full on a block compiled alone (BoostConfig.block_graph, set by compile_blocks):
    the block is recomputed from its input, which the graph keeps as an input; no stream tensor
    of its own is saved (the add between attention and MLP has no module path in a block graph,
    and was once kept as a block of its own). The whole model's graph keeps each block's output."""
    tokens, targets = _batch()
    block_rec, block_backend = _recorded({"inner": "aot_eager", "checkpoint": "full"})
    model = _model("tiny")
    compile_blocks(model, backend=block_backend, fullgraph=True)
    model(tokens, targets).backward()
    (part,) = block_rec.graphs[0].partition_reports
    saved = part.details["saved"]
    assert [s for s in saved if s["kind"] == "activation"] == [], saved
    assert sum(1 for s in saved if s["kind"] == "input" and not s["static"]) >= 1  # the block's input
    whole_rec, whole_backend = _recorded({"inner": "aot_eager", "checkpoint": "full"})
    torch.compile(_model("tiny"), backend=whole_backend, fullgraph=True)(tokens, targets).backward()
    (whole,) = whole_rec.graphs[0].partition_reports
    assert sorted(s["block"] for s in whole.details["saved"] if s["role"] == "block output") == ["layers.0", "layers.1"]

    def compile_fn(m):
        compile_blocks(m, {"inner": "aot_eager", "checkpoint": "full"})
        return m

    check_against_eager(_model("tiny", n_layers=3), compile_fn, lambda m, _: m(tokens, targets), what="tiny per block, full")


def test_names_and_state_dict_are_unchanged():
    model = _model("tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    compile_blocks(model, {"inner": "aot_eager"})
    assert [n for n, _ in model.named_parameters()] == names
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
