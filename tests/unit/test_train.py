"""boost-train in one process: config composition, validation, resume, sweeps.

Runs are tiny (preset tiny, a few steps of 4 x 32 bytes, small corpus) and use
cheap compilers (eager / boost with aot_eager). The runs on several processes are in
tests/distributed/test_train_parallel.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, cfg_of

from boost_compile.config import ConfigError
from boost_compile.train import find_checkpoint, lr_multiplier, run, write_sweep_summary
from boost_compile.train.config import GROUPS, TrainConfig, config_dir
from boost_compile.train.validate import to_train_config, tp_available, validate

REPO = Path(__file__).resolve().parents[2]

def group_options() -> list[tuple[str, str]]:
    root = config_dir()
    return [
        (group, path.stem)
        for group in (*GROUPS, "experiment")
        for path in sorted((root / group).glob("*.yaml"))
    ]

def test_config_dir_is_the_checkout():
    assert config_dir() == REPO / "hydra_conf"
    assert {p.name for p in config_dir().iterdir() if p.is_dir()} >= {*GROUPS, "experiment"}

def test_defaults_compose_to_the_schema():
    cfg = cfg_of()
    tc, shape = validate(cfg, world_size=1)
    assert isinstance(tc, TrainConfig)
    assert tc.model.preset == "tiny" and shape.llama_config.projection == "cola"
    assert tc.passes.backend == "boost" and tc.parallel.dp == tc.parallel.tp == 1
    assert tc.data.source == "stdlib" and tc.trainer.steps == 200

# Options that compose but need something more before they validate.
NEEDS_MORE = {
    ("model", "hf"): "hf_path",
    ("data", "text"): "data.paths",
    ("data", "tokens"): "data.paths",
    ("data", "hf"): "datasets" if not __import__("importlib").util.find_spec("datasets") else "data.dataset",
    ("parallel", "tp4"): "kv-heads" if tp_available() else "not available",
    ("parallel", "ep2"): "has none",  # the default preset has no experts (tests/distributed/test_train_ep.py runs it)
}

@pytest.mark.parametrize(("group", "option"), group_options(), ids=lambda v: v)
def test_every_group_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if group == "factorize" and option != "none":
        overrides.append("model=tiny-dense")  # factorization needs a dense model
    cfg = cfg_of(*overrides)
    if group != "experiment":
        assert set(cfg) == set(GROUPS)
    par = cfg.parallel
    world = par.dp * par.dp_shard * par.tp
    expected = NEEDS_MORE.get((group, option))
    if group == "parallel" and par.tp > 1 and not tp_available():
        expected = "not available"
    if expected is None:
        validate(cfg, world_size=world)
    else:
        with pytest.raises(ConfigError, match=expected):
            validate(cfg, world_size=world)

def test_schema_rejects_unknown_keys_and_types():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        cfg_of("trainer.stpes=3")
    with pytest.raises(ConfigCompositionException):
        cfg_of("trainer.steps=many")

@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.preset=cola-9000"], r"unknown preset 'cola-9000'; valid presets: tiny"),
        (["data=text", "data.paths=[/no/such/corpus.txt]"], r"data path\(s\) not found: /no/such/corpus.txt"),
        (["data=text"], r"data=text needs data.paths"),
        (["parallel=dp2"], r"needs 2 processes, but this is a single process; launch with: torchrun"),
        (["parallel=tp2dp2", "parallel.plan=vanilla"], r"parallel.plan=vanilla \(DTensor parameters\) supports parallel.dp=1 only"),
        (["+passes.options.grop.enabled=false"], r"passes.options: unknown key\(s\) \['grop'\]"),
        (["passes.options.inner=tvm"], r"inner='tvm' is not a valid inner compiler"),
        (["passes=inductor", "+passes.options.inner=eager"], r"passes.options configures backend=boost"),
        (["factorize=svd25"], r"already low-rank"),
        (["trainer.precision=fp8"], r"trainer.precision='fp8' is not valid"),
        (["+model.overrides.n_heads=3"], r"model.overrides: dim \(64\) must be divisible by n_heads \(3\)"),
        (["model=hf", "model.hf_path=/no/such/model"], r"model.hf_path='/no/such/model' does not exist"),
        (["trainer.resume=maybe"], r"trainer.resume='maybe' is not valid; choose one of False, True, auto"),
        (["parallel.timeout_s=0"], r"parallel.timeout_s must be > 0, got 0"),
    ],
)
def test_bad_values_stop_with_a_clear_message(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_of(*overrides), world_size=1)

def test_world_size_and_batch_must_fit_the_mesh():
    with pytest.raises(ConfigError, match=r"dp=2 x tp=1 = 2 ranks, but 4 processes were started"):
        validate(cfg_of("parallel=dp2"), world_size=4)
    with pytest.raises(ConfigError, match=r"trainer.batch=5 .* divisible by parallel.dp=2"):
        validate(cfg_of("parallel=dp2", "trainer.batch=5"), world_size=2)

def test_tp_degree_must_divide_the_heads():
    cfg = cfg_of("parallel.tp=3")
    if tp_available():
        message = r"parallel.tp=3 must divide the model's heads \(4\), kv-heads \(2\), ffn \(176\), dim \(64\)"
    else:
        message = r"tensor parallelism is not available in this build"
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=3)

def test_cli_reports_bad_values_before_starting(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "boost_compile.train", "model.preset=nope", f"hydra.run.dir={out}"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "boost-train: error: unknown preset 'nope'; valid presets:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()

def test_lr_schedule():
    scale = lr_multiplier(total=100, warmup=10, schedule="cosine", min_ratio=0.1)
    assert scale(0) == pytest.approx(0.1) and scale(9) == pytest.approx(1.0)
    assert scale(10) == pytest.approx(1.0) and scale(100) == pytest.approx(0.1)
    assert scale(55) == pytest.approx(0.55)
    assert lr_multiplier(100, 0, "constant", 0.1)(50) == 1.0
    assert lr_multiplier(100, 0, "linear", 0.0)(50) == pytest.approx(0.5)

def test_run_writes_metrics_plot_summary_and_checkpoints(tmp_path):
    cfg = cfg_of(*FAST, "trainer.save_every=3", "trainer.plot=true", "trainer.eval_every=3")
    result = run(cfg, tmp_path)
    assert result["status"] == "completed" and result["steps"] == 6
    assert len(result["losses"]) == 6 and result["final_loss"] < result["first_loss"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert {"lr", "tokens_per_s", "grad_norm"} <= rows[0].keys()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_loss"] == result["final_loss"] and summary["peak_mem_mib"] > 0
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert find_checkpoint(tmp_path / "checkpoints").name == "step_000006"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003", "step_000006"]

# The reference: one process, boost with aot_eager, fp32, checkpoints at steps 3 and 6.
REFERENCE = (*FAST, "passes=boost_aot_eager", "trainer.save_every=3")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    return run(cfg_of(*REFERENCE), out), out


def test_resume_matches_an_uninterrupted_run(reference, tmp_path):
    """fp32: steps 4-6 after resuming from step 3 equal the uninterrupted run's, to 1e-6."""
    straight, out = reference
    checkpoint = out / "checkpoints" / "step_000003"
    assert find_checkpoint(checkpoint) == checkpoint
    resumed = run(cfg_of(*REFERENCE, "trainer.resume=true", f"checkpoint.resume_from={checkpoint}"), tmp_path / "b")
    assert resumed["start_step"] == 3 and resumed["steps"] == 6
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], abs=1e-6, rel=0)
    # resuming with nothing to resume from is an error before anything runs
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        run(cfg_of(*REFERENCE, "trainer.resume=true"), tmp_path / "c")

