"""boost-train with FSDP2 (``parallel.dp_shard``, train/fsdp.py) against one process: the blocks
compiled one by one by the boost backend, then ``fully_shard`` per block, the embedding, the
final norm with the head, and the root (torchrun on 127.0.0.1, gloo).

- FSDP2 over 2 ranks, each rank's 2 sequences as 2 micro-steps of gradient accumulation (one
  reduce-scatter per step), gradients clipped over the sharded gradients (trainer=quick clips
  at 1.0), and with low-rank activation checkpointing; FSDP2 over 4 ranks;
- HSDP over 4 ranks (2 replicas x 2 shards), and TP2 btp x FSDP2 2 (FSDP2 shards each TP
  shard), each with checkpoint=none and lowrank;
- checkpoints written by FSDP2 resume exactly in FSDP2, and in one process and in DDP (DP2)
  within the parity rule; a DDP checkpoint resumes under FSDP2; TP2 x FSDP2's resume exactly
  and in one process;
- a profile: the next block's all-gather issued during this block's forward, the first
  reduce-scatter before the backward ends.

Every run's per-step losses, gradient norms and val loss follow the parity rule (conftest)
against one-process eager runs of the same config in fp32 and fp64. Per rank, the parameters,
gradients and AdamW state are measured (``state_mib``: each rank's local shards) against one
process's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import (
    AT_START,
    FAST,
    TINY_TENSORS,
    assert_starts_like_one_process,
    assert_train_parity,
    cfg_of,
    rng_states,
    torchrun,
    train_references,
)

from boost_compile.config import ConfigError
from boost_compile.train import run
from boost_compile.train.metrics import read_metrics
from boost_compile.train.validate import validate

ONE = (*FAST, "model=tiny", "passes=boost_aot_eager", "trainer.save_every=3")
FSDP2 = (*ONE, "parallel=fsdp2", "trainer.local_batch=1")


def params_logged(run_dir: Path) -> str:
    """The parameter count boost-train logs (the MFU's), from its train.log."""
    return re.search(r"params=([\d,]+)", (run_dir / "train.log").read_text()).group(1)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return train_references((*FAST, "model=tiny"), tmp_path_factory.mktemp("references"))


@pytest.fixture(scope="module")
def single(references):
    """One process's run (the fp32 reference): the per-rank state FSDP2 is measured against (the
    bytes of weights, gradients and AdamW state do not depend on the backend)."""
    return references[0]


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """FSDP2 over 2 ranks with gradient accumulation; checkpoints at steps 0 (the starting weights),
    3 and 6."""
    return torchrun(2, [*FSDP2, *AT_START], tmp_path_factory.mktemp("fsdp2") / "run")


def test_fsdp2_matches_single_process(fsdp2, references):
    assert fsdp2["world"] == 2 and fsdp2["steps"] == 6
    assert_train_parity(fsdp2, references, "fsdp2, 2 micro-steps")
    log = (Path(fsdp2["run_dir"]) / "train.log").read_text()
    assert "compiled 2 blocks one by one" in log
    # units: the embedding, each block, the final norm with the head; then the root
    assert "FSDP2 over 2: 4 units (tok_embeddings ... norm+output) and the root" in log
    assert "FSDP2: tok_embeddings is not gathered again for its backward" in log
    assert "FSDP2 on host memory: all-gathers and reduce-scatters in place" in log
    # each data rank draws its own random numbers (its own dropout masks), as DDP's replicas do
    states = rng_states(Path(fsdp2["run_dir"]) / "checkpoints" / "step_000006")
    assert sorted(states) == [0, 1] and not torch.equal(states[0], states[1])
    # built on meta, sharded, then each rank materialised its own shards: one process's weights
    assert "materialised" in log
    assert assert_starts_like_one_process(Path(fsdp2["run_dir"])) == TINY_TENSORS


@pytest.mark.extended
def test_fsdp2_holds_half_of_one_process_state(fsdp2, single):
    """Weights, gradients and AdamW state per rank (measured: the bytes of each rank's local
    shards) within 10% of half of one process's."""
    mine, whole = fsdp2["state_mib"], single["state_mib"]
    print(f"per rank, MiB: one process {whole}; FSDP2 over 2 {mine}")
    for term in ("params", "grads", "optimizer"):
        assert mine[term] == pytest.approx(whole[term] / 2, rel=0.10), term


@pytest.mark.extended
def test_fsdp2_with_lowrank_checkpointing(references, tmp_path):
    run_ = torchrun(2, [*FSDP2, "++passes.options.checkpoint=lowrank", "checkpoint.enabled=false"], tmp_path / "ckpt")
    assert_train_parity(run_, references, "fsdp2, checkpoint=lowrank")


@pytest.mark.extended
def test_hsdp_2x2_matches_single_process(references, single, tmp_path):
    """Two replicas of the model sharded over two ranks each (one sequence a rank): the gradients
    reduce-scattered within a replica and all-reduced across the two; each rank holds half of one
    process's state."""
    run4 = torchrun(4, [*ONE, "parallel=hsdp2x2", "checkpoint.enabled=false"], tmp_path / "hsdp")
    assert run4["world"] == 4
    assert_train_parity(run4, references, "hsdp 2 x 2")
    assert run4["state_mib"]["optimizer"] == pytest.approx(single["state_mib"]["optimizer"] / 2, rel=0.10)


@pytest.mark.extended
def test_fsdp2_bf16_mixed_gathers_bf16_and_reduces_in_fp32(tmp_path):
    """trainer.precision=bf16-mixed: FSDP2's MixedPrecisionPolicy (bf16 weights gathered, fp32
    gradient reduction, fp32 shards stepped) against one process's bf16-mixed (autocast) run, under
    the rule's bfloat16 bound."""
    mixed = ("trainer.precision=bf16-mixed",)
    references = train_references((*FAST, "model=tiny", *mixed), tmp_path / "references")
    tested = torchrun(2, [*FSDP2, *mixed, "checkpoint.enabled=false"], tmp_path / "run")
    assert_train_parity(tested, references, "fsdp2 bf16-mixed", dtype="bfloat16")


def test_tp2_megatron_by_fsdp2_matches_single_process(tmp_path):
    """A dense model under megatron (the stream replicated, the blocks' GEMMs column- and
    row-parallel), its TP shards sharded again by FSDP2 over the pairs."""
    references = train_references((*FAST, "model=tiny-dense"), tmp_path / "references")
    run4 = torchrun(4, [*FAST, "model=tiny-dense", "passes=boost_aot_eager", "parallel.dp_shard=2", "parallel.tp=2",
                        "parallel.plan=megatron", "checkpoint.enabled=false"], tmp_path / "run")
    assert_train_parity(run4, references, "tp2 megatron x fsdp2")


@pytest.mark.extended
@pytest.mark.extended
@pytest.mark.parametrize("layout", [("parallel=hsdp2x2",),
                                    ("parallel.dp_shard=2", "parallel.tp=2", "parallel.plan=btp", "trainer.local_batch=1")],
                         ids=["hsdp2x2", "tp2-btp-x-fsdp2"])
def test_four_rank_layouts_with_lowrank_checkpointing(references, layout, tmp_path):
    run4 = torchrun(4, [*ONE, *layout, "++passes.options.checkpoint=lowrank", "checkpoint.enabled=false"], tmp_path / "run")
    assert_train_parity(run4, references, f"{' '.join(layout)}, checkpoint=lowrank")


@pytest.mark.extended
def test_fsdp4_holds_a_quarter_of_one_process_state(references, single, tmp_path):
    run4 = torchrun(4, [*ONE, "parallel.dp_shard=4", "checkpoint.enabled=false"], tmp_path / "fsdp4")
    assert_train_parity(run4, references, "fsdp 4")
    mine, whole = run4["state_mib"], single["state_mib"]
    print(f"per rank, MiB: one process {whole}; FSDP2 over 4 {mine}")
    for term in ("params", "grads", "optimizer"):
        assert mine[term] == pytest.approx(whole[term] / 4, rel=0.10), term


@pytest.mark.extended
def test_the_next_blocks_gather_is_issued_during_this_ones_forward():
    """A profile of FSDP2 over 2 gloo ranks (boost_compile.bench.fsdp_overlap): each block's forward
    issues the next block's all-gather before it ends (train/fsdp.py prefetch), which FSDP2 alone
    issues only as the next block starts; the first reduce-scatter is issued before the first
    block's backward starts, so the reductions run beside the backward."""
    from boost_compile.bench.fsdp_overlap import measure

    prefetched, alone = measure(2, "tiny", 3), measure(2, "tiny", 3, prefetch=False)
    assert [f["prefetched"] for f in prefetched["verdicts"]["forward"]] == [True, True], prefetched["verdicts"]
    assert [f["prefetched"] for f in alone["verdicts"]["forward"]] == [False, False], alone["verdicts"]
    assert prefetched["verdicts"]["backward"]["issued_before_backward_ends"], prefetched["verdicts"]


@pytest.mark.extended
def test_fsdp2_checkpoint_resumes_on_every_layout(fsdp2, references, tmp_path):
    """Step 3's checkpoint (each rank's DTensor shards) resumes within the parity rule in one process
    and under DDP; DDP's step-3 checkpoint resumes under FSDP2. (Exactly under FSDP2 again:
    test_fsdp2_restarts_after_a_killed_worker.)"""
    checkpoint = Path(fsdp2["run_dir"]) / "checkpoints" / "step_000003"
    resume = ("trainer.resume=true", f"checkpoint.resume_from={checkpoint}")
    one = run(cfg_of(*ONE, *resume), tmp_path / "one")
    assert_train_parity(one, references, "one process from the FSDP2 checkpoint", first=3)
    to_ddp = torchrun(2, [*ONE, "parallel=dp2", *resume], tmp_path / "to_ddp")
    assert_train_parity(to_ddp, references, "DDP from the FSDP2 checkpoint", first=3)
    ddp = torchrun(2, [*ONE, "parallel=dp2"], tmp_path / "ddp")
    from_ddp = Path(ddp["run_dir"]) / "checkpoints" / "step_000003"
    back = torchrun(2, [*FSDP2, "trainer.resume=true", f"checkpoint.resume_from={from_ddp}"], tmp_path / "back")
    assert back["start_step"] == 3
    assert_train_parity(back, references, "FSDP2 from the DDP checkpoint", first=3)


@pytest.mark.extended
def test_tp2_btp_by_fsdp2_matches_single_process_and_resumes(references, single, tmp_path):
    """btp over TP pairs, FSDP2 over the pairs (4 ranks): FSDP2 shards each rank's TP shard
    further (the TP spec kept on the parameters it makes, for the backend's TP passes), with
    gradient accumulation. Step 3's checkpoint (each rank's FSDP2 slice of its TP shard saved as
    it is, a DTensor of the whole over (dp_shard, tp): nothing gathered) resumes exactly in the
    same layout and in one process within the parity rule."""
    layout = (*ONE, "parallel.dp_shard=2", "parallel.tp=2", "parallel.plan=btp", "trainer.local_batch=1")
    run4 = torchrun(4, list(layout), tmp_path / "tpfsdp")
    assert run4["world"] == 4
    assert_train_parity(run4, references, "tp2 btp x fsdp2")
    # a TP2 rank holds about half the weights, FSDP2 half of that; the whole model's parameters
    # counted (for the MFU) from shards of shards
    assert run4["state_mib"]["total"] < 0.3 * single["state_mib"]["total"], (run4["state_mib"], single["state_mib"])
    assert "dp=1x2 (fsdp2) tp=2" in (tmp_path / "tpfsdp" / "train.log").read_text()
    from boost_compile.models import Llama, LlamaConfig

    whole = sum(p.numel() for p in Llama(LlamaConfig.preset("tiny")).parameters())
    assert params_logged(tmp_path / "tpfsdp") == f"{whole:,}"
    checkpoint = tmp_path / "tpfsdp" / "checkpoints" / "step_000003"
    resume = ("trainer.resume=true", f"checkpoint.resume_from={checkpoint}")
    again = torchrun(4, [*layout, *resume], tmp_path / "again")
    assert again["losses"] == pytest.approx(run4["losses"][3:], abs=1e-6, rel=0)
    one = run(cfg_of(*ONE, *resume), tmp_path / "one")
    assert_train_parity(one, references, "one process from the tp2 x fsdp2 checkpoint", first=3)


@pytest.mark.extended
def test_pp2_by_fsdp2_matches_single_process_and_resumes_in_one(references, tmp_path):
    """Two pipeline stages, each sharded by FSDP2 over 2 ranks (4 ranks, 1F1B, 2 micro-batches, low-rank
    checkpointing): PyTorch's PipelineStage runs every micro-batch's backward unreduced and reduce-scatters
    each stage once. Step 3's checkpoint (each stage's shards) resumes in one process within the rule."""
    layout = (*ONE, "parallel.pp=2", "parallel.dp_shard=2", "parallel.microbatches=2", "++passes.options.checkpoint=lowrank")
    run4 = torchrun(4, [*layout, *AT_START], tmp_path / "ppfsdp")
    assert_train_parity(run4, references, "pp2 x fsdp2, checkpoint=lowrank")
    # each rank materialised its FSDP2 slices of its stage, sharded on meta: one process's weights
    assert assert_starts_like_one_process(tmp_path / "ppfsdp") == TINY_TENSORS
    log = (tmp_path / "ppfsdp" / "train.log").read_text()
    assert "materialised stage 0's FSDP2 shards" in log or "materialised stage 1's FSDP2 shards" in log
    assert "pp=2 dp=1x2 (fsdp2) tp=1" in log and "FSDP2 over 2: 2 units (tok_embeddings ... layers.0) and the root" in log
    checkpoint = tmp_path / "ppfsdp" / "checkpoints" / "step_000003"
    one = run(cfg_of(*ONE, "trainer.resume=true", f"checkpoint.resume_from={checkpoint}"), tmp_path / "one")
    assert_train_parity(one, references, "one process from the pp2 x fsdp2 checkpoint", first=3)


#: LaX (no pipeline stages can carry it) with more weights than activations: d 256, 8 blocks, rank 64, 2 x 32 tokens
WIDE_LAX = ("model=tiny-lax", "+model.overrides.dim=256", "+model.overrides.n_layers=8", "+model.overrides.ffn_dim=512",
            "+model.overrides.rank_attn=64", "+model.overrides.rank_mlp=64", "trainer.batch=2", "trainer.seq=32")


@pytest.mark.extended
def test_auto_trains_under_fsdp2_where_ddp_and_zero1_do_not_fit(tmp_path):
    """parallel=auto on 2 processes with 22.5 MiB per device: the planner prices DDP (51 MiB) and ZeRO-1
    (38 MiB) over the cap, a pipeline cannot carry LaX, and FSDP2 fits and beats TP2; boost-train trains
    under it. Measured: each rank's weights, gradients and AdamW state are under the cap, and twice that
    (what a DDP replica holds of them alone) is over it."""
    cap_gib = 0.022
    out = tmp_path / "auto"
    result = torchrun(2, [*FAST, *WIDE_LAX, "passes=boost_aot_eager", "parallel=auto", "parallel.hardware=cpu",
                          f"parallel.memory_gib={cap_gib}", "checkpoint.enabled=false", "trainer.steps=3"], out)
    log = (out / "train.log").read_text()
    assert "parallel=auto: chose tp1 fsdp2" in log and "dp=1x2 (fsdp2)" in log
    assert result["status"] == "completed" and result["losses"][-1] < result["losses"][0]
    cap_mib = cap_gib * 1024
    assert result["state_mib"]["total"] < cap_mib < 2 * result["state_mib"]["total"], (result["state_mib"], cap_mib)


@pytest.mark.extended
def test_fsdp2_restarts_after_a_killed_worker(fsdp2, tmp_path):
    """Rank 1 SIGKILLed after step 5 (checkpoints at 3 and 6): torchrun restarts the group, which
    resumes (trainer.resume=auto) from step 3's shards and ends with the uninterrupted run's losses."""
    out = tmp_path / "run"
    summary = torchrun(2, [*FSDP2, "trainer.resume=auto"], out, restarts=1, env={"BOOST_COMPILE_FAULT": "kill:1:5"})
    assert summary["status"] == "completed" and summary["restarts"] == 1 and summary["start_step"] == 3
    losses = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert [losses[s] for s in sorted(losses)] == pytest.approx(fsdp2["losses"], abs=1e-6, rel=0)


def test_reshard_after_forward_defaults_as_torchtitans():
    """Unset: true without pipeline stages, false with them (each micro-batch's forward would gather the
    stage again); set, as set."""
    def resolved(*overrides: str, world: int = 2) -> bool:
        tc, _ = validate(cfg_of(*ONE, "parallel=fsdp2", *overrides), world_size=world)
        return tc.parallel.reshards_after_forward

    assert resolved() is True and resolved("parallel.reshard_after_forward=false") is False
    assert resolved("parallel.pp=2", world=4) is False
    assert resolved("parallel.pp=2", "parallel.reshard_after_forward=true", world=4) is True


@pytest.mark.parametrize(("overrides", "message"), [
    (("parallel=fsdp2", "parallel.tp=2", "parallel.plan=vanilla"), "parallel.plan=vanilla's DTensor parameters are not supported"),
    (("parallel=fsdp2", "parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.stages_per_rank=2", "passes=none",
      "+model.overrides.n_layers=4"), "pp_schedule=zero_bubble computes each stage's weight gradients apart"),
    (("parallel=fsdp2", "parallel.zero=1"), "already shards it with the weights and gradients; set parallel.zero=0"),
    (("parallel=fsdp2", "passes.unit=model"), "use passes.unit=block"),
    (("parallel=fsdp2", "trainer.batch=3"), r"must be divisible by parallel.dp x dp_shard=2"),
])
def test_fsdp2_refuses_what_it_does_not_compose_with(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_of(*ONE, *overrides), world_size=4 if "parallel.tp=2" in overrides or "parallel.pp=2" in overrides else 2)
