"""boost-train refuses a config key its schema does not declare, with or without Hydra's ``+``.

``+key=value`` gets past the struct check of the composed config; without this refusal the
key would be dropped when the config becomes a ``TrainConfig`` and the run would train with
the default. The free-form (dict-typed) fields keep taking new keys.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time

import pytest
from conftest import FAST, cfg_of

from boost_compile.config import ConfigError
from boost_compile.train import run
from boost_compile.train.config import GROUPS, OptimConfig, TrainConfig, TrainerConfig, config_dir
from boost_compile.train.validate import check_known_keys, to_train_config, validate


def keys_listed(message: str, where: str) -> set[str]:
    """The keys a refusal lists after ``the keys of <where>:``."""
    m = re.search(rf"the keys of {re.escape(where)}: ([^;]+);", message)
    assert m, message
    return set(m.group(1).split(", "))


@pytest.mark.parametrize(
    ("override", "key", "nearest"),
    [
        ("+optim.lrr=0.5", "optim.lrr", "optim.lr"),
        ("+trainer.stpes=9", "trainer.stpes", "trainer.steps"),
        ("+parallel.tpp=2", "parallel.tpp", "parallel.tp"),
        ("+data.max_byte=10", "data.max_byte", "data.max_bytes"),
        ("+Optim.lr=0.5", "Optim.lr", "optim.lr"),  # a misspelt group: the suggestion keeps the key below it
    ],
)
def test_a_misspelt_key_is_refused_naming_the_nearest(override, key, nearest):
    with pytest.raises(ConfigError) as info:
        to_train_config(cfg_of(override))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"unknown config key {key} "), message
    assert f"did you mean {nearest}" in message, message
    assert "+" in message.rsplit(";", 1)[1], message  # says that the + is not what is wrong


def test_the_refusal_lists_the_group_keys():
    with pytest.raises(ConfigError) as info:
        validate(cfg_of("+optim.lrr=0.5"), world_size=1)
    assert keys_listed(str(info.value), "optim") == {f.name for f in dataclasses.fields(OptimConfig)}


def test_a_key_with_no_near_match_is_refused():
    with pytest.raises(ConfigError) as info:
        to_train_config(cfg_of("+trainer.gradient_accumulation_steps=4"))
    message = str(info.value)
    assert message.startswith("unknown config key trainer.gradient_accumulation_steps;"), message
    assert "did you mean" not in message
    assert keys_listed(message, "trainer") == {f.name for f in dataclasses.fields(TrainerConfig)}


def test_a_new_top_level_group_is_refused():
    with pytest.raises(ConfigError) as info:
        to_train_config(cfg_of("+foo.bar=1"))
    message = str(info.value)
    assert message.startswith("unknown config key foo.bar "), message
    assert "has no key foo" in message
    assert keys_listed(message, "the config") == set(GROUPS)


def test_plain_dicts_get_the_same_refusal():
    with pytest.raises(ConfigError, match=r"^unknown config key optim\.lrr \(did you mean optim\.lr\?\)"):
        to_train_config({"optim": {"lrr": 0.5}})
    with pytest.raises(ConfigError, match=r"^unknown config key parallel\.tpp "):
        check_known_keys({"trainer": {"steps": 3}, "parallel": {"dp": 1, "tpp": 2}})
    check_known_keys({"trainer": {"steps": 3}, "model": {"overrides": {"anything": 1}}})


def test_run_refuses_before_it_starts(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^unknown config key optim\.lrr "):
        run(cfg_of(*FAST, "+optim.lrr=0.5"), out)
    assert not out.exists()


@pytest.mark.parametrize(
    ("overrides", "where", "expected"),
    [
        (["+model.overrides.n_layers=3"], ("model", "overrides"), {"n_layers": 3}),
        (["model=hf-tiny", "+model.hf_config.rms_norm_eps=0.001"], ("model", "hf_config", "rms_norm_eps"), 0.001),
        (["+passes.options.group.enabled=false"], ("passes", "options", "group"), {"enabled": False}),
    ],
)
def test_free_form_fields_take_new_keys(overrides, where, expected):
    tc, _ = validate(cfg_of(*overrides), world_size=1)
    value = getattr(getattr(tc, where[0]), where[1])
    for name in where[2:]:
        value = value[name]
    assert value == expected


def test_a_free_form_key_reaches_the_run(tmp_path):
    """``+model.overrides.n_layers=3``: the run trains a three-block model (the tiny preset has two)."""
    from torch.distributed.checkpoint import FileSystemReader

    out = tmp_path / "run"
    summary = run(cfg_of(*FAST, "trainer.steps=1", "+model.overrides.n_layers=3", "checkpoint.at_end=true"), out)
    assert summary["status"] == "completed"
    (step,) = sorted((out / "checkpoints").glob("step_*"))
    names = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    blocks = {int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    assert blocks == {0, 1, 2}


def test_hydras_own_node_is_not_refused():
    from hydra import compose, initialize_config_dir

    from boost_compile.train.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=rank_sweep"], return_hydra_config=True)
    assert "hydra" in cfg
    tc = to_train_config(cfg)
    assert isinstance(tc, TrainConfig) and not hasattr(tc, "hydra")
    assert tc.model.preset == "tiny-dense"  # the experiment's choice, not the default


def test_cli_prints_one_line_and_exits_non_zero(tmp_path):
    out = tmp_path / "run"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "boost_compile.train", *FAST, "trainer.steps=1", "+optim.lrr=0.5", f"hydra.run.dir={out}"],
        capture_output=True, text=True, timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("boost-train: error: unknown config key optim.lrr (did you mean optim.lr?)")
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert elapsed < 30, elapsed  # refused before any data, model or compile


# ----------------------------------------------------------------------------- shipped configs


def shipped_options() -> list[tuple[str, str]]:
    root = config_dir()
    return [(g, p.stem) for g in (*GROUPS, "experiment") for p in sorted((root / g).glob("*.yaml"))]


@pytest.mark.parametrize(("group", "option"), shipped_options(), ids=lambda v: v)
def test_shipped_configs_hold_only_declared_keys(group, option):
    """Every option of every group, and every experiment, composes to keys the schema declares;
    validation may refuse one for what it needs besides (an hf_path, a second process), never
    for an unknown key."""
    cfg = cfg_of(f"{group}={option}")
    check_known_keys(cfg)
    tc = to_train_config(cfg)
    par = tc.parallel
    try:
        validate(tc, world_size=par.pp * par.dp * par.tp)
    except ConfigError as exc:
        assert "unknown config key" not in str(exc)
