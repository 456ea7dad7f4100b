"""Each data-parallel replica and pipeline stage of boost-train draws its own random numbers
(boost_compile/train/replica_streams.py); the distributed tests check the generator states each
rank saved (test_train_parallel: DP2 apart, TP2 together; test_train_pp: PP2 x TP2). A run
resumed without its saved random state does not draw its first steps' numbers again."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from boost_compile.train.checkpoint import rng_restorable
from boost_compile.train.replica_streams import replica_seed, resumed_seed, seed_replica


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


def test_a_checkpoint_restores_random_state_only_into_the_layout_that_saved_it():
    assert rng_restorable((1, 2, 2), (1, 2, 2), own=True) is None
    assert rng_restorable(None, (1, 1, 2), own=True) is None  # an older checkpoint: as before
    # one process -> TP2: rank 0 alone would take the one-process stream, rank 1 not (the TP pair split)
    assert rng_restorable((1, 1, 1), (1, 1, 2), own=True) == "saved by pp=1 dp=1 tp=1, not this layout"
    # TP2 -> DP2: ranks 0 and 1 would get the one stream the TP pair shared (the replicas alike)
    assert "not this layout" in rng_restorable((1, 1, 2), (1, 2, 1), own=True)
    assert rng_restorable((1, 2, 1), (1, 2, 1), own=False) == "no random state saved for this rank"


def test_a_one_process_checkpoint_records_its_layout_and_resumes_its_stream(tmp_path):
    """Saved in one process with a dropout model, resumed in one process: the layout is (1, 1, 1),
    and the resumed steps draw what the uninterrupted run drew (its losses, to the last bit)."""
    from conftest import FAST, cfg_of, rng_states
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from boost_compile.train import run

    base = (*FAST, "model=hf-tiny", "model.hf_config.model_type=gpt2", "passes=none", "trainer.save_every=3")
    straight = run(cfg_of(*base), tmp_path / "a")
    checkpoint = tmp_path / "a" / "checkpoints" / "step_000003"
    dcp_to_torch_save(checkpoint, tmp_path / "whole.pt")
    assert torch.load(tmp_path / "whole.pt", weights_only=False)["rng"]["layout"].tolist() == [1, 1, 1]
    assert list(rng_states(checkpoint)) == [0]
    resumed = run(cfg_of(*base, "trainer.resume=true", f"checkpoint.resume_from={checkpoint}"), tmp_path / "b")
    assert resumed["losses"] == straight["losses"][3:]


def test_resumed_seeds_are_one_per_replica_stage_and_step():
    seeds = {(dp, pp, step): resumed_seed(7, dp, pp, step) for dp in range(4) for pp in range(3) for step in (3, 6)}
    assert len(set(seeds.values())) == len(seeds)  # (0, 0) included: it gets one too
    assert not set(seeds.values()) & {replica_seed(7, dp, pp) for dp in range(4) for pp in range(3)}
    assert resumed_seed(7, 1, 0, 3) == resumed_seed(7, 1, 0, 3) != resumed_seed(8, 1, 0, 3)


def test_a_resume_without_the_saved_stream_does_not_replay_the_first_steps(tmp_path, monkeypatch):
    """A checkpoint whose random state this layout must not take (saved by another layout;
    ``rng_restorable`` is made to say so, in one process) resumed at step 3 of a dropout model:
    the generator state after step 6 is not the one the uninterrupted run had after step 3. With
    the stream left as seeded, it was that state: steps 4-6 drew steps 1-3's masks again."""
    from conftest import FAST, cfg_of, rng_states

    import boost_compile.train.checkpoint as checkpoint
    import boost_compile.train.loop as loop
    from boost_compile.train import run

    base = (*FAST, "model=hf-tiny", "model.hf_config.model_type=gpt2", "passes=none", "trainer.save_every=3")
    run(cfg_of(*base), tmp_path / "a")
    saved = tmp_path / "a" / "checkpoints" / "step_000003"
    after_step_3 = rng_states(saved)[0]
    monkeypatch.setattr(checkpoint, "rng_restorable", lambda *_args, **_kw: "saved by pp=1 dp=1 tp=2, not this layout")

    def after_step_6(folder):
        resumed = run(cfg_of(*base, "trainer.resume=true", f"checkpoint.resume_from={saved}"), folder)
        assert resumed["start_step"] == 3
        return rng_states(folder / "checkpoints" / "step_000006")[0]

    assert not torch.equal(after_step_6(tmp_path / "b"), after_step_3)
    monkeypatch.setattr(loop, "seed_resumed_replica", lambda *_args: None)  # the stream as seeded
    assert torch.equal(after_step_6(tmp_path / "c"), after_step_3)
