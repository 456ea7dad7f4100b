"""Where a TP rank's shard lies in the whole tensor (``checkpoint_shards.shard_layout``), checked
against how ``shard_tensor`` cuts it, without a process group: a plain shard, a fused weight cut
part by part (``[q_r | k_r | v_r]``, one run per part) and a padded vocabulary (one run, then zeros).
A one-run shard is saved as a DTensor ``Shard``, so its offset must be the one DTensor computes, and
what DCP loads into it must come back as the live shard. The torchrun runs that save and resume
these through boost-train are tests/distributed/test_checkpoint_tp.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from boost_compile.distributed.shard import ShardSpec, shard_tensor
from boost_compile.train.checkpoint_shards import shard_layout, with_padding

#: (name, whole shape, dim, sections, padded): each cut for 2, 3 and 4 ranks where it divides
CASES = [
    ("plain", (12, 5), 0, None, False),
    ("fused", (6, 24), 1, (12, 6, 6), False),  # GQA-like: q wider than k and v
    ("fused bias", (36,), 0, (12, 12, 12), False),
    ("padded", (13, 4), 0, None, True),
    ("padded, a rank past the end", (5, 3), 0, None, True),  # 4 ranks: 2, 2, 1, 0 rows
]


def _spec(dim: int, world: int, rank: int, sections: tuple[int, ...] | None, size: int | None) -> ShardSpec:
    return ShardSpec("col", dim, "tp", world, rank, "megatron", sections, size)


def _cuts():
    for name, shape, dim, sections, padded in CASES:
        for world in (2, 3, 4):
            if not padded and any(s % world for s in (sections or (shape[dim],))):
                continue
            yield pytest.param(shape, dim, world, sections, padded, id=f"{name}-tp{world}")


@pytest.mark.parametrize(("shape", "dim", "world", "sections", "padded"), list(_cuts()))
def test_layout_places_each_run_of_the_shard_in_the_whole(shape, dim, world, sections, padded):
    whole = torch.arange(1, torch.Size(shape).numel() + 1, dtype=torch.float32).reshape(shape)  # no zero
    covered = torch.zeros(shape[dim], dtype=torch.int64)
    for rank in range(world):
        shard = shard_tensor(whole, dim, world, rank, sections, padded)
        spec = _spec(dim, world, rank, sections, shape[dim] if padded else None)
        layout = shard_layout(spec, shard.shape[dim])
        assert layout.whole == shape[dim] and layout.local == shard.shape[dim]
        if sections:
            assert len(layout.chunks) == len(sections)
        padding = torch.ones(shard.shape[dim], dtype=torch.bool)
        for c in layout.chunks:
            assert torch.equal(shard.narrow(dim, c.local, c.length), whole.narrow(dim, c.start, c.length))
            covered[c.start : c.start + c.length] += 1
            padding[c.local : c.local + c.length] = False
        assert not shard.index_select(dim, padding.nonzero().flatten()).any()  # the rows no chunk covers are zeros
        if len(layout.chunks) == 1:  # saved as a DTensor Shard: its offset is torch.chunk's, as DTensor computes it
            (c,) = layout.chunks
            assert (c.length, c.start) == Shard.local_shard_size_and_offset(shape[dim], world, rank)
            # what DCP loads into that run, back as the live shard (padding zeros re-added)
            assert torch.equal(with_padding(whole.narrow(dim, c.start, c.length), spec, shard.shape), shard)
    assert covered.eq(1).all(), covered  # every row of the whole saved by exactly one rank


def test_a_shard_of_another_size_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        shard_layout(_spec(1, 2, 0, (12, 6, 6), None), 10)
    with pytest.raises(ValueError, match="does not fit"):
        shard_layout(_spec(0, 2, 1, None, 13), 6)
