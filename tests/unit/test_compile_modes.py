"""torch.compile's ``mode=`` and Inductor's own options under ``backend="boost"``.

A mode reaches the inner Inductor compile as the config values Inductor itself uses for it
(``torch._inductor.list_mode_options``, read here, not from the backend), and
``options["inductor"]`` adds Inductor config values on top. The spy tests replace the
inner ``compile_fx`` with one that records its ``config_patches`` and runs the graph as it
is; the slow tests run Inductor: parity under ``mode="max-autotune"`` and the FX graph cache
keeping option sets apart.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch._inductor as inductor
import torch._inductor.config as inductor_config
from conftest import check_against_eager
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import boost_compile
from boost_compile import _torch_compat as compat
from boost_compile.backend import boost_backend
from boost_compile.config import BoostConfig, ConfigError
from boost_compile.models import Llama, LlamaConfig
from boost_compile.pass_manager import AtenPipeline

MODES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
#: the Inductor settings the backend sets for its own passes, whatever the mode
OWN_KEYS = {"post_grad_custom_post_pass", "custom_partitioner_fn"}  # what the backend itself sets


@pytest.fixture
def patches_seen(monkeypatch) -> list[dict[str, Any]]:
    """The ``config_patches`` of every inner Inductor compile; the graph then runs uncompiled."""
    seen: list[dict[str, Any]] = []

    def spy(gm, example_inputs, config_patches=None, **_kwargs):
        seen.append(dict(config_patches or {}))
        return gm.forward

    monkeypatch.setattr(compat, "compile_fx", spy)
    return seen


def _run(compiled) -> None:
    torch.manual_seed(0)
    compiled(torch.randn(3, 8)).sum().backward()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _settings(patches: dict[str, Any]) -> dict[str, Any]:
    """The patches less the backend's own pass hooks."""
    return {k: v for k, v in patches.items() if k not in OWN_KEYS}


def _inner_error(err: BaseException) -> BaseException:
    return getattr(err, "inner_exception", err)  # Dynamo wraps a backend's error


# --- what reaches compile_fx --------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_torch_compile_mode_becomes_inductors_settings(mode: str, patches_seen) -> None:
    _run(torch.compile(_mlp(), backend="boost", mode=mode))
    (patches,) = patches_seen
    assert _settings(patches) == inductor.list_mode_options(mode)
    # the mode does not push the backend's own ATen passes out
    assert isinstance(patches["post_grad_custom_post_pass"], AtenPipeline)


def test_modes_differ_from_default() -> None:
    """Guard for the test above: the non-default modes really set something, differently."""
    settings = [inductor.list_mode_options(m) for m in MODES]
    assert settings[0] == {} and all(settings[1:])
    assert len({tuple(sorted(s.items())) for s in settings}) == len(MODES)


def test_options_give_mode_and_inductor_together(patches_seen) -> None:
    options = {"mode": "max-autotune", "inductor": {"triton.cudagraphs": False, "epilogue_fusion": False}}
    _run(torch.compile(_mlp(), backend="boost", options=options))
    expected = {**inductor.list_mode_options("max-autotune"), "triton.cudagraphs": False, "epilogue_fusion": False}
    assert _settings(patches_seen[0]) == expected
    assert expected["max_autotune"] is True  # the mode's other settings stay


def test_nested_inductor_dict_is_read_as_dotted_keys(patches_seen) -> None:
    """Hydra's ``++passes.options.inductor.triton.cudagraphs=false`` arrives nested."""
    _run(torch.compile(_mlp(), backend="boost", options={"inductor": {"triton": {"cudagraphs": False}}}))
    assert _settings(patches_seen[0]) == {"triton.cudagraphs": False}


def test_python_api_takes_mode_with_options(patches_seen) -> None:
    _run(boost_compile.compile(_mlp(), {"inductor": {"max_autotune": False}}, mode="max-autotune"))
    assert _settings(patches_seen[0]) == {**inductor.list_mode_options("max-autotune"), "max_autotune": False}


def test_torch_refuses_mode_and_options_together() -> None:
    """Why ``options["mode"]`` exists: torch.compile takes one or the other."""
    with pytest.raises(RuntimeError, match="mode or options"):
        torch.compile(_mlp(), backend="boost", mode="max-autotune", options={"inductor": {}})


def test_backend_refuses_two_different_modes() -> None:
    backend = functools.partial(boost_backend, options={"mode": "reduce-overhead"})
    with pytest.raises(Exception) as info:
        _run(torch.compile(_mlp(), backend=backend, mode="max-autotune"))
    err = _inner_error(info.value)
    assert isinstance(err, ConfigError) and "reduce-overhead" in str(err) and "max-autotune" in str(err), err


# --- refusals -----------------------------------------------------------------------


def test_unknown_inductor_key_names_close_matches() -> None:
    compiled = torch.compile(_mlp(), backend="boost", options={"inductor": {"max_autotun": True}})
    with pytest.raises(Exception) as info:
        _run(compiled)
    err = _inner_error(info.value)
    assert isinstance(err, ConfigError), repr(info.value)
    message = str(err)
    assert "inductor.max_autotun" in message and "'max_autotune'" in message, message
    assert "\n" not in message
    assert "max_autotune" in inductor_config.get_config_copy()  # the suggestion is a real key


