"""boost_compile.meta_init: a model built on the meta device, its init recorded, each parameter's
values computed for any slice by the per-parameter scheme.

- any slice of a parameter is bitwise the same numbers as that part of the whole (several random
  blocks, several row groups, rows and columns cut), which is what lets every layout start alike;
- the recorded init keeps the model's distributions: the reference presets and Hugging Face models
  (each parameter against the model's own eager init: deterministic ones bitwise, random ones by
  their spread), views (an embedding's padding row), values computed on the host (Mamba's
  ``A_log``), ``nn.Linear``'s own kaiming init;
- what cannot be replayed is refused, naming the parameter and the operation;
- tied weights stay tied; the global RNG is left as it was.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from boost_compile import meta_init
from boost_compile.meta_init import MetaInitError, deferred_init, materialize_
from boost_compile.models import Llama, LlamaConfig


def _recorded(build):
    with deferred_init(seed=7) as recording:
        model = build()
    return model, recording.recipe(model)


class TruncNormal(nn.Module):
    """A weight drawn by trunc_normal_ and an nn.Linear (kaiming weight, uniform bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(37, 29))
        self.other = nn.Linear(29, 41)
        nn.init.trunc_normal_(self.weight, std=0.5, a=-1.0, b=1.0)


def test_any_slice_is_that_part_of_the_whole(monkeypatch):
    """Small blocks and row groups, so that a slice crosses several of each."""
    monkeypatch.setattr(meta_init, "BLOCK", 64)
    monkeypatch.setattr(meta_init, "CHUNK", 100)
    model, recipe = _recorded(TruncNormal)
    assert [s.op for s in recipe.steps["weight"]] == ["trunc_normal_"]
    for name in ("weight", "other.weight", "other.bias"):
        whole = recipe.values(name)
        boxes = [(slice(3, 17),), (slice(0, whole.shape[0]),), (slice(whole.shape[0] - 1, whole.shape[0]),)]
        if whole.dim() == 2:
            boxes += [(slice(5, 30), slice(2, 11)), (slice(0, whole.shape[0]), slice(20, 29))]
        for box in boxes:
            assert torch.equal(recipe.values(name, box), whole[box]), (name, box)
    assert recipe.values("weight").abs().max() <= 1.0


def test_values_depend_on_the_seed_and_the_name_only():
    _, a = _recorded(TruncNormal)
    _, b = _recorded(TruncNormal)
    assert torch.equal(a.values("weight"), b.values("weight"))
    with deferred_init(seed=8) as recording:
        other = TruncNormal()
    assert not torch.equal(recording.recipe(other).values("weight"), a.values("weight"))
    assert not torch.equal(a.values("other.weight")[:29, :29], a.values("weight")[:29, :29])


def test_the_reference_llama_keeps_its_init():
    config = LlamaConfig.preset("tiny")
    model, recipe = _recorded(lambda: Llama(config))
    assert all(p.is_meta for p in model.parameters())
    assert not model.rope_cos.is_meta  # buffers are built for real
    materialize_(model, recipe, "cpu")
    torch.manual_seed(0)
    eager = Llama(config)
    mine, theirs = dict(model.named_parameters()), dict(eager.named_parameters())
    assert sorted(mine) == sorted(theirs)
    for name, p in mine.items():
        if "norm" in name:
            assert torch.equal(p, theirs[name]), name  # ones
        else:  # N(0, std) with the preset's std (0.02, or CoLA's for the factors)
            assert p.mean().abs() < 0.1 * theirs[name].std(), name
            assert p.std().item() == pytest.approx(theirs[name].std().item(), rel=0.15), name
    assert torch.equal(model.rope_cos, eager.rope_cos)


def test_tied_weights_stay_tied():
    config = LlamaConfig.preset("tiny-dense", tie_embeddings=True)
    model, recipe = _recorded(lambda: Llama(config))
    materialize_(model, recipe, "cpu")
    assert model.output.weight is model.tok_embeddings.weight and not model.output.weight.is_meta


def test_the_global_rng_is_left_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    model, recipe = _recorded(TruncNormal)
    materialize_(model, recipe, "cpu")
    assert torch.equal(torch.get_rng_state(), before)


class Orthogonal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.empty(8, 8))
        self.untouched = nn.Parameter(torch.empty(3))
        self.kept = nn.Parameter(torch.arange(4.0))
        nn.init.orthogonal_(self.q)


def test_what_cannot_be_replayed_is_refused_by_name():
    with deferred_init(seed=0) as recording:
        model = Orthogonal()
    with pytest.raises(MetaInitError) as info:
        recording.recipe(model)
    message = str(info.value)
    assert "q (" in message and "untouched (never written" in message and "kept" not in message
    assert "model.init=global_rng" in message


class SelfScaled(nn.Module):
    """An init that writes a value computed from the parameter itself."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))
        nn.init.normal_(self.w)
        with torch.no_grad():
            self.w.copy_(self.w / self.w.norm())


def test_a_write_computed_from_the_parameter_is_refused():
    with deferred_init(seed=0) as recording:
        model = SelfScaled()
    with pytest.raises(MetaInitError, match=r"w \(copy_ from a tensor computed from a parameter\)"):
        recording.recipe(model)


def test_constructed_values_are_kept():
    class Kept(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kept = nn.Parameter(torch.arange(4.0))
            self.scaled = nn.Parameter(torch.ones(3))
            with torch.no_grad():
                self.scaled.mul_(2.5)

    model, recipe = _recorded(Kept)
    materialize_(model, recipe, "cpu")
    assert torch.equal(model.kept, torch.arange(4.0)) and torch.equal(model.scaled, torch.full((3,), 2.5))


def _eager_twice(build):
    torch.manual_seed(0)
    a = build()
    torch.manual_seed(1)
    return a, build()


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", *(pytest.param(t, marks=pytest.mark.extended)
                                                                for t in ("mixtral", "gpt2", "marian"))])
def test_hugging_face_models_keep_their_init(model_type):
    """Each parameter against the model's own eager init: those the seed does not change (norms,
    zeros, Mamba's A_log, sinusoidal positions) bitwise, the others by their spread."""
    transformers = pytest.importorskip("transformers")
    from boost_compile.bench import zoo_models

    config = zoo_models.tiny_config(model_type, {"pad_token_id": 0})
    cls = getattr(transformers, zoo_models.architectures()[model_type])
    config = zoo_models._config_for(cls, config)
    model, recipe = _recorded(lambda: cls(config))
    materialize_(model, recipe, "cpu")
    first, second = _eager_twice(lambda: cls(config))
    mine, a, b = (dict(m.named_parameters()) for m in (model, first, second))
    assert sorted(mine) == sorted(a)
    fixed = spread = 0
    for name, p in mine.items():
        if torch.equal(a[name], b[name]):
            assert torch.equal(p, a[name]), name
            fixed += 1
        elif p.numel() >= 256:
            assert p.std().item() == pytest.approx(a[name].std().item(), rel=0.2), name
            spread += 1
    assert fixed and spread
    embedding = model.get_input_embeddings().weight
    if getattr(model.get_input_embeddings(), "padding_idx", None) == 0:
        assert torch.equal(embedding[0], torch.zeros_like(embedding[0]))  # HF zeroes the padding row: a view
