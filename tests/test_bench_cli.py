"""boost-bench: results on disk, the regenerated report, and small runs of each benchmark.

The runs use the tiny presets and ``aot_eager`` so they take seconds; what is
checked is what the report relies on (rows, ratios against the named
baseline, exact byte counts from the graphs), never a timing.
"""

from __future__ import annotations

import json
import os

import pytest

from boost_compile.bench import cli, report
from boost_compile.bench.results import Result, Target, load, save


def test_target_direction_and_bound():
    assert Target("x", 1.5, 1.5, True).met
    assert not Target("x", 1.49, 1.5, True).met
    assert Target("x", 0.9, 0.9, False).met
    assert not Target("x", 0.91, 0.9, False).met
    assert "**not met**" in Target("x", 0.91, 0.9, False).line()


def test_result_round_trips_through_json(tmp_path):
    r = Result("demo", "Demo", "| a |\n|---|\n| 1 |", {"rows": [1, 2]}, [Target("t", 2.0, 1.0, True)], notes="n")
    paths = save(r, str(tmp_path), None)
    assert paths == [str(tmp_path / "demo.json")]
    back = load(str(tmp_path), "demo")
    assert back == r
    assert load(str(tmp_path), "missing") is None


def _fake(name: str, value: float) -> Result:
    r = Result(name, f"Title {name}", f"table of {name}", {}, [Target(f"{name} ratio", value, 1.0, True)])
    r.command, r.commit, r.machine, r.date, r.seconds = f"boost-bench {name}", "abc123", "here", "today", 1.0
    return r


def test_report_replaces_only_the_generated_block(tmp_path):
    results = tmp_path / "results"
    for name, value in (("tp", 2.0), ("single", 0.5)):
        save(_fake(name, value), str(results), None)
    path = tmp_path / "RESULTS.md"
    path.write_text(f"# Mine\n\nintro kept\n\n{report.BEGIN}\nstale table\n{report.END}\n\n## GPU\n\nkept too\n")
    report.write(str(results), str(path))
    text = path.read_text()
    assert "stale table" not in text
    assert text.startswith("# Mine\n\nintro kept\n\n")
    assert text.rstrip().endswith("## GPU\n\nkept too")
    block = text.split(report.BEGIN)[1].split(report.END)[0]
    # sections in report order, each with its command and commit, targets judged
    assert block.index("## Title single") < block.index("## Title tp")
    assert "`boost-bench tp`" in block and "Commit abc123" in block
    assert "single ratio: 0.500 (target >= 1): **not met**" in block
    assert "tp ratio: 2.000 (target >= 1): met" in block
    # idempotent
    report.write(str(results), str(path))
    assert path.read_text() == text


def test_report_without_markers_appends_a_block(tmp_path):
    path = tmp_path / "R.md"
    path.write_text("# Hand-written\n")
    report.write(str(tmp_path / "none"), str(path))
    text = path.read_text()
    assert text.startswith("# Hand-written\n\n" + report.BEGIN)
    assert "No results" in text


def test_tp_analytic_prints_the_table(capsys):
    assert cli.main(["tp-analytic"]) == 0
    assert "| 7B | 4 |" in capsys.readouterr().out


def test_scale_writes_json_png_and_targets(tmp_path):
    cli.main(["scale", "--out", str(tmp_path)])
    r = load(str(tmp_path), "scale")
    assert os.path.getsize(tmp_path / "scale.png") > 0
    assert r.command == "boost-bench scale"
    # two speed-ups for each of the 3B, 7B and 13B rows
    assert len(r.targets) == 6
    rows = {row["model"]: row for row in r.data["published"]}
    for t in r.targets:
        model = t.what.split()[0]
        key = "vs_full" if "vs full" in t.what else "vs_vanilla"
        assert t.value == pytest.approx(abs(rows[model]["speedup_error"][key]))


@pytest.mark.slow
def test_single_on_tiny(tmp_path):
    argv = ["single", "--size", "tiny", "--seq", "16", "--batch", "2", "--repeats", "2", "--warmup", "0",
            "--inner", "aot_eager", "--variants", "dense-eager", "cola-boost", "--out", str(tmp_path)]
    cli.main(argv)
    r = load(str(tmp_path), "single")
    assert r.command == "boost-bench " + " ".join(a for a in argv if a not in ("--out", str(tmp_path)))
    rows = {row["key"]: row for row in r.data["rows"]}
    assert list(rows) == ["dense-eager", "cola-boost"]
    # the baseline against itself, and tokens/s from the median step
    assert rows["dense-eager"]["ratios"]["dense eager"] == 1.0
    for row in rows.values():
        assert row["tokens_per_s"] == pytest.approx(2 * 16 / row["step_s"])
    assert rows["cola-boost"]["ratios"]["dense eager"] == pytest.approx(rows["dense-eager"]["step_s"] / rows["cola-boost"]["step_s"])
    # a CoLA block: 7 bottlenecks = 14 GEMMs; grouping merges the q/k/v downs (3 -> 1) and gate/up (2 -> 1)
    assert r.data["gemms_per_block"] == [14, 11]
    assert (tmp_path / "single.png").exists()


@pytest.mark.slow
def test_memory_on_tiny(tmp_path):
    cli.main(["memory", "--size", "tiny", "--seq", "16", "--batch", "1", "--repeats", "1", "--warmup", "0",
              "--inner", "aot_eager", "--modes", "none", "lowrank", "--out", str(tmp_path)])
    r = load(str(tmp_path), "memory")
    rows = {row["mode"]: row for row in r.data["rows"]}
    assert list(rows) == ["none", "lowrank"]
    assert rows["lowrank"]["saved_per_layer"] < rows["none"]["saved_per_layer"]
    assert r.targets == []  # the targets are for the 60m shapes only
    json.loads((tmp_path / "memory.json").read_text())


@pytest.mark.slow
def test_tp_on_tiny(tmp_path):
    cli.main(["tp", "--size", "tiny", "--seq", "16", "--repeats", "1", "--warmup", "0", "--inner", "aot_eager", "--out", str(tmp_path)])
    r = load(str(tmp_path), "tp")
    v = r.data["variants"]
    btp, dense, vanilla = v["CoLA, btp"], v["dense, megatron"], v["CoLA, vanilla (DTensor)"]
    n = btp["layers"]
    # btp: one all-reduce per norm+group and per o/down, both ways, plus the gather before the final norm
    assert btp["collectives"] == {"forward": 4 * n + 1, "backward": 4 * n}
    # megatron: after attention and after the MLP, both ways
    assert dense["collectives"] == {"forward": 2 * n, "backward": 2 * n}
    total = {k: x["bytes"]["forward"] + x["bytes"]["backward"] for k, x in v.items()}
    assert dense["btp_bytes_ratio"] == pytest.approx(total["CoLA, btp"] / total["dense, megatron"])
    assert vanilla["btp_speedup"] == pytest.approx(vanilla["step_s"] / btp["step_s"])
    assert (tmp_path / "tp.png").exists()
