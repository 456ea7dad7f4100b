"""backend="boost" is found through its entry point, and bad options fail clearly."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

import boost_compile
from boost_compile import ConfigError
from boost_compile.config import INNER_COMPILERS, BoostConfig

MARKER = "BOOST_ENTRY_POINT_OK"

FRESH_PROCESS_CODE = textwrap.dedent(
    f"""
    import sys
    import torch
    import torch._dynamo

    assert "boost_compile" not in sys.modules, "boost_compile was imported too early"
    assert "boost" in torch._dynamo.list_backends(), torch._dynamo.list_backends()

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)
    )
    x = torch.randn(3, 8)
    expected = model(x)
    compiled = torch.compile(model, backend="boost", options={{"inner": "eager"}})
    got = compiled(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # the backend really ran: Dynamo imported the package through the entry point
    assert "boost_compile.backend" in sys.modules
    print("{MARKER}")
    """
)


def test_entry_point_in_fresh_process(tmp_path) -> None:
    # cwd=tmp_path: boost_compile can only come from the installed package
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS_CODE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert MARKER in result.stdout, result.stdout + result.stderr


def _field_names() -> list[str]:
    """The valid top-level option keys (the message of an unknown key must list them)."""
    return [f.name for f in dataclasses.fields(BoostConfig)]


# (options, words the error message must contain)
BAD_OPTIONS = [
    pytest.param({"inner": "eager", "bogus": 1}, ["bogus", *_field_names()], id="unknown-key"),
    pytest.param({"inner": "tvm"}, ["tvm", *INNER_COMPILERS], id="bad-inner"),
    pytest.param({"tp": {"norm_statistic": "fp8"}}, ["tp.norm_statistic", "fp8", "packed", "separate"], id="bad-norm-statistic"),
    pytest.param({"inner": 3}, ["inner", "wrong type", "str"], id="inner-wrong-type"),
    pytest.param({"strict": "yes"}, ["strict", "wrong type", "bool"], id="strict-wrong-type"),
    pytest.param(
        {"analysis": {"bottleneck_max_ratio": "half"}},
        ["analysis.bottleneck_max_ratio", "wrong type", "float"],
        id="nested-wrong-type",
    ),
    pytest.param(
        {"analysis": {"foo": 1}}, ["foo", "analysis", "bottleneck_max_ratio"], id="nested-unknown"
    ),
    pytest.param(
        {"factorize": {"rank": 8, "rank_ratio": 0.25}},
        ["exactly one of", "rank", "rank_ratio", "param_ratio"],
        id="factorize-two-ranks",
    ),
]


def _assert_mentions(message: str, words: list[str]) -> None:
    missing = [w for w in words if w not in message]
    assert not missing, f"error message lacks {missing}: {message!r}"


@pytest.mark.parametrize(("options", "words"), BAD_OPTIONS)
def test_from_options_rejects(options, words) -> None:
    with pytest.raises(ConfigError) as info:
        BoostConfig.from_options(options)
    _assert_mentions(str(info.value), words)


@pytest.mark.parametrize(("options", "words"), BAD_OPTIONS)
def test_python_api_rejects_at_compile_call(options, words) -> None:
    with pytest.raises(ConfigError) as info:
        boost_compile.compile(torch.nn.Linear(4, 4), options)
    _assert_mentions(str(info.value), words)


@pytest.mark.parametrize(("options", "words"), BAD_OPTIONS)
def test_torch_compile_surfaces_config_error(options, words) -> None:
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="boost", options=options)
    # the backend runs, and validates, on the first call
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, 4))
    err = info.value
    inner = getattr(err, "inner_exception", err)  # Dynamo wraps it in BackendCompilerFailed
    assert isinstance(inner, ConfigError), repr(err)
    assert "ConfigError" in str(err)
    _assert_mentions(str(err), words)


def test_options_must_be_a_dict() -> None:
    with pytest.raises(ConfigError, match="dict or BoostConfig"):
        BoostConfig.from_options(["inner", "eager"])


def test_good_options_accepted() -> None:
    config = BoostConfig.from_options(
        {
            "inner": "eager",
            "analysis": {"bottleneck_max_ratio": 0.25},
            "op_census": {"enabled": False},
        }
    )
    assert config.inner == "eager"
    assert config.analysis.bottleneck_max_ratio == 0.25
    assert config.op_census.enabled is False
    assert config.factorize is None


def test_unknown_mode_is_rejected_clearly() -> None:
    """torch.compile's modes are accepted (tests/unit/test_compile_modes.py); another name is not."""
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="boost", mode="fastest")
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, 4))
    assert isinstance(getattr(info.value, "inner_exception", info.value), ConfigError), repr(info.value)
    _assert_mentions(str(info.value), ["boost", "mode", "fastest", "max-autotune", "reduce-overhead"])
