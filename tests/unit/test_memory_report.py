"""``trainer.memory_report``: each term of ``memory_rank0.json`` against what it must be, and
``boost_compile.bench.plan_measure`` running a layout's job.

The runs are the tiny preset in one process, 3 steps of 4 x 32 tokens, the boost backend with
aot_eager (its partitioner reports what the forward saves as Inductor's does), a few seconds each;
and the same under FSDP2 over 2 processes (torchrun, gloo), against the one-process report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FAST, cfg_of, torchrun

import boost_compile as bc
from boost_compile.bench import plan_measure
from boost_compile.train import run
from boost_compile.train.memory_report import peak_of

RUN = (*FAST, "model=tiny", "passes=boost_aot_eager", "trainer.steps=3", "checkpoint.enabled=false")


def _report(tmp: Path, *overrides: str) -> dict:
    summary = run(cfg_of(*RUN, "trainer.memory_report=true", *overrides), tmp)
    assert summary["status"] == "completed" and summary["steps"] == 3
    return json.loads((tmp / "memory_rank0.json").read_text())


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    """The report of checkpoint none and of full."""
    return {mode: _report(tmp_path_factory.mktemp(mode), f"+passes.options.checkpoint={mode}") for mode in ("none", "full")}


def test_state_terms_are_the_tensors(reports):
    """fp32 weights and gradients, AdamW's two moments and its step counter per tensor, no DDP."""
    params = list(bc.models.Llama(bc.models.LlamaConfig.preset("tiny")).parameters())
    numel = sum(p.numel() for p in params)
    for report in reports.values():
        assert report["params"] == 4 * numel
        assert report["grads"] == report["params"]
        assert report["optimizer"] == 2 * report["params"] + 4 * len(params)  # exp_avg, exp_avg_sq; step (fp32 scalar)
        assert report["dp_buckets"] == 0


def test_saved_activations_come_from_the_partitioned_graph(reports):
    none, full = reports["none"], reports["full"]
    for report in (none, full):
        assert report["graphs"] == 1 and len(report["saved_per_graph"]) == 1
        assert report["saved_activations"] > 0
        assert report["saved_activations"] == sum(report["saved_by_block"].values()) == report["saved_per_graph"][0]
        assert set(report["saved_by_block"]) == {"-", "layers.0", "layers.1"}
    assert full["saved_activations"] < none["saved_activations"]
    for block in ("layers.0", "layers.1"):  # full keeps a block's input only: far less than a quarter
        assert full["saved_by_block"][block] * 4 < none["saved_by_block"][block]


def test_peak_is_the_profiled_step(reports):
    """The profile sees the compiled step's allocations: at least its saved activations and its
    gradients above the start, and every byte it allocated freed again by the step's end."""
    for report in reports.values():
        assert report["profiled_step"] == 3 and report["allocator_events"] > 0 and report["compiled_during_profile"] == 0
        terms = report["baseline_terms"]
        assert terms == {"params": report["params"], "grads": 0, "optimizer": report["optimizer"], "dp_buckets": 0}
        assert report["baseline"] == sum(terms.values())
        assert report["peak"] == report["baseline"] + report["peak_above_start"]
        assert report["peak"] >= report["baseline"] and report["peak_above_start"] > 0
        assert report["peak_above_start"] >= max(report["saved_activations"], report["grads"])
        assert report["end_above_start"] == 0
    assert reports["full"]["peak_above_start"] < reports["none"]["peak_above_start"]


@pytest.fixture(scope="module")
def fsdp_reports(tmp_path_factory) -> list[dict]:
    """Both ranks' reports of FSDP2 over 2 processes, checkpoint none (the blocks compiled one by one)."""
    out = tmp_path_factory.mktemp("fsdp2")
    summary = torchrun(2, [*RUN, "parallel=fsdp2", "trainer.memory_report=true", "+passes.options.checkpoint=none"], out)
    assert summary["status"] == "completed"
    return [json.loads((out / f"memory_rank{rank}.json").read_text()) for rank in (0, 1)]


def test_fsdp2_reports_each_ranks_shards_its_blocks_saved_tensors_and_its_peak(reports, fsdp_reports):
    """Each rank holds half of every tensor (tiny's widths divide by 2), measured against one process's;
    one graph runs both blocks, and its saved bytes times its calls are the one-process blocks' on
    half the batch; the peak is the profiled step's, under one process's."""
    one = reports["none"]
    counters = one["optimizer"] - 2 * one["params"]  # AdamW's step counters: whole on every rank
    for report in fsdp_reports:
        assert report["compile_unit"] == "block" and report["dp_buckets"] == 0
        assert report["params"] == report["grads"] == one["params"] // 2
        assert report["optimizer"] == 2 * report["params"] + counters
        assert report["saved_per_graph"][0] > 0 and report["graph_calls"][0] == 2 and report["forwards"] == 1
        assert report["saved_activations"] == sum(b * c for b, c in zip(report["saved_per_graph"], report["graph_calls"], strict=True))
        blocks = (one["saved_by_block"]["layers.0"] + one["saved_by_block"]["layers.1"]) / 2
        # each block's input is the graph's (saved_inputs), the rotary tables once per call beside it
        assert report["saved_activations"] + report["saved_inputs"] == pytest.approx(blocks, rel=0.02)
        assert report["profiled_step"] == 3 and report["compiled_during_profile"] == 0
        assert report["baseline_terms"] == {"params": report["params"], "grads": 0, "optimizer": report["optimizer"],
                                            "dp_buckets": 0}
        assert report["peak"] == report["baseline"] + report["peak_above_start"]
        assert report["saved_activations"] < report["peak_above_start"] and report["peak"] < one["peak"]


