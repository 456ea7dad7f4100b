"""The layout zoo's judging and bookkeeping (boost_compile/bench/zoo_layouts.py), without a process group:
a planted wrong gradient is WRONG, a missing one MISSING_GRAD, a router-only miss with a top-k flip
topk_flip; a rank that dies or hangs costs its architecture alone (fake ranks, no torch.distributed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from boost_compile.bench import zoo_layouts as zl


def _runs(steps: int = 3, seed: int = 0) -> tuple[list, list, list]:
    """(tested, eager, truth): each step's loss and gradients; eager is the truth rounded to fp32,
    the tested run the truth rounded to fp32 from a nearby value (another summation order)."""
    g = torch.Generator().manual_seed(seed)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight", "model.norm.weight"]
    truth, eager, tested = [], [], []
    for _ in range(steps):
        ref = {n: torch.randn(8, 8, generator=g, dtype=torch.float64) for n in names}
        loss = torch.rand((), generator=g, dtype=torch.float64) + 1
        truth.append((loss, ref))
        eager.append((loss.float(), {n: t.float() for n, t in ref.items()}))
        tested.append((loss.float(), {n: (t * (1 + 1e-8)).float() for n, t in ref.items()}))
    return tested, eager, truth


def _result(**kw) -> zl.LayoutResult:
    return zl.LayoutResult("tiny", layout="tp2-megatron", **kw)


def test_exact_when_every_step_is_within_the_rule():
    r = zl.judge_steps(_result(), *_runs())
    assert (r.cls, r.reason, r.step) == ("exact", "", 0)
    assert 0 <= r.margin < 1


@pytest.mark.parametrize("step", [1, 3])
def test_a_planted_wrong_gradient_is_wrong_at_its_step(step):
    tested, eager, truth = _runs()
    name = "model.layers.0.self_attn.q_proj.weight"
    tested[step - 1][1][name] = tested[step - 1][1][name] * 1.001
    r = zl.judge_steps(_result(), tested, eager, truth)
    assert r.cls == "WRONG" and r.step == step and r.worst[0]["name"] == name
    assert r.reason.startswith(f"step {step}: {name}") and r.margin > 1


def test_a_wrong_loss_is_wrong():
    tested, eager, truth = _runs()
    tested[0] = (tested[0][0] * 1.01, tested[0][1])
    assert zl.judge_steps(_result(), tested, eager, truth).worst[0]["name"] == "loss"


def test_a_missing_gradient_is_missing_grad_even_after_a_wrong_one():
    tested, eager, truth = _runs()
    tested[0][1]["model.norm.weight"] = tested[0][1]["model.norm.weight"] * 2
    tested[1][1]["model.layers.0.self_attn.q_proj.weight"] = None
    r = zl.judge_steps(_result(), tested, eager, truth)
    assert r.cls == "MISSING_GRAD" and r.step == 2 and r.missing == ["model.layers.0.self_attn.q_proj.weight"]


def test_a_router_only_miss_is_a_topk_flip_only_where_eager_flipped():
    tested, eager, truth = _runs()
    router = "model.layers.0.mlp.gate.weight"
    tested[1][1][router] = tested[1][1][router] * 1.5
    flipped = _result(routers=["model.layers.0.mlp.gate"], flips={"model.layers.0.mlp.gate": 3})
    assert zl.judge_steps(flipped, tested, eager, truth).cls == "topk_flip"
    assert zl.judge_steps(_result(routers=["model.layers.0.mlp.gate"]), tested, eager, truth).cls == "WRONG"
    # a flip does not excuse a miss outside the routers at the first step out
    tested[1][1]["model.norm.weight"] = tested[1][1]["model.norm.weight"] * 1.5
    assert zl.judge_steps(flipped, tested, eager, truth).cls == "WRONG"


def test_judge_needs_as_many_steps_of_each_run():
    tested, eager, truth = _runs()
    with pytest.raises(ValueError, match="as many steps"):
        zl.judge_steps(_result(), tested[:2], eager, truth)


def test_a_crash_before_the_tested_run_is_a_skip_after_it_an_error():
    assert zl.crash_result("llama", "fsdp2", "references", "rank 1 exited with signal SIGSEGV").cls == "skipped"
    r = zl.crash_result("llama", "fsdp2", "step2", "timed out after 300 s", "RuntimeError: boom", seconds=301.2)
    assert r.cls == "ERROR" and r.reason == "timed out after 300 s in stage step2 (RuntimeError: boom)" and r.seconds == 301.2


# ----------------------------------------------------------------------------- the parent, with fake ranks

#: a fake rank: for each name, its progress, then a result line (rank 0), a hang ("hang"), or for "crash"
#: rank 1 killed and rank 0 waiting for it (in a collective, were it real)
FAKE_RANK = r"""
import json, os, signal, sys, time
from pathlib import Path
folder, results, rank, mode = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
if mode == "dead":
    sys.exit(1)
