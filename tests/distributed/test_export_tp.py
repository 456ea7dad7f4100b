"""boost-export of a tensor-parallel checkpoint: two gloo processes (``mp.spawn``) save a tp=2
checkpoint with the trainer's :class:`Checkpointer`; the export equals ``gather_full_state_dict``
bitwise."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
from conftest import FAST, assert_same_state, cfg_of
from omegaconf import OmegaConf

from boost_compile.export import export
from boost_compile.models import Llama
from boost_compile.process_exit import exit_without_finalizing


class _NoData:
    """What the Checkpointer saves of the data loader (this test trains no step)."""

    def state_dict(self) -> dict[str, int]:
        return {"position": 0}

def _tp_worker(rank: int, world: int, folder: str, port: int) -> None:
    """One rank of a tp=2 model: perturb the shards, save a checkpoint, gather the whole state."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    import boost_compile as bc
    from boost_compile.train import (
        Checkpointer,
        build_model_parts,
        make_optimizer,
        setup_distributed,
    )
    from boost_compile.train.validate import validate

    root = Path(folder)
    tc, shape = validate(OmegaConf.load(root / ".hydra" / "config.yaml"), world_size=world)
    dev = setup_distributed(tc)
    try:
        example = torch.randint(0, 256, (tc.trainer.batch, tc.trainer.seq), generator=torch.Generator().manual_seed(0))
        model = build_model_parts(tc, shape, dev, example).model
        noise = torch.Generator().manual_seed(1)
        with torch.no_grad():  # trained-looking weights: each shard moves differently
            for p in model.parameters():
                spec = getattr(p, "_boost_tp", None)
                scale = 0.01 * (1 + dev.tp_rank if spec is not None and spec.dim is not None else 1)
                p.add_(scale * torch.randn(p.shape, generator=noise))
        optimizer, scheduler = make_optimizer(model, tc.optim, tc.trainer.steps)
        ckpt = Checkpointer(tc.checkpoint, root / "checkpoints", dev, model, optimizer, scheduler, _NoData())
        ckpt.save(5)
        full = bc.gather_full_state_dict(model)
        sharded = [n for n, p in model.named_parameters() if getattr(getattr(p, "_boost_tp", None), "dim", None) is not None]
        if rank == 0:
            torch.save({"full": full, "sharded": sharded}, root / "full.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)

def test_tp2_checkpoint_exports_the_gathered_model(tmp_path):
    from boost_compile.train.validate import tp_available

    if not tp_available():
        pytest.skip("boost_compile.parallelize_ is not in this build")
    import torch.multiprocessing as mp

    cfg = cfg_of(*FAST, "trainer.steps=2", "model=tiny", "parallel=tp2", "passes=boost_aot_eager")
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, str(tmp_path), port), nprocs=2, join=True)
    saved = torch.load(tmp_path / "full.pt")
    assert len(saved["sharded"]) > 10  # the btp plan sharded the bottlenecks, the embedding, ...

    info = export(tmp_path, tmp_path / "out")
    assert info["format"] == "boost_llama" and info["step"] == 5
    loaded = Llama.from_pretrained(tmp_path / "out")
    full = {n: t for n, t in saved["full"].items() if n in dict(loaded.named_parameters())}
    assert_same_state(full, loaded)