def test_sigterm_saves_a_checkpoint_and_the_run_resumes(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "boost_compile.train", *FAST, "passes=none", "trainer.steps=100000", f"hydra.run.dir={out}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 2:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["signal"] == "SIGTERM"
    stopped_at = summary["steps"]
    assert find_checkpoint(out / "checkpoints").name == f"step_{stopped_at:06d}"
    assert "continue with trainer.resume=true" in output
    resumed = run(cfg_of(*FAST, "passes=none", "trainer.resume=true", f"trainer.steps={stopped_at + 2}"), out)
    assert resumed["start_step"] == stopped_at and resumed["steps"] == stopped_at + 2

@pytest.mark.parametrize(
    "overrides",
    [
        ("model=hf-tiny",),
        ("model=tiny-dense", "factorize=svd25"),
        ("trainer.precision=bf16-mixed",),
        ("data=text",),
    ],
    ids=["hf-tiny", "factorize", "bf16-mixed", "text"],
)
def test_other_models_data_and_precision_train(tmp_path, overrides):
    if "model=hf-tiny" in overrides:
        pytest.importorskip("transformers")
    extra = []
    if "data=text" in overrides:
        corpus = tmp_path / "corpus"
        corpus.mkdir()
        for i in range(3):
            (corpus / f"part{i}.txt").write_text("".join(f"line {j} of part {i}: hello world\n" for j in range(2000)))
        (corpus / "skip.bin").write_bytes(b"\0" * 100)
        extra.append(f"data.paths=[{corpus}]")
    result = run(cfg_of(*FAST, "passes=none", "trainer.steps=3", *overrides, *extra), tmp_path / "run")
    assert result["status"] == "completed" and len(result["losses"]) == 3
    assert all(0 < loss < 10 for loss in result["losses"])

def test_multirun_writes_a_summary_table(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "boost_compile.train", "-m", *FAST, "passes=none", "trainer.steps=3", "checkpoint=off",
         "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for job in ("0", "1"):
        assert (sweep / job / "summary.json").exists() and (sweep / job / "metrics.jsonl").exists()
    lines = (sweep / "summary.csv").read_text().splitlines()
    assert lines[0] == "job,config,status,steps,final_loss,val_loss,tokens_per_s,peak_mem_mib,total_s,error"
    assert len(lines) == 3 and "optim.lr=0.001" in lines[1] and "optim.lr=0.003" in lines[2]
    table = (sweep / "summary.md").read_text()
    assert "| job | config | status |" in table and table.count("| completed |") == 2
    assert "sweep summary" in proc.stdout

def test_sweep_summary_from_job_folders(tmp_path):
    for job, loss in (("1", 2.5), ("0", 3.25), ("10", 1.0)):
        (tmp_path / job).mkdir()
        (tmp_path / job / "summary.json").write_text(json.dumps(
            {"config": f"x={job}|y", "status": "completed", "steps": 5, "final_loss": loss, "val_loss": None,
             "tokens_per_s": 12345.6, "peak_mem_mib": 512.0, "total_s": 3.0}
        ))
    table = write_sweep_summary(tmp_path)
    rows = (tmp_path / "summary.csv").read_text().splitlines()[1:]
    assert [r.split(",")[0] for r in rows] == ["0", "1", "10"]
    assert "| 0 | x=0\\|y | completed | 5 | 3.2500 |  | 12,346 | 512 | 3.0 |  |" in table
    assert "best val loss" not in table  # none of the jobs evaluated

def test_to_train_config_accepts_plain_dicts():
    tc = to_train_config({"trainer": {"steps": 3}, "model": {"preset": "tiny-dense"}})
    assert tc.trainer.steps == 3 and tc.model.preset == "tiny-dense" and tc.optim.lr == 3e-3
    with pytest.raises(ConfigError, match="stpes"):
        to_train_config({"trainer": {"stpes": 3}})
