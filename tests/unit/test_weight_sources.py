"""Pretrained weights read slice by slice, factors made on the meta device, and a rank's part of a
parameter assembled from the boxes it is made of (``boost_compile/weight_sources.py``).

The one-process yardstick is the whole load: ``model.init=global_rng`` reads the folder with
``from_pretrained`` and runs ``factorize_`` on the real weights; ``model.init=per_parameter``
builds on meta and reads each parameter's slices. Their weights must be bitwise equal.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FAST, cfg_of, save_hf_folder

from boost_compile.config import ConfigError, FactorizeConfig
from boost_compile.distributed.shard import ShardSpec, shard_index, shard_tensor
from boost_compile.meta_init import InitRecipe, Step
from boost_compile.train.model import build_model, build_on_meta
from boost_compile.train.validate import validate
from boost_compile.weight_sources import SafetensorsFolder, narrowed, slice_values


def _built(overrides: list[str], init: str) -> dict[str, torch.Tensor]:
    tc, shape = validate(cfg_of(*FAST, *overrides, f"model.init={init}"))
    return dict(build_model(tc, shape, torch.device("cpu")).named_parameters(remove_duplicate=False))


@pytest.mark.parametrize(("factorize", "tie"), [
    ("svd25", True), ("none", False),
    *(pytest.param(f, t, marks=pytest.mark.extended) for f, t in (("svd25", False), ("none", True))),
], ids=["svd25-tied", "none-untied", "svd25-untied", "none-tied"])
def test_a_pretrained_folder_loads_as_from_pretrained_does(factorize, tie, tmp_path, monkeypatch):
    """Sharded bf16 safetensors, read slice by slice into fp32, factorized by SVD one layer at a
    time on meta (each layer's SVD made once, for both its factors): bitwise the whole load's
    weights, a tied head still the embedding."""
    import boost_compile.factorize as fz

    overrides = [*save_hf_folder(tmp_path / "hf", tie), f"factorize={factorize}"]
    calls = []
    real = fz.svd_factors
    monkeypatch.setattr(fz, "svd_factors", lambda w, r: calls.append(tuple(w.shape)) or real(w, r))
    sliced = _built(overrides, "per_parameter")
    assert len(calls) == (14 if factorize == "svd25" else 0)  # 2 blocks of 7 projections, one SVD each
    whole = _built(overrides, "global_rng")
    assert sorted(sliced) == sorted(whole)
    assert [n for n in sliced if not torch.equal(sliced[n], whole[n])] == []
    assert sum(".down." in n for n in sliced) == (14 if factorize == "svd25" else 0)
    assert (sliced["hf.lm_head.weight"] is sliced["hf.model.embed_tokens.weight"]) == tie


def test_a_folder_without_a_parameter_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    overrides = save_hf_folder(tmp_path / "hf")
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    tensors = load_file(files[-1])
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, files[-1], metadata={"format": "pt"})
    import json

    index = tmp_path / "hf" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"][dropped]
    index.write_text(json.dumps(data))
    tc, shape = validate(cfg_of(*FAST, *overrides))
    with pytest.raises(ConfigError, match=rf"model.pretrained: hf.{dropped} not in .*safetensors"):
        build_on_meta(tc, shape)


def test_a_folder_without_safetensors_is_loaded_whole(tmp_path, caplog):
    """pytorch_model.bin cannot be read by slice: the whole from_pretrained load, said in the log."""
    import logging

    overrides = save_hf_folder(tmp_path / "st")
    tc, shape = validate(cfg_of(*FAST, *overrides))
    reference = dict(build_model(tc, shape, torch.device("cpu")).named_parameters())
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "st")
    model.config.save_pretrained(tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    tc, shape = validate(cfg_of(*FAST, *overrides, f"model.hf_path={tmp_path / 'bin'}"))
    with caplog.at_level(logging.INFO, logger="boost_compile.train"):
        loaded = dict(build_model(tc, shape, torch.device("cpu")).named_parameters())
    assert "holds no safetensors; every rank loads it whole" in caplog.text
    assert all(torch.equal(loaded[n], reference[n]) for n in reference)


def test_a_box_reads_that_part_of_the_tensor(tmp_path):
    save_hf_folder(tmp_path / "hf")
    folder = SafetensorsFolder(tmp_path / "hf", prefix="hf.", base_prefix="model")
    name = "hf.model.layers.1.mlp.up_proj.weight"
    whole = folder.values(name)
    assert whole.dtype == torch.float32 and folder.shape(name) == whole.shape == (176, 64)
    for box in [(slice(0, 88),), (slice(88, 176), slice(16, 48)), (slice(3, 4), slice(0, 64))]:
        assert torch.equal(folder.values(name, box), whole[box])
    assert folder.has("model.norm.weight") and folder.has("hf.norm.weight") and not folder.has("hf.nothing")


def _recipe(shape: tuple[int, ...]) -> InitRecipe:
    return InitRecipe(steps={"w": [Step("normal_", (0.0, 1.0))]}, shapes={"w": torch.Size(shape)}, seed=3)


@pytest.mark.parametrize("spec", [
    dict(dim=0), dict(dim=1), dict(dim=0, sections=(24, 12, 12)), dict(dim=0, size=46),
], ids=["rows", "columns", "fused-parts", "padded"])
@pytest.mark.parametrize("fsdp", [None, (slice(0, 3),), (slice(3, 6),)], ids=["tp", "tp+fsdp-first", "tp+fsdp-last"])
def test_a_ranks_part_is_shard_tensor_of_the_whole(spec, fsdp):
    """A TP shard (``shard_tensor``'s cut, fused parts and a padded vocabulary included), cut again
    on dim 0 as FSDP2 cuts it, assembled box by box: the same numbers as cutting the whole."""
    shape = (46, 12) if "size" in spec else (48, 12)
    recipe = _recipe(shape)
    whole = recipe.values("w")
    for rank in range(2):
        s = ShardSpec("col", spec["dim"], "tp", 2, rank, "megatron", spec.get("sections"), spec.get("size"))
        expected = shard_tensor(whole, s.dim, 2, rank, s.sections, s.size is not None)
        index = [None, None]
        index[s.dim] = shard_index(s, shape[s.dim])
        if fsdp is not None:
            expected = expected[fsdp]
        got = slice_values(recipe, "w", narrowed(tuple(index), fsdp), expected.shape)
        assert torch.equal(got, expected), (spec, rank, fsdp)


def test_random_factors_are_drawn_per_parameter():
    """factorize=cola25 on meta: CoLA's N(0, r^-1/4 (d_in + d_out)^-1/4), its own stream per factor."""
    from boost_compile.factorize import factorize_
    from boost_compile.meta_init import deferred_init, materialize_
    from boost_compile.models.lowrank import cola_std

    with deferred_init(0) as recording:
        model = torch.nn.Sequential(torch.nn.Embedding(64, 256), torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    recipe = recording.recipe(model)
    report = factorize_(model, FactorizeConfig(rank_ratio=0.25, init="random"), lambda m, n: n == "1", seed=5)
    materialize_(model, report.source(recipe), "cpu")
    down, up = model[1].down.weight, model[1].up.weight
    assert down.shape == (64, 256) and up.shape == (512, 64)
    for w in (down, up):
        assert w.std().item() == pytest.approx(cola_std(256, 512, 64), rel=0.05)
    assert not torch.equal(down[:, :64].flatten()[:512], up.flatten()[:512])
    assert torch.equal(model[1].up.bias, torch.zeros(512))
