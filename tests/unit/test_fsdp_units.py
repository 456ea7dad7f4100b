"""FSDP2's units as boost-train applies them (boost_compile/train/fsdp.py): the embedding, each
block, the final norm with the head. FSDP2 shards a parameter in one unit only, so blocks that
hold one parameter between them (Zamba 2 reaches one shared transformer from several layers)
form one unit; a tied embedding and head stay in the root. Multi-process runs of these units:
tests/distributed/test_train_fsdp.py and the layout zoo's fsdp2 (boost_compile/bench/zoo_layouts.py)."""

from __future__ import annotations

import torch
from torch import nn

from boost_compile.models import Llama, LlamaConfig
from boost_compile.train.fsdp import fsdp_units


class Block(nn.Module):
    def __init__(self, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.own = nn.Linear(8, 8)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.own(x)
        return x if self.shared is None else self.shared(x)


class SharedBlocks(nn.Module):
    """Six blocks; blocks 1 and 4 reach one shared module, blocks 2 and 5 another."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        a, b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.layers = nn.ModuleList([Block(), Block(a), Block(b), Block(), Block(a), Block(b)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def test_each_block_is_a_unit_of_its_own():
    units = fsdp_units(Llama(LlamaConfig.preset("tiny")))
    assert units == [["tok_embeddings"], ["layers.0"], ["layers.1"], ["norm", "output"]], units


def test_blocks_that_share_a_parameter_form_one_unit_at_the_first_ones_place():
    units = fsdp_units(SharedBlocks())
    assert units == [["embed"], ["layers.0"], ["layers.1", "layers.4"], ["layers.2", "layers.5"], ["layers.3"],
                     ["norm", "head"]], units
    # every parameter in one unit at most: what FSDP2 requires
    model = SharedBlocks()
    owners: dict[int, set[int]] = {}
    for i, unit in enumerate(units):
        for name in unit:
            for p in model.get_submodule(name).parameters():
                owners.setdefault(id(p), set()).add(i)
    assert all(len(o) == 1 for o in owners.values())


def test_only_a_plain_embedding_skips_the_gather_for_its_backward():
    """FSDP2 gathers a unit again for its backward unless told it reads no weight there: true of
    ``nn.Embedding``'s own forward (its weight's gradient scatters the output's by token), not of a
    subclass with a forward of its own, nor under ``max_norm`` (which renormalises the weight)."""
    from boost_compile.train.fsdp import _backward_reads_no_weight

    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * self.weight.norm()

    assert _backward_reads_no_weight(nn.Embedding(8, 4))
    assert not _backward_reads_no_weight(nn.Embedding(8, 4, max_norm=1.0))
    assert not _backward_reads_no_weight(Scaled(8, 4))
    assert not _backward_reads_no_weight(nn.Linear(4, 8))