@pytest.mark.parametrize(
    ("inductor_options", "words"),
    [
        pytest.param({"triton": {"cudagraph": True}}, ["inductor.triton.cudagraph", "'triton.cudagraphs'"], id="nested-typo"),
        pytest.param({"max_autotune": "yes"}, ["inductor.max_autotune", "wrong type", "bool"], id="wrong-type"),
        pytest.param({"post_grad_custom_post_pass": None}, ["post_grad_custom_post_pass", "boost"], id="boost-owned"),
        pytest.param({"use_post_grad_passes": False}, ["use_post_grad_passes", "its ATen passes"], id="passes-off"),
    ],
)
def test_bad_inductor_options_refused(inductor_options: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        BoostConfig.from_options({"inductor": inductor_options})
    missing = [w for w in words if w not in str(info.value)]
    assert not missing, f"{missing} not in {info.value}"


@pytest.mark.parametrize("inner", ["aot_eager", "eager"])
def test_mode_without_inductor_refused(inner: str) -> None:
    with pytest.raises(ConfigError) as info:
        boost_compile.compile(_mlp(), {"inner": inner}, mode="max-autotune")
    message = str(info.value)
    assert "max-autotune" in message and inner in message and "\n" not in message, message
    with pytest.raises(ConfigError, match=f"inner='{inner}'"):
        BoostConfig.from_options({"inner": inner, "inductor": {"max_autotune": True}})
    # the default mode asks nothing of Inductor, so it stays valid everywhere
    assert BoostConfig.from_options({"inner": inner, "mode": "default"}).inner == inner


@pytest.mark.parametrize("mode", ["lite", "fast"])
def test_other_modes_refused(mode: str) -> None:
    with pytest.raises(ConfigError, match=f"mode='{mode}'.*max-autotune"):
        BoostConfig.from_options({"mode": mode})


def test_boost_train_options_carry_mode_and_inductor() -> None:
    from conftest import cfg_of

    from boost_compile.train.validate import boost_options, validate

    tc, *_ = validate(cfg_of("++passes.options.mode=max-autotune", "++passes.options.inductor.triton.cudagraphs=false"),
                      world_size=1)
    config = boost_options(tc.passes)
    assert config.mode == "max-autotune" and config.inductor == {"triton.cudagraphs": False}
    with pytest.raises(ConfigError, match=r"passes.options: inductor.max_autotun .*'max_autotune'"):
        validate(cfg_of("++passes.options.inductor.max_autotun=true"), world_size=1)
    with pytest.raises(ConfigError, match=r"passes.options: mode='max-autotune' .* inner='aot_eager'"):
        validate(cfg_of("++passes.options.mode=max-autotune", "passes.options.inner=aot_eager"), world_size=1)


# --- the cache key ------------------------------------------------------------------


def test_option_sets_give_different_inductor_config(patches_seen) -> None:
    """Each option set is a distinct Inductor config (what Inductor hashes into its cache key)."""
    option_sets = [{}, {"mode": "max-autotune"}, {"mode": "max-autotune-no-cudagraphs"},
                   {"inductor": {"max_autotune": True}}, {"mode": "max-autotune", "inductor": {"triton.cudagraphs": False}}]
    for options in option_sets:
        torch._dynamo.reset()
        _run(torch.compile(_mlp(), backend="boost", options=options))
    settings = [tuple(sorted(_settings(p).items())) for p in patches_seen]
    assert len(settings) == len(option_sets) and len(set(settings)) == len(option_sets), settings
    assert BoostConfig.from_options(option_sets[1]).to_dict() != BoostConfig.from_options(option_sets[2]).to_dict()


@pytest.mark.slow
def test_fx_graph_cache_keeps_option_sets_apart() -> None:
    """Same model, fresh cache: a compile under other Inductor options misses; the first set hits again."""
    option_sets = [{}, {"mode": "max-autotune-no-cudagraphs"}, {"inductor": {"epilogue_fusion": False}}, {}]
    runs = []
    with inductor_config.patch(fx_graph_cache=True), fresh_cache():
        for options in option_sets:
            torch._dynamo.reset()
            counters.clear()
            _run(torch.compile(_mlp(), backend="boost", options=options))
            runs.append(dict(counters["inductor"]))
    *fresh, again = runs
    for options, run in zip(option_sets, fresh, strict=False):
        assert run.get("fxgraph_cache_miss", 0) >= 2 and run.get("fxgraph_cache_hit", 0) == 0, (options, run)
    assert again.get("fxgraph_cache_hit", 0) >= 2 and again.get("fxgraph_cache_miss", 0) == 0, again


# --- parity -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.extended
def test_max_autotune_parity_on_cpu() -> None:
    """``torch.compile(model, backend="boost", mode="max-autotune")`` on the tiny CoLA model:
    the loss and every gradient follow the parity rule (conftest.assert_parity)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny"))
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, 256, (2, 16), generator=gen) for _ in range(2))
    check_against_eager(model, lambda m: torch.compile(m, backend="boost", mode="max-autotune", fullgraph=True),
                        lambda m, _x: m(tokens, targets), what="mode=max-autotune")
