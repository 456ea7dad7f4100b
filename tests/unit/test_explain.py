"""explain() and boost-explain: the report, the files, and that it leaves the model alone."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import boost_compile as bc
from boost_compile.explain import main as explain_main
from boost_compile.models import Llama, LlamaConfig


def tiny(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig.preset("tiny"))


def test_explain_reports_analysis_passes_and_op_counts(tmp_path):
    model = tiny()
    tokens = torch.randint(0, 256, (1, 16))
    report = bc.explain(model, tokens, options={"inner": "aot_eager"})
    (graph,) = report.graphs
    summary = graph.view.summary()
    assert summary["bottlenecks"] == 7 * model.config.n_layers
    text = str(report)
    assert "bottleneck chains: 14" in text and "layers.0.attention.q_proj" in text
    assert "aten forward" in text and "aten backward" in text

    folder = report.save(tmp_path / "out")
    names = sorted(p.name for p in folder.iterdir())
    assert "summary.md" in names and "summary.json" in names
    assert "graph0_0_captured.py" in names and "graph0_bottlenecks.dot" in names
    data = json.loads((folder / "summary.json").read_text())
    assert len(data["graphs"][0]["analysis"]["bottlenecks"]) == 14
    dot = (folder / "graph0_bottlenecks.dot").read_text()
    assert dot.startswith("digraph") and dot.count("subgraph cluster_b") == 14
    code = (folder / "graph0_0_captured.py").read_text()
    assert "def forward" in code


def test_explain_leaves_gradients_untouched():
    model = tiny()
    tokens = torch.randint(0, 256, (1, 16))
    marker = torch.full_like(model.output.weight, 3.0)
    model.output.weight.grad = marker.clone()
    bc.explain(model, tokens, options={"inner": "aot_eager"})
    assert torch.equal(model.output.weight.grad, marker)
    assert model.layers[0].attention.q_proj.down.weight.grad is None


def test_explain_shows_rewrites_of_an_enabled_pass():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny-dense")).eval()
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        report = bc.explain(model, tokens, options={"inner": "aot_eager", "factorize": {"rank": 8}})
    text = str(report)
    assert "factorize: found 14, rewritten 14, skipped 0" in text
    stages = [s.name for s in report.graphs[0].stages]
    assert stages == ["captured", "tp_localize", "factorize", "group_linears", "tp_collectives", "rmsnorm"]
    assert report.graphs[0].stages[0].op_counts["linear"] == 15
    assert report.graphs[0].stages[2].op_counts["linear"] == 29  # after factorize
    # the new down factors of q/k/v and of gate/up share inputs: 3 + 2 -> 2 per block
    assert report.graphs[0].stages[3].op_counts["linear"] == 29 - 3 * 2
    assert "group_linears: found 4, rewritten 4, skipped 0" in text


def test_cli_writes_folder(tmp_path, capsys):
    assert explain_main(["--preset", "tiny", "--seq", "8", "--out", str(tmp_path / "x")]) == 0
    out = capsys.readouterr().out
    assert "# boost_compile explain" in out
    assert (tmp_path / "x" / "summary.md").exists()


def test_console_script_installed():
    result = subprocess.run(
        [sys.executable, "-m", "boost_compile.explain", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "--preset" in result.stdout


def test_per_block_shows_each_block_graph_once_with_its_blocks(tmp_path):
    """unit="block": a 4-layer CoLA model is one block graph run by all four blocks; LaX's first
    block (no latents to take) has a graph of its own. The user's model is left uncompiled."""
    from boost_compile.blocks import compiled_blocks

    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    for preset, expected in (("tiny", {0: ["layers.0", "layers.1", "layers.2", "layers.3"]}),
                             ("tiny-lax", {0: ["layers.0"], 1: ["layers.1", "layers.2", "layers.3"]})):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Llama(LlamaConfig.preset(preset, n_layers=4))
        report = bc.explain(model, tokens, options={"inner": "aot_eager"}, unit="block")
        assert report.blocks == expected, (preset, report.blocks)
        assert len(report.graphs) == len(expected)
        (group,) = [r for r in report.graphs[-1].reports if r.name == "group_linears"]
        assert len(group.rewritten) == 2  # one block's q/k/v and gate/up downs
        last = expected[len(expected) - 1]
        assert f"Compiled once, run by {len(last)} block(s): {', '.join(last)}" in str(report)
        # the block graph's saved tensors are each block's (its modules are named from the block)
        assert "| each block | " in str(report) and "\n| - | " not in str(report)
        assert compiled_blocks(model) == []
    data = json.loads((report.save(tmp_path / "lax") / "summary.json").read_text())
    assert data["blocks"] == {"0": ["layers.0"], "1": ["layers.1", "layers.2", "layers.3"]}
