"""Each data-parallel replica and pipeline stage of boost-train draws its own random numbers
(boost_compile/train/replica_streams.py); the distributed tests check the generator states each
rank saved (test_train_parallel: DP2 apart, TP2 together; test_train_pp: PP2 x TP2)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from boost_compile.train.replica_streams import replica_seed, seed_replica


def test_every_replica_and_stage_but_the_first_gets_its_own_seed():
    seeds = {(dp, pp): replica_seed(7, dp, pp) for dp in range(16) for pp in range(8)}
    assert seeds.pop((0, 0)) is None  # one process (and rank 0) keeps the stream it has
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds.values())
    assert replica_seed(7, 1, 0) == replica_seed(7, 1, 0) != replica_seed(8, 1, 0)
    assert replica_seed(7, 1, 0) != replica_seed(7, 0, 1)  # dp 1 of stage 0 is not dp 0 of stage 1


def masks(dp_rank: int, pp_rank: int) -> tuple[torch.Tensor, float]:
    """The dropout mask and Python draw a rank gets after seeding its replica's stream."""
    torch.manual_seed(0)
    random.seed(0)
    seed_replica(0, dp_rank, pp_rank)
    return F.dropout(torch.ones(64, 64), 0.5) != 0, random.random()


def test_replicas_draw_different_masks_and_tp_ranks_of_one_replica_the_same():
    first, first_py = masks(0, 0)
    torch.manual_seed(0)
    random.seed(0)
    assert torch.equal(first, F.dropout(torch.ones(64, 64), 0.5) != 0)  # (0, 0): the run's own stream
    assert first_py == random.random()
    for other in ((1, 0), (0, 1), (3, 2)):
        mask, py = masks(*other)
        assert not torch.equal(mask, first) and py != first_py, other
        assert torch.equal(mask, masks(*other)[0])  # the same coordinates (two TP ranks): one stream
