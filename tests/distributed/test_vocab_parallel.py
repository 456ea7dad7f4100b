"""The vocabulary-parallel cross-entropy and the padded gather, over two gloo processes, against
``F.cross_entropy`` on the whole logits in one process.

The loss and every rank's slice of the logits' gradient follow the parity rule
(conftest.assert_parity) against ``F.cross_entropy`` in fp64, with fp32 ``F.cross_entropy``
as eager's yardstick (the parallel form sums exp over two halves, then adds them: a
different order of the same fp32 sums). Vocabularies 8 (divisible), 7 and 3 (padded: the
last rank holds 3 and 1 real columns), reductions mean / sum / none, targets that
hit both ranks and ``ignore_index``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import assert_parity, error_pair

from boost_compile.process_exit import exit_without_finalizing

CASES = [(v, reduction, ignore) for v in (8, 7, 3) for reduction in ("mean", "sum", "none") for ignore in (-100, 0)]


def _worker(rank: int, world: int, store: str, out: str) -> None:
    from boost_compile.distributed import collectives as c
    from boost_compile.distributed.shard import shard_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = dist.group.WORLD.group_name
    results = {}
    for vocab, reduction, ignore in CASES:
        gen = torch.Generator().manual_seed(vocab)
        logits = torch.randn(12, vocab, generator=gen) * 3
        target = torch.randint(0, vocab, (12,), generator=gen)
        target[::5] = ignore if ignore < 0 else target[::5]  # -100: some rows ignored; 0: class 0 ignored
        whole, whole64 = logits.clone().requires_grad_(), logits.double().requires_grad_()
        expected = F.cross_entropy(whole, target, ignore_index=ignore, reduction=reduction)
        truth = F.cross_entropy(whole64, target, ignore_index=ignore, reduction=reduction)
        weights = torch.linspace(0.5, 1.5, 12) if reduction == "none" else torch.tensor(1.0)
        (expected * weights).sum().backward()
        (truth * weights.double()).sum().backward()
        mine = shard_tensor(logits, 1, world, rank, pad=True).requires_grad_()
        loss = c.vocab_parallel_cross_entropy(mine, target, group, world, rank, vocab, ignore, reduction)
        (loss * weights).sum().backward()
        local = c.local_size(vocab, world)
        real = max(0, min(local, vocab - rank * local))
        grad_mine = mine.grad[:, :real]
        cols = slice(rank * local, rank * local + real)
        results[f"{vocab}-{reduction}-{ignore}"] = {
            "parity": {"loss": error_pair({"x": loss}, {"x": expected}, {"x": truth}),
                       "grad": error_pair({"x": grad_mine}, {"x": whole.grad[:, cols]}, {"x": whole64.grad[:, cols]})},
            "pad_grad": float(mine.grad[:, real:].abs().sum()),
            "local": mine.shape[1],
        }
    # the padded gather: forward cuts the padding, backward hands each rank its own columns
    x = torch.arange(2 * 7, dtype=torch.float32).view(2, 7)
    mine = shard_tensor(x, 1, world, rank, pad=True).requires_grad_()
    gathered = c.gather_from_tp(mine, group, world, rank, 1, 7)
    (gathered * torch.arange(7.0)).sum().backward()
    results["gather"] = {"equal": bool(torch.equal(gathered.detach(), x)), "grad": mine.grad.tolist()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vp")
    out = str(folder / "out.json")
    mp.spawn(_worker, args=(2, str(folder / "store"), out), nprocs=2, join=True)
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("vocab,reduction,ignore", CASES)
def test_matches_cross_entropy(results, vocab, reduction, ignore):
    r = results[f"{vocab}-{reduction}-{ignore}"]
    assert r["local"] == -(-vocab // 2)
    assert_parity(r["parity"], what=f"vocabulary {vocab}, {reduction}, ignore {ignore}")
    assert r["pad_grad"] == 0.0  # padded columns never learn


def test_padded_gather(results):
    r = results["gather"]
    assert r["equal"]
    # rank 0 holds columns 0..3: its gradient is d(sum(x * [0..6]))/dx on them
    assert r["grad"] == [[0.0, 1.0, 2.0, 3.0]] * 2


def test_shard_and_gather_round_trip():
    from boost_compile.distributed.shard import shard_tensor

    x = torch.arange(21.0).view(3, 7)
    parts = [shard_tensor(x, 1, 2, r, pad=True) for r in range(2)]
    assert [p.shape[1] for p in parts] == [4, 4]
    assert torch.equal(parts[1][:, 3], torch.zeros(3))  # the padding
    assert torch.equal(torch.cat(parts, 1)[:, :7], x)


os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
