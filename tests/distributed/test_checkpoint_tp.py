"""Checkpoints of the TP shards that are no single DTensor Shard, through boost-train (torchrun on
127.0.0.1, gloo): a fused weight cut part by part (Hugging Face GPT-2's Conv1D ``c_attn``, parts
q|k|v: each rank holds ``[q_r | k_r | v_r]``) and a head padded to a multiple of the TP degree (the
tiny preset with a fixed vocabulary of 257: rank 0 holds rows 0-128, rank 1 rows 129-256 and a zero).

A TP2 checkpoint holds every tensor whole, in its ordinary layout, under the keys and shapes a
one-process run saves (parts in order, padding dropped), and the same values up to rounding; it
resumes exactly on TP2 and within the parity rule in one process, and a one-process checkpoint
resumes on TP2 within the parity rule (conftest: against one-process eager runs in fp32 and fp64).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import FAST, assert_train_parity, cfg_of, rel_err, rng_states, torchrun, train_references

from boost_compile.train import run
from boost_compile.train.validate import tp_available

#: GPT-2 without dropout (its default 0.1 draws other masks on sharded activations: no parity)
FUSED = (
    *FAST, "model=hf-tiny", "model.hf_config.model_type=gpt2",
    "+model.hf_config.resid_pdrop=0.0", "+model.hf_config.embd_pdrop=0.0", "+model.hf_config.attn_pdrop=0.0",
)
#: a fixed vocabulary the TP degree does not divide: the vocabulary-parallel head is padded
PADDED = (*FAST, "model=tiny", "+model.overrides.vocab_size=257")
MODELS = {"fused": FUSED, "padded": PADDED}
#: the second model runs with make test-extended (its padded, whole-compiled form); make test runs the first
EXTENDED_MODELS = {"padded"}
#: the tensor of each model whose shards are no DTensor Shard: its checkpoint key, whole shape,
#: and the (offset, rows) runs on the shard dim that the two ranks save: the halves of the whole
#: (the fused weight's parts gathered in order), the padded head's without its padding row
IRREGULAR = {
    "fused": ("model.hf.transformer.h.0.attn.c_attn.weight", (64, 192), 1, [(0, 96), (96, 96)]),
    "padded": ("model.output.weight", (257, 64), 0, [(0, 129), (129, 128)]),
}
SAVE = ("passes=boost_aot_eager", "trainer.save_every=3")
TP2 = (*SAVE, "parallel=tp2")
#: how each model's TP2 run compiles: GPT-2 block by block (boost-train's default), the padded
#: reference model whole (passes.unit=model), so both forms of a TP model train and resume here
UNIT = {"fused": "block", "padded": "model"}


def resume_from(checkpoint: Path) -> tuple[str, str]:
    return ("trainer.resume=true", f"checkpoint.resume_from={checkpoint}")


@dataclass
class Runs:
    """One model's references, its TP2 run and its one-process run (both saving at steps 3 and 6)."""

    name: str
    overrides: tuple[str, ...]
    references: tuple[dict, dict]
    tp2: dict
    single: dict

    def checkpoint(self, summary: dict) -> Path:
        return Path(summary["run_dir"]) / "checkpoints" / "step_000003"


@pytest.fixture(scope="module", params=[pytest.param(m, marks=pytest.mark.extended) if m in EXTENDED_MODELS else m
                                        for m in sorted(MODELS)])
def runs(request, tmp_path_factory) -> Runs:
    if not tp_available():
        pytest.skip("boost_compile.parallelize_ is not in this build")
    name, overrides = request.param, MODELS[request.param]
    folder = tmp_path_factory.mktemp(name)
    references = train_references(overrides, folder / "references")
    tp2 = torchrun(2, [*overrides, *TP2, f"passes.unit={UNIT[name]}"], folder / "tp2")
    log = (folder / "tp2" / "train.log").read_text()
    assert ("one by one" in log) == (UNIT[name] == "block"), log[-2000:]
    single = run(cfg_of(*overrides, *SAVE), folder / "single")
    return Runs(name, overrides, references, tp2, single)


