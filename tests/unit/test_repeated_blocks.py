"""analysis/repeated.py: a model's repeated blocks, and the short capture parallelize_ makes of a
deep model (its first two blocks only, the container restored however the capture ends)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from boost_compile.analysis.repeated import first_blocks, repeat_names, repeated_blocks
from boost_compile.models import Llama, LlamaConfig


def test_the_decoder_layers_are_the_repeated_blocks():
    model = Llama(LlamaConfig.preset("tiny", n_layers=5))
    assert repeated_blocks(model) == ("layers", [f"layers.{i}" for i in range(5)])
    assert repeated_blocks(nn.Linear(2, 2)) is None


def test_a_list_inside_one_layer_of_a_hybrid_stack_is_not_the_blocks():
    # Zamba 2: a numbered stack of layers of two classes; one of them holds a uniform list of
    # adapters, which would otherwise be the largest list of one class
    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.adapters = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    hybrid = nn.Module()
    hybrid.layers = nn.ModuleList([nn.Linear(4, 4), Mixer(), nn.Linear(4, 4)])
    assert repeated_blocks(hybrid) is None
    # a named container of several classes around the blocks (nanoGPT's transformer) is not a stack
    gpt = nn.Module()
    gpt.transformer = nn.ModuleDict({"wte": nn.Embedding(8, 4), "h": nn.ModuleList([Mixer(), Mixer()])})
    assert repeated_blocks(gpt) == ("transformer.h", ["transformer.h.0", "transformer.h.1"])


def test_first_blocks_shortens_the_list_while_inside_only():
    model = Llama(LlamaConfig.preset("tiny", n_layers=5))
    tokens = torch.zeros(1, 8, dtype=torch.long)
    with first_blocks(model, 2) as found:
        assert found == ("layers", [f"layers.{i}" for i in range(5)])
        assert len(model.layers) == 2 and model(tokens).shape == (1, 8, model.config.vocab_size)
    assert len(model.layers) == 5
    with pytest.raises(RuntimeError, match="inside"), first_blocks(model, 2):
        raise RuntimeError("inside")
    assert len(model.layers) == 5 and len(list(model.parameters())) == len(list(Llama(model.config).parameters()))


def test_first_blocks_leaves_shallow_models_and_other_containers_alone():
    shallow = Llama(LlamaConfig.preset("tiny"))  # two layers
    with first_blocks(shallow, 2) as found:
        assert found is None and len(shallow.layers) == 2
    stage = nn.Module()
    stage.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(4)})  # a pipeline stage's kept blocks
    with first_blocks(stage, 2) as found:
        assert found is None and len(stage.layers) == 4


def test_repeat_names_copies_the_source_block_to_the_later_ones():
    names = ["emb.weight", "layers.0.norm.weight", "layers.1.q.weight", "layers.1.norm.weight"]
    assert repeat_names(names, "layers", 1, 4) == [
        *names, "layers.2.q.weight", "layers.3.q.weight", "layers.2.norm.weight", "layers.3.norm.weight"]
    assert repeat_names(["0.w", "1.w"], "", 1, 3) == ["0.w", "1.w", "2.w"]
