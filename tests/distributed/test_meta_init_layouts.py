"""``model.init=per_parameter`` in boost-train: every layout starts from one process's weights,
bitwise (torchrun on 127.0.0.1, gloo).

Each run saves its starting weights (``checkpoint.at_start``: ``step_000000``) and
``assert_starts_like_one_process`` builds the same config in this process and compares every
tensor. The tiny preset's FSDP2 2, PP2, DDP2 and TP2 runs are checked beside their parity tests
(test_train_fsdp, test_train_pp, test_train_parallel); here: a pretrained Hugging Face folder,
factorized by SVD, under FSDP2 (read and factorized shard by shard), and, marked extended, HSDP
2x2, TP2 x FSDP2 2 (the preset, and the pretrained folder dense and factorized), PP2 x TP2 (each
rank its TP shards of its stage, captured and sharded on meta), and a randomly
initialised Hugging Face model under FSDP2, PP2 and TP2. One step each, eager (``passes=none``; TP needs the boost backend): what
is checked is the start.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import AT_START, FAST, TINY_TENSORS, assert_starts_like_one_process, cfg_of, save_hf_folder, torchrun

from boost_compile.config import ConfigError
from boost_compile.train.model import build_model, build_on_meta
from boost_compile.train.validate import model_shape, validate

START = (*FAST, *AT_START, "passes=none", "trainer.steps=1", "trainer.eval_batches=1")
#: hf-tiny's tensors: the embedding, 2 blocks of 2 norms and 7 projections, the final norm, the head
HF_TINY_TENSORS = 1 + 2 * (2 + 7) + 2


def _starts_alike(nproc: int, overrides: list[str], out: Path) -> int:
    summary = torchrun(nproc, [*START, *overrides], out)
    assert summary["steps"] == 1 and summary["losses"][0] == summary["losses"][0]  # ran, and not NaN
    return assert_starts_like_one_process(out)


@pytest.mark.parametrize("weights", ["pretrained-svd25", pytest.param("random", marks=pytest.mark.extended)])
def test_hf_model_under_fsdp2_starts_like_one_process(weights, tmp_path):
    """Pretrained: each rank reads its FSDP2 slices of the folder's safetensors and of the factors
    of each layer's SVD (14 layers made 28 factors)."""
    model = [*save_hf_folder(tmp_path / "hf"), "factorize=svd25"] if weights != "random" else ["model=hf-tiny"]
    tensors = HF_TINY_TENSORS + (14 if weights != "random" else 0)
    assert _starts_alike(2, [*model, "parallel=fsdp2"], tmp_path / "run") == tensors
    assert "materialised its FSDP2 shards" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.extended
def test_pretrained_folder_under_pp2_starts_like_one_process(tmp_path):
    """Each pipeline rank reads and factorizes only its stage's layers."""
    overrides = [*save_hf_folder(tmp_path / "hf"), "factorize=svd25", "parallel.pp=2", "parallel.microbatches=2"]
    assert _starts_alike(2, overrides, tmp_path / "run") == HF_TINY_TENSORS + 14


@pytest.mark.extended
@pytest.mark.parametrize("factorize", [("parallel.plan=megatron",), ("factorize=svd25", "parallel.plan=btp")],
                         ids=["dense-megatron", "svd25-btp"])
def test_pretrained_folder_under_tp2_x_fsdp2_starts_like_one_process(factorize, tmp_path):
    """TP2 x FSDP2 2 built on meta: each rank's FSDP2 slice of its TP shard read from the folder
    (or from its layer's SVD), no rank holding the whole model."""
    layout = ("parallel.dp_shard=2", "parallel.tp=2", "passes=boost_aot_eager")
    tensors = HF_TINY_TENSORS + (14 if "factorize=svd25" in factorize else 0)
    assert _starts_alike(4, [*save_hf_folder(tmp_path / "hf"), *factorize, *layout], tmp_path / "run") == tensors
    log = (tmp_path / "run" / "train.log").read_text()
    assert "materialised its FSDP2 shards" in log and "verified at the first step" in log


@pytest.mark.extended
@pytest.mark.parametrize("layout", [
    ("model=tiny", "parallel=hsdp2x2"),
    ("model=tiny-dense", "parallel.dp_shard=2", "parallel.tp=2", "parallel.plan=megatron", "passes=boost_aot_eager"),
    ("model=tiny", "parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2", "passes=boost_aot_eager"),
], ids=["hsdp2x2", "tp2xfsdp2", "pp2xtp2"])
def test_four_process_layouts_start_like_one_process(layout, tmp_path):
    tensors = TINY_TENSORS if "model=tiny" in layout else 1 + 2 * (2 + 7) + 2
    assert _starts_alike(4, list(layout), tmp_path / "run") == tensors


@pytest.mark.extended
@pytest.mark.parametrize("layout", [("parallel.pp=2", "parallel.microbatches=2"), ("parallel=tp2", "passes=boost_aot_eager")],
                         ids=["pp2", "tp2"])
def test_hf_model_starts_like_one_process(layout, tmp_path):
    assert _starts_alike(2, ["model=hf-tiny", *layout], tmp_path / "run") == HF_TINY_TENSORS


@pytest.mark.extended
def test_a_factorized_export_under_tp2_starts_like_one_process(tmp_path):
    """A boost-export of tiny-dense + svd25 as the pretrained model of a TP2 (btp) run: each rank
    reads its TP shards of the exported factors."""
    from omegaconf import OmegaConf

    from boost_compile.export import export
    from boost_compile.train import run

    cfg = cfg_of(*FAST, "passes=none", "trainer.steps=2", "model=tiny-dense", "factorize=svd25")
    run(cfg, tmp_path / "trained")
    (tmp_path / "trained" / ".hydra").mkdir()
    OmegaConf.save(cfg, tmp_path / "trained" / ".hydra" / "config.yaml")
    export(tmp_path / "trained", tmp_path / "export")
    overrides = ["model=tiny", f"model.hf_path={tmp_path / 'export'}", "model.pretrained=true", "parallel=tp2",
                 "passes=boost_aot_eager"]
    assert _starts_alike(2, overrides, tmp_path / "run") == TINY_TENSORS


def test_global_rng_is_the_models_own_init():
    """model.init=global_rng: the model as its own code builds it from the seeded global RNG."""
    from boost_compile.models import Llama

    tc, shape = validate(cfg_of(*FAST, "model=tiny", "model.init=global_rng"))
    built = build_model(tc, shape, torch.device("cpu"))
    torch.manual_seed(tc.trainer.seed)
    own = Llama(shape.llama_config)
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), own.state_dict().values(), strict=True))


def test_a_model_built_on_meta_that_fails_is_refused_in_one_line():
    """RWKV's init computes with its parameters (``time_first * log(0.3) + zigzag``): on meta that
    cannot run, and boost-train says so, with the way out, before any process group exists."""
    pytest.importorskip("transformers")
    tc, _ = validate(cfg_of(*FAST, "model=hf-tiny"))
    rwkv = {"model_type": "rwkv", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2, "attention_hidden_size": 32}
    tc = replace(tc, model=replace(tc.model, hf_config=rwkv))
    shape = model_shape(tc.model, tc.trainer.seq)
    with pytest.raises(ConfigError, match=r"model.init=per_parameter: building the model on the meta device fails"
                                          r".*model.init=global_rng") as info:
        build_on_meta(tc, shape)
    assert "\n" not in str(info.value)