def _metadata(checkpoint: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata


def whole_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every model and optimizer-state tensor of a checkpoint, read whole in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    state = {
        key: torch.zeros(md.size, dtype=md.properties.dtype)
        for key, md in _metadata(checkpoint).items()
        if isinstance(md, TensorStorageMetadata) and key.startswith(("model.", "optim.state.")) and len(md.size)
    }
    with warnings.catch_warnings():  # that no process group is up: on purpose
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state


def test_tp2_follows_one_process(runs):
    assert runs.tp2["world"] == 2 and runs.tp2["steps"] == 6
    assert_train_parity(runs.tp2, runs.references, f"{runs.name} tp2")


def test_tp2_checkpoint_is_the_one_process_layout(runs):
    """The same keys and whole shapes as a one-process save; the irregular tensor in whole-tensor
    chunks, padding dropped; and every tensor the one-process run's, up to rounding
    that three AdamW steps amplify (GPT-2's key bias has a zero gradient: its updates are rounding
    noise). A part saved in another's place, or a padding row saved, is off by about its whole size."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tp2, single = _metadata(runs.checkpoint(runs.tp2)), _metadata(runs.checkpoint(runs.single))

    def shapes(saved: dict) -> dict[str, tuple[int, ...]]:  # the RNG states are per rank
        return {k: tuple(md.size) for k, md in saved.items() if isinstance(md, TensorStorageMetadata)
                and k.startswith(("model.", "optim."))}

    assert shapes(tp2) == shapes(single)
    key, shape, dim, expected = IRREGULAR[runs.name]
    for k in (key, key.replace("model.", "optim.state.", 1) + ".exp_avg"):
        assert tuple(tp2[k].size) == shape, k
        assert sorted((c.offsets[dim], c.sizes[dim]) for c in tp2[k].chunks) == expected, k
    ours, theirs = whole_tensors(runs.checkpoint(runs.tp2)), whole_tensors(runs.checkpoint(runs.single))
    assert ours.keys() == theirs.keys() and key in ours
    errors = {k: rel_err(ours[k], theirs[k]) for k in theirs}
    assert max(errors.values()) < 1e-2, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


def test_tp2_checkpoint_resumes_exactly_on_tp2(runs, tmp_path):
    resumed = torchrun(2, [*runs.overrides, *TP2, f"passes.unit={UNIT[runs.name]}", *resume_from(runs.checkpoint(runs.tp2))],
                       tmp_path / "b")
    assert resumed["start_step"] == 3
    assert resumed["losses"] == pytest.approx(runs.tp2["losses"][3:], abs=1e-6, rel=0)


def test_tp2_checkpoint_resumes_in_one_process(runs, tmp_path):
    resumed = run(cfg_of(*runs.overrides, *SAVE, *resume_from(runs.checkpoint(runs.tp2))), tmp_path / "c")
    assert resumed["start_step"] == 3
    assert_train_parity(resumed, runs.references, f"{runs.name}: one process from the tp2 checkpoint", first=3)


def test_one_process_checkpoint_resumes_on_tp2(runs, tmp_path):
    resumed = torchrun(2, [*runs.overrides, *TP2, *resume_from(runs.checkpoint(runs.single))], tmp_path / "d")
    assert resumed["start_step"] == 3
    assert_train_parity(resumed, runs.references, f"{runs.name}: tp2 from a one-process checkpoint", first=3)
    # the one process's random state is not rank 0's alone: both TP ranks keep their replica's one stream
    assert "saved by pp=1 dp=1 tp=1, not this layout" in (tmp_path / "d" / "train.log").read_text()
    states = rng_states(tmp_path / "d" / "checkpoints" / "step_000006")
    assert sorted(states) == [0, 1] and torch.equal(states[0], states[1])
