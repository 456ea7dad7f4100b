"""boost-export: checkpoints of boost-train runs as model folders that load without boost-train.

Runs are tiny (a few steps of 4 x 32 bytes, no compile) and write into tmp_path;
the run's ``.hydra/config.yaml`` is the composed config, as Hydra writes it (one
test starts the real ``python -m boost_compile.train``). The tensor-parallel case is
tests/distributed/test_export_tp.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST, assert_same_state, cfg_of
from omegaconf import OmegaConf

from boost_compile.export import EXPORT_FILE, export, load_exported, load_trained, main, resolve
from boost_compile.models import Llama, LlamaConfig
from boost_compile.train import run
from boost_compile.train.model import build_model, fit_vocab
from boost_compile.train.validate import model_shape

QUICK = (*FAST, "passes=none", "trainer.steps=2")

def train(out: Path, *overrides: str) -> Path:
    """A two-step run into ``out`` with its config where Hydra puts it."""
    cfg = cfg_of(*QUICK, *overrides)
    run(cfg, out)
    (out / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / ".hydra" / "config.yaml")
    return out

def initial_model(run_dir: Path) -> torch.nn.Module:
    """The run's model before training (the weights a lost checkpoint would leave)."""
    source = resolve(run_dir)
    tc = source.config
    shape = fit_vocab(model_shape(tc.model, tc.trainer.seq), tc.model, source.tokenizer().vocab_size)
    return build_model(tc, shape, torch.device("cpu"))

def changed(trained: torch.nn.Module, initial: torch.nn.Module) -> bool:
    init = dict(initial.named_parameters())
    return any(not torch.equal(p, init[n]) for n, p in trained.named_parameters())

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))

