"""boost-generate: continuations from a boost-train checkpoint, compiled with the boost backend.

One tiny run (a few steps, no compile while training) is shared by the tests;
generation compiles with boost's ``aot_eager`` inner compiler (seconds on CPU).
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_export import train
from torch import nn

import boost_compile.backend as backend
from boost_compile.config import ConfigError
from boost_compile.export import load_trained
from boost_compile.generate import Generator, load_generator, main, next_token
from boost_compile.train.tokenizer import ByteTokenizer

PROMPT = "def main("


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train(tmp_path_factory.mktemp("gen") / "run", "model=tiny", "trainer.steps=4")


@pytest.fixture
def recorder(monkeypatch):
    """Every graph the ``"boost"`` backend compiles, recorded."""
    rec = backend.Recorder(keep_view=False)
    monkeypatch.setattr(backend, "compile_graph", functools.partial(backend.compile_graph, recorder=rec))
    torch._dynamo.reset()
    return rec


def eager_greedy(model: nn.Module, prompt: str, n: int, window: int) -> str:
    """Greedy decoding without compile: the whole context each step (no padding)."""
    ids = ByteTokenizer().encode(prompt).tolist()
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids[-window:]]))[0, -1]
            ids.append(int(logits.argmax()))
            out.append(ids[-1])
    return ByteTokenizer().decode(out)


def test_greedy_is_deterministic_and_compiled_with_boost(run_dir, recorder):
    gen = load_generator(run_dir, inner="aot_eager")
    assert gen.window == 32 and gen.options == {"inner": "aot_eager"}
    first = gen(PROMPT, max_new_tokens=12)
    second = gen(PROMPT, max_new_tokens=12)
    assert first == second and len(first.encode()) >= 1
    assert len(recorder.graphs) == 1  # one fixed window: one graph for 24 forwards
    assert any(r.name == "group_linears" for r in recorder.graphs[0].reports)  # boost's passes ran
    model, _ = load_trained(run_dir)
    assert first == eager_greedy(model, PROMPT, 12, gen.window)
    # a context longer than the window slides (still the same graph)
    long = "x = 1\n" * 10
    assert gen(long, max_new_tokens=3) == eager_greedy(model, long, 3, gen.window)
    assert len(recorder.graphs) == 1


def test_sampling_follows_the_seed(run_dir, recorder):
    gen = load_generator(run_dir, inner="aot_eager")
    a = gen.generate_ids([100, 101], 16, temperature=1.0, top_k=20, seed=3)
    assert a == gen.generate_ids([100, 101], 16, temperature=1.0, top_k=20, seed=3)
    assert a != gen.generate_ids([100, 101], 16, temperature=1.0, top_k=20, seed=4)
    assert gen.generate_ids([100, 101], 6, temperature=1.0, top_k=1, seed=5) == gen.generate_ids([100, 101], 6)


def test_padding_rows_are_masked():
    logits = torch.tensor([0.0, 1.0, 2.0, 50.0, 60.0])
    assert next_token(logits, vocab_size=3) == 2
    g = torch.Generator().manual_seed(0)
    assert all(next_token(logits, 3, temperature=5.0, generator=g) < 3 for _ in range(50))
    assert next_token(logits, 3, temperature=1.0, top_k=1) == 2


class PaddedVocab(nn.Module):
    """A model whose embedding has 44 padding rows, with the largest logits."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.base(tokens)
        return torch.cat([logits, logits.new_full((*logits.shape[:-1], 44), 1e4)], dim=-1)


def test_generator_masks_padding_rows_of_the_model(run_dir, recorder):
    model, _ = load_trained(run_dir)
    gen = Generator(PaddedVocab(model), ByteTokenizer(), window=16, options={"inner": "aot_eager"})
    ids = gen.generate_ids([100, 101, 102], 8)
    assert all(0 <= i < 256 for i in ids) and len(ids) == 8
    assert gen.generate_ids([100, 101, 102], 8, temperature=2.0, seed=0) != []
    with pytest.raises(ConfigError, match="prompt is empty"):
        gen.generate_ids([], 4)


def test_cli_prints_the_continuation(run_dir, capsys):
    torch._dynamo.reset()
    args = [str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "8", "--inner", "aot_eager", "--device", "cpu"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first
    main([*args, "--temperature", "0.9", "--top-k", "10", "--seed", "0"])
    assert capsys.readouterr().out.endswith("\n")
    with pytest.raises(SystemExit) as exc:
        main([*args, "--window", "100000"])
    assert exc.value.code == 2 and "exceeds the model's" in capsys.readouterr().err


def test_bpe_run_masks_the_padding_ids(tmp_path, recorder):
    """bpe:300: the model has 320 logits; generation never picks ids >= 300 and decodes with the BPE."""
    pytest.importorskip("tokenizers")
    out = train(tmp_path / "run", "model=tiny", "data.tokenizer=bpe:300", f"data.cache_dir={tmp_path / 'cache'}")
    gen = load_generator(out, inner="aot_eager")
    assert gen.vocab_size == 300 and gen.model.config.vocab_size == 320
    with torch.no_grad():  # make the padding rows the likeliest: only the mask keeps them out
        gen.model.output.weight[300:] = gen.model.output.weight[:20] * 50
    ids = gen.generate_ids(gen.tokenizer.encode(PROMPT), 8)
    assert all(0 <= i < 300 for i in ids)
    assert isinstance(gen(PROMPT, max_new_tokens=4, temperature=1.0, seed=0), str)