for name in json.loads((folder / "names.json").read_text()):
    (folder / f"progress-{rank}.json").write_text(json.dumps({"model_type": name, "stage": "step1"}))
    if name == "crash" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if name == "hang" or name == "crash":
        time.sleep(60)
    if rank == 0:
        with open(results, "a") as f:
            f.write(json.dumps({"model_type": name, "layout": "fake", "cls": "exact", "seconds": 0.1}) + "\n")
"""


def _fake_launch(mode: str):
    def launch(layout, names, results, folder, timeout):
        folder.mkdir(parents=True)
        (folder / "names.json").write_text(json.dumps(list(names)))
        return [subprocess.Popen([sys.executable, "-c", FAKE_RANK, str(folder), str(results), str(rank), mode],
                                 start_new_session=True, stderr=subprocess.DEVNULL) for rank in range(layout.world)]
    return launch


def test_a_dead_or_hung_rank_costs_its_architecture_alone(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(zl, "_launch", _fake_launch("run"))
    monkeypatch.setattr(zl, "STARTUP_S", 0.0)
    monkeypatch.setattr(zl, "GRACE_S", 0.5)
    lines: list[str] = []
    names = ["a", "crash", "b", "hang", "c"]
    layout = zl.Layout("fake", 2)
    results, groups = zl.run_layout(layout, names, tmp_path / "r.jsonl", timeout=1.5, one_process={"a": "exact"},
                                    echo=lines.append)
    assert [(r.model_type, r.cls) for r in results] == [("a", "exact"), ("crash", "ERROR"), ("b", "exact"),
                                                         ("hang", "ERROR"), ("c", "exact")]
    assert groups == 3 and len(lines) == 5 and results[0].one_process == "exact"
    assert results[1].reason == "rank 1 exited with signal SIGKILL in stage step1"
    assert results[3].reason.startswith("timed out after 1.5 s in stage step1")
    # the json lines keep every result: a resumed run redoes nothing
    monkeypatch.setattr(zl, "_launch", _fake_launch("dead"))
    again, groups = zl.run_layout(layout, names, tmp_path / "r.jsonl", timeout=1.5, resume=True, echo=lines.append)
    assert [r.cls for r in again] == [r.cls for r in results] and groups == 0


def test_a_group_that_never_starts_stops_the_run(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(zl, "_launch", _fake_launch("dead"))
    monkeypatch.setattr(zl, "GRACE_S", 0.5)
    with pytest.raises(RuntimeError, match="failed twice before its first architecture"):
        zl.run_layout(zl.Layout("fake", 1), ["x", "y", "z"], tmp_path / "r.jsonl", timeout=5, echo=lambda _: None)


def test_tables_keep_the_layouts_not_run_again(tmp_path: Path):
    def section(cls: str) -> dict:
        r = zl.LayoutResult("llama", layout="x", cls=cls, reason="ParallelizeError: no" if cls == "refused" else "")
        return {"meta": {"wall_s": 1}, "counts": zl.counts([r]), "results": [r.to_dict()]}

    zl.write_tables({"fsdp2": section("exact"), "tp2-btp": section("exact")}, tmp_path, "t")
    zl.write_tables({"tp2-btp": section("refused")}, tmp_path, "t")
    data = json.loads((tmp_path / "t.json").read_text())["layouts"]
    assert data["fsdp2"]["counts"] == {"exact": 1} and data["tp2-btp"]["counts"] == {"refused": 1}
    md = (tmp_path / "t.md").read_text()
    assert md.index("## tp2-btp") < md.index("## fsdp2") and "- llama: ParallelizeError: no" in md