def test_dense_hf_model_loads_with_transformers(tmp_path):
    """The real CLI run (Hydra writes .hydra/config.yaml), with a BPE of 300 tokens: the
    model's vocabulary is padded to 320, and the tokenizer loads with AutoTokenizer."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "boost_compile.train", *QUICK, "model=hf-tiny", "data.tokenizer=bpe:300",
         f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={out}"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (out / ".hydra" / "config.yaml").is_file()
    main([str(out), str(tmp_path / "hf")])
    info = json.loads((tmp_path / "hf" / EXPORT_FILE).read_text())
    assert info["format"] == "hf" and info["step"] == 2 and info["vocab_size"] == 300
    assert (tmp_path / "hf" / "model.safetensors").is_file()

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert loaded.config.vocab_size == 320
    trained, source = load_trained(out)
    assert changed(trained, initial_model(out))
    with torch.no_grad():
        want = trained(TOKENS)
        got = loaded(input_ids=TOKENS).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert_same_state(trained, loaded, prefix="hf.")

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    text = "def main(argv):\n    return 0\n"
    assert tokenizer.encode(text) == source.tokenizer().encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text

def test_reference_model_loads_back_exactly(tmp_path, capsys):
    out = train(tmp_path / "run", "model=tiny", "trainer.save_every=1", "checkpoint.keep=3")
    main([str(out), str(tmp_path / "newest")])
    assert "as boost_llama" in capsys.readouterr().out
    loaded = Llama.from_pretrained(tmp_path / "newest")
    trained, source = load_trained(out)
    assert source.step == 2 and loaded.config == trained.config
    assert_same_state(trained, loaded)
    assert changed(trained, initial_model(out))
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS), trained(TOKENS))
    # a checkpoint folder: that step, not the newest
    info = export(out / "checkpoints" / "step_000001", tmp_path / "first")
    assert info["step"] == 1
    first = Llama.from_pretrained(tmp_path / "first")
    assert changed(trained, first)
    assert_same_state(load_trained(out / "checkpoints" / "step_000001")[0], first)

@pytest.mark.parametrize(
    ("overrides", "kind"),
    [(("model=tiny-dense", "factorize=svd25"), "boost_llama"), (("model=hf-tiny", "factorize=cola25"), "hf-lowrank")],
    ids=["reference", "hf"],
)
def test_factorized_models_load_back_exactly(tmp_path, overrides, kind):
    if "model=hf-tiny" in overrides:
        pytest.importorskip("transformers")
    out = train(tmp_path / "run", *overrides)
    info = export(out, tmp_path / "out")
    assert info["format"] == kind
    assert len(info["lowrank_layers"]) == (2 * 7 if kind == "hf-lowrank" else 0)
    loaded = load_exported(tmp_path / "out")
    trained, _ = load_trained(out)
    inner = trained.hf if kind == "hf-lowrank" else trained
    assert_same_state(inner, loaded)
    with torch.no_grad():
        got = loaded(TOKENS)
        assert torch.equal(getattr(got, "logits", got), trained(TOKENS))
    if kind == "boost_llama":  # the dense config plus the bottlenecks factorize_ made
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        assert config["projection"] == "dense" and len(config["lowrank_layers"]) == 2 * 7
        assert isinstance(Llama.from_pretrained(tmp_path / "out"), Llama)

def test_save_pretrained_keeps_tied_weights_and_dtype(tmp_path):
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", tie_embeddings=True)).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    loaded = Llama.from_pretrained(tmp_path)
    assert loaded.output.weight is loaded.tok_embeddings.weight
    assert_same_state(model, loaded)
    with pytest.raises(ValueError, match="safetensors only"):
        model.save_pretrained(tmp_path, safe_serialization=False)

def test_errors_name_the_fix(tmp_path, capsys):
    def error(*args: str) -> str:
        with pytest.raises(SystemExit) as exc:
            main(list(args))
        assert exc.value.code == 2
        return capsys.readouterr().err

    assert "does not exist" in error(str(tmp_path / "nothing"), str(tmp_path / "out"))
    out = train(tmp_path / "run", "checkpoint=off")
    assert "has no complete checkpoint" in error(str(out), str(tmp_path / "out"))
    # a checkpoint outside its run folder needs --config
    ckpt = train(tmp_path / "run2", "checkpoint.dir=" + str(tmp_path / "elsewhere"))
    step = tmp_path / "elsewhere" / "step_000002"
    assert "--config" in error(str(step), str(tmp_path / "out"))
    main([str(step), str(tmp_path / "out"), "--config", str(ckpt / ".hydra" / "config.yaml")])
    main([str(ckpt), str(tmp_path / "out2")])  # the run folder finds checkpoint.dir
    assert_same_state(Llama.from_pretrained(tmp_path / "out"), Llama.from_pretrained(tmp_path / "out2"))

@pytest.mark.parametrize(
    "overrides",
    [("model=tiny", "+model.overrides.tie_embeddings=true"),
     ("model=hf-tiny", "model.hf_config.model_type=qwen3_moe", "+model.hf_config.num_experts=4",
      "+model.hf_config.num_experts_per_tok=2", "+model.hf_config.moe_intermediate_size=32",
      "model.hf_config.tie_word_embeddings=true")],
    ids=["reference-tied", "hf-moe-tied"],
)
def test_export_streams_one_tensor_at_a_time_into_shards(tmp_path, monkeypatch, overrides):
    """With a read group of 0 bytes and shards of 64 KiB, every DCP read asks for one tensor, the
    folder is sharded with its index, a tied weight is written once, and the loaders read the
    shards back bitwise (transformers' ``from_pretrained`` too, fused experts included)."""
    import torch.distributed.checkpoint as dcp

    if "model=hf-tiny" in overrides:
        transformers = pytest.importorskip("transformers")
    out = train(tmp_path / "run", *overrides)
    trained, _ = load_trained(out)
    asked: list[int] = []
    real_load = dcp.load
    monkeypatch.setattr(dcp, "load", lambda state, **kw: (asked.append(len(state["model"])), real_load(state, **kw))[1])
    info = export(out, tmp_path / "out", max_shard_bytes=1 << 16, group_bytes=0)
    distinct = len({id(p) for p in trained.state_dict(keep_vars=True).values()})
    assert asked == [1] * distinct  # one tensor a read, each once (the tied one once)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(info["files"]) > 1 and sorted(set(index["weight_map"].values())) == info["files"]
    assert not (tmp_path / "out" / "model.safetensors").exists()
    loaded = load_exported(tmp_path / "out")
    inner = trained.hf if info["format"] != "boost_llama" else trained
    assert_same_state(inner, loaded)
    if info["format"] == "hf":
        again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
        assert again.get_output_embeddings().weight is again.get_input_embeddings().weight
        assert_same_state(inner, again)
    else:
        assert loaded.output.weight is loaded.tok_embeddings.weight

@pytest.mark.parametrize(
    ("overrides", "model"),
    [(("model=tiny-dense", "factorize=svd25"), "model=tiny"), (("model=hf-tiny", "factorize=cola25"), "model=hf"),
     pytest.param(("model=hf-tiny",), "model=hf", marks=pytest.mark.extended)],  # a plain HF folder, as before
    ids=["reference-svd25", "hf-lowrank", "hf"],
)
def test_an_export_starts_a_run_as_its_pretrained_weights(tmp_path, overrides, model):
    """``model.hf_path=EXPORT model.pretrained=true``: the run is built with the export's bottlenecks
    and starts from its weights bitwise, on the meta device (read slice by slice) and whole."""
    from boost_compile.train.validate import validate

    if "model=hf-tiny" in overrides:
        pytest.importorskip("transformers")
    out = train(tmp_path / "run", *overrides)
    export(out, tmp_path / "out")
    exported = load_exported(tmp_path / "out")
    for init in ("per_parameter", "global_rng"):
        tc, shape = validate(cfg_of(*QUICK, model, f"model.hf_path={tmp_path / 'out'}", "model.pretrained=true",
                                    f"model.init={init}"))
        assert shape.lowrank_layers == json.loads((tmp_path / "out" / EXPORT_FILE).read_text())["lowrank_layers"] or (
            model == "model=tiny" and len(shape.lowrank_layers) == 2 * 7)
        built = build_model(tc, fit_vocab(shape, tc.model, 256), torch.device("cpu"))
        assert_same_state(getattr(built, "hf", built), exported)
    if model == "model=tiny":  # it trains; factorizing it again is refused by name
        run(cfg_of(*QUICK, model, f"model.hf_path={tmp_path / 'out'}", "model.pretrained=true"), tmp_path / "again")
        with pytest.raises(Exception, match="already low-rank"):
            validate(cfg_of(*QUICK, model, f"model.hf_path={tmp_path / 'out'}", "model.pretrained=true", "factorize=svd25"))

def test_the_planner_prices_an_export_as_its_bottlenecks(tmp_path):
    """boost-plan and parallel=auto read a reference export's config.json and its bottlenecks."""
    from boost_compile.plan.model import from_hf_config

    out = train(tmp_path / "run", "model=tiny-dense", "factorize=svd25")
    export(out, tmp_path / "out")
    spec = from_hf_config(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    ranks = {v["rank"] for v in config["lowrank_layers"].values()}
    assert spec.projection == "lowrank" and {spec.rank_attn, spec.rank_mlp} <= ranks
    assert (spec.dim, spec.n_layers, spec.vocab_size) == (config["dim"], config["n_layers"], config["vocab_size"])