def test_the_report_keeps_fsdp2s_blocks_compiled_one_by_one_and_the_rest_whole():
    from torch import nn

    from boost_compile.train.auto_layout import fsdp_allowed
    from boost_compile.train.parallel import compiles_per_block
    from boost_compile.train.validate import validate

    fsdp, _ = validate(cfg_of(*RUN, "parallel=fsdp2", "trainer.memory_report=true"), world_size=2)
    assert compiles_per_block(fsdp, nn.Module()) and fsdp_allowed(fsdp)
    ddp, _ = validate(cfg_of(*RUN, "parallel=dp2", "trainer.memory_report=true", "passes.unit=block"), world_size=2)
    assert not compiles_per_block(ddp, nn.Module())  # read from the whole model's graph, as before


def test_off_writes_no_report(tmp_path):
    summary = run(cfg_of(*RUN), tmp_path)
    assert summary["status"] == "completed"
    assert not list(tmp_path.glob("memory_rank*.json"))


def test_peak_of_is_the_running_maximum():
    records = [(0, 100, "cpu"), (1, 50, "cuda"), (2, -100, "cpu"), (3, 30, "mkldnn"), (4, -30, "cpu"), (5, -8, "cpu")]
    assert peak_of(records, "cpu") == (100, -8)
    assert peak_of(records, "cuda") == (50, 50)


def test_layout_label_and_command(tmp_path):
    layout = {"tp": 2, "pp": 1, "dp": 1, "zero": 0, "microbatches": 1, "schedule": "1f1b", "checkpoint": "none",
              "plan": "btp"}
    assert plan_measure.label(layout) == "tp2-pp1-dp1-z0-mb1-1f1b-none-btp"
    cmd = plan_measure.command(layout, tmp_path, ["model=tiny"])
    assert cmd[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    assert "parallel.microbatches=null" in cmd and "++passes.options.checkpoint=none" in cmd
    assert cmd[-2:] == [f"hydra.run.dir={tmp_path}", "model=tiny"]
    pp = plan_measure.command({"pp": 2, "dp": 2, "microbatches": 4, "checkpoint": "full"}, tmp_path, [])
    assert "--nproc-per-node" in pp and pp[pp.index("--nproc-per-node") + 1] == "4"
    assert "parallel.microbatches=4" in pp and "++passes.options.checkpoint=full" in pp
    assert "torch.distributed.run" not in plan_measure.command({}, tmp_path, [])
    hsdp = {"dp": 2, "dp_shard": 2, "reshard_after_forward": "false"}
    assert plan_measure.label(hsdp) == "tp1-pp1-dp2-z0-mb1-1f1b-none-auto-fsdp2-noreshard" and plan_measure.processes(hsdp) == 4
    cmd = plan_measure.command(hsdp, tmp_path, [])
    assert "parallel.dp_shard=2" in cmd and "parallel.reshard_after_forward=false" in cmd
    assert "parallel.dp_shard=2" not in pp
    with pytest.raises(ValueError, match="unknown layout key"):
        plan_measure.label({"tp": 1, "sp": 2})


def test_a_steady_step_leaves_out_the_compiling_warmup_and_profiled_steps(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("trainer:\n  batch: 2\n  seq: 8\n")
    times = [30.0, 6.5, 5.4, 4.9, 4.7, 5.1, 9.0]  # compiling, two settling, three steady, profiled
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "step_s": t}) + "\n" for i, t in enumerate(times)))
    steady, clean = plan_measure._step_s(tmp_path, {"tokens_per_s": 16 / 5.0}, profiled=7, warmup=2)
    assert steady == pytest.approx(5.0) and clean == [4.9, 4.7, 5.1]
    assert plan_measure._step_s(tmp_path, {}, profiled=7)[1] == [6.5, 5.4, 4.9, 4.7, 5.1]


def test_measure_one_process_and_a_failing_job(tmp_path):
    model = ["model=tiny", "passes=boost_aot_eager", "trainer.batch=4", "trainer.seq=32", "data.max_bytes=200000"]
    good, bad = plan_measure.measure([{"checkpoint": "lowrank"}, {"tp": 1, "plan": "nope"}], out_dir=tmp_path,
                                     model_overrides=model)
    assert good["error"] is None, good["error"]
    assert good["label"] == "tp1-pp1-dp1-z0-mb1-1f1b-lowrank-auto"
    (rank0,) = good["ranks"]
    assert rank0 == json.loads((tmp_path / good["label"] / "memory_rank0.json").read_text())
    assert good["memory"] == {t: rank0[t] for t in plan_measure.TERMS}
    assert good["step_s"] > 0 and good["step_s_unprofiled"] > 0
    assert len(good["steady_steps_s"]) == 1 and good["step_s_unprofiled"] == good["steady_steps_s"][0]  # step 2 of 3
    assert "boost_compile.train" in good["command"] and "trainer.memory_report=true" in good["command"]
    assert bad["error"].startswith("exit status") and "nope" in bad["error"]
    assert "memory" not in bad
