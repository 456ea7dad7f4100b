"""Pipeline stages in one process: the cut (stage_layers, split_model, Hugging Face families),
compiling a stage with backend="boost", and the refusals of models and schedules that cannot
be pipelined. The multi-process schedules are in tests/distributed/test_pipeline.py."""

from __future__ import annotations

import pytest
import torch

from boost_compile.distributed.pipeline import PipelineError, model_costs, split_model, stage_layers
from boost_compile.models import Llama, LlamaConfig


def test_stage_layers_even_and_explicit():
    assert stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(6, 3, layers_per_stage=[1, 3, 2]) == [range(0, 1), range(1, 4), range(4, 6)]
    assert stage_layers(3, 1) == [range(0, 3)]

def test_stage_layers_balances_embedding_and_head():
    # embedding and head worth 2 blocks each: the end stages take fewer blocks
    assert stage_layers(8, 4, costs=[2, *[1] * 8, 2]) == [range(0, 1), range(1, 4), range(4, 7), range(7, 8)]
    # a heavy head only: the last stage takes the fewest blocks
    assert stage_layers(6, 2, costs=[0, *[1] * 6, 4]) == [range(0, 5), range(5, 6)]
    # uneven blocks: the split follows their cost
    assert stage_layers(4, 2, costs=[0, 3, 1, 1, 1, 0]) == [range(0, 1), range(1, 4)]

def test_model_costs_counts_parameters():
    model = Llama(LlamaConfig.preset("tiny-dense", n_layers=4, vocab_size=1024))
    costs = model_costs(model)
    block = sum(p.numel() for p in model.layers[0].parameters())
    assert costs[1:-1] == [1.0] * 4
    assert costs[0] == pytest.approx(1024 * 64 / block)
    assert costs[-1] == pytest.approx((1024 * 64 + 64) / block)
    # a vocabulary bigger than a block: the end stages get a block each, the middle two
    assert stage_layers(4, 3, costs=costs) == [range(0, 1), range(1, 3), range(3, 4)]

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n_layers": 2, "pp_stages": 3}, "3 pipeline stages for 2 blocks"),
    ({"n_layers": 4, "pp_stages": 2, "layers_per_stage": [1, 2]}, "sums to 3, not to the model's 4 blocks"),
    ({"n_layers": 4, "pp_stages": 2, "layers_per_stage": [4]}, "1 entries for 2 stages"),
    ({"n_layers": 4, "pp_stages": 2, "layers_per_stage": [4, 0]}, "positive whole number"),
    ({"n_layers": 4, "pp_stages": 2, "costs": [1, 1, 1]}, "expected n_layers \\+ 2 = 6"),
    ({"n_layers": 0, "pp_stages": 1}, "n_layers must be a positive integer"),
])
def test_stage_layers_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        stage_layers(**kwargs)

def test_split_keeps_names_and_matches_the_model():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", n_layers=4))
    tokens = torch.randint(0, 256, (2, 16))
    stages = [split_model(model, i, 3, layers_per_stage=[1, 2, 1]) for i in range(3)]
    assert [s.layer_range for s in stages] == [range(0, 1), range(1, 3), range(3, 4)]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert any(n.startswith("layers.2.") for n, _ in stages[1].named_parameters())
    h = tokens
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)
    assert stages[0].tok_embeddings.weight is not model.tok_embeddings.weight  # a copy




def test_split_hf_matches_the_model():
    from conftest import tiny_hf_llama

    model = tiny_hf_llama()
    tokens = torch.randint(0, 256, (2, 16))
    first, last = (split_model(model, i, 2) for i in range(2))
    assert "model.embed_tokens.weight" in dict(first.named_parameters())
    assert {"lm_head.weight", "model.norm.weight", "model.layers.1.mlp.up_proj.weight"} <= dict(last.named_parameters()).keys()
    torch.testing.assert_close(last(first(tokens)), model(input_ids=tokens).logits, rtol=0, atol=0)

def _hf_family(kind: str):
    transformers = pytest.importorskip("transformers")
    common = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "tie_word_embeddings": False, "pad_token_id": 0}
    configs = {
        "qwen2": lambda: transformers.Qwen2Config(**common),
        # sliding-window attention on the top two blocks, window 4 < the 16 tokens
        "qwen2-sliding": lambda: transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=4,
                                                          max_window_layers=2),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=16),
        "mistral-window": lambda: transformers.MistralConfig(**common, sliding_window=4),
        "gemma": lambda: transformers.GemmaConfig(**common, head_dim=16),  # sqrt(d)-scaled embedding
        "phi3-window": lambda: transformers.Phi3Config(**common, sliding_window=4),
        "olmo2": lambda: transformers.Olmo2Config(**common),
    }
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[kind](), attn_implementation="sdpa")

@pytest.mark.parametrize("kind", ["qwen2", "qwen2-sliding", "qwen3", "mistral-window", "gemma", "phi3-window", "olmo2"])
def test_split_hf_families_match_the_model(kind):
    """Each supported family cut into two stages gives the whole model's logits, bit for bit: the
    stages rebuild its masks (sliding windows where the model uses them) and its rotary embedding."""
    model = _hf_family(kind)
    tokens = torch.randint(0, 256, (2, 16))
    first, last = (split_model(model, i, 2) for i in range(2))
    torch.testing.assert_close(last(first(tokens)), model(input_ids=tokens).logits, rtol=0, atol=0)

def test_split_refuses_unchecked_hf_families():
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64, pad_token_id=0)
    model = transformers.Gemma2ForCausalLM(config)
    with pytest.raises(PipelineError, match=r"does not support Gemma2ForCausalLM \(model_type 'gemma2'\).*soft-capping"):
        split_model(model, 0, 2)

def test_stage_compiles_with_boost():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny"))
    stage = split_model(model, 1, 2)
    x = torch.randn(2, 16, 64, requires_grad=True)
    expected = stage(x)
    compiled = torch.compile(stage, backend="boost", options={"inner": "aot_eager"})
    torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-6)
    stage.compile(backend="boost", options={"inner": "aot_eager"})
    out = stage(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in stage.parameters())

def test_refuses_tied_head_across_stages():
    model = Llama(LlamaConfig.preset("tiny", tie_embeddings=True))
    with pytest.raises(PipelineError, match="tied to its embedding"):
        split_model(model, 0, 2)
    one = split_model(model, 0, 1)  # one stage: the tie is kept
    assert one.output.weight is one.tok_embeddings.weight

def test_refuses_unknown_models():
    with pytest.raises(PipelineError, match="no attribute 'model'"):
        split_model(torch.nn.Linear(4, 4), 0, 2)

    class NoRotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.embed_tokens = torch.nn.Embedding(8, 4)
            self.model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
            self.model.norm = torch.nn.RMSNorm(4)

    with pytest.raises(PipelineError, match="looked for model.rotary_emb"):
        split_model(NoRotary(), 0, 1)
    with pytest.raises(PipelineError, match="stage_index must be in 0..1"):
        split_model(Llama(LlamaConfig.preset("tiny")), 2, 2)
    with pytest.raises(PipelineError, match="3 pipeline stages for 2 blocks"):
        split_model(Llama(LlamaConfig.preset("tiny")), 0, 3)

def test_schedule_refusals(tmp_path):
    """The checks of build_schedule, on a one-process gloo group."""
    import torch.distributed as dist

    from boost_compile.distributed.pipeline import build_schedule

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = Llama(LlamaConfig.preset("tiny", n_layers=4))
        tokens = torch.zeros(2, 16, dtype=torch.long)
        one = [split_model(model, 0, 1)]
        two = [split_model(model, i, 2) for i in range(2)]
        group = dist.group.WORLD
        with pytest.raises(PipelineError, match="at least 2 stages"):
            build_schedule(one, [0], 1, group, 2, "interleaved_1f1b", None, tokens)
        with pytest.raises(PipelineError, match="one stage per rank"):
            build_schedule(two, [0, 1], 2, group, 2, "1f1b", None, tokens)
        with pytest.raises(PipelineError, match="not divisible by 4 micro-batches"):
            build_schedule(one, [0], 1, group, 4, "gpipe", None, tokens[:1], batch_size=6)
        with pytest.raises(PipelineError, match="choose one of"):
            build_schedule(one, [0], 1, group, 2, "zigzag", None, tokens)
        compiled = [torch.compile(s, backend="boost") for s in two]
        with pytest.raises(PipelineError, match="compiled stage"):
            build_schedule(compiled, [0, 1], 2, group, 2, "zero_bubble", None, tokens)
        from boost_compile.distributed.pipeline import VocabParallelLoss, vocab_parallel_loss
        from boost_compile.distributed.shard import VocabShard

        with pytest.raises(PipelineError, match="returns whole logits: vocab_parallel_loss is for a last stage"):
            build_schedule(one, [0], 1, group, 2, "gpipe", VocabParallelLoss(VocabShard("0", 1, 0, 256)), tokens[:1])
        with pytest.raises(PipelineError, match="parallelize it with parallelize_"):
            vocab_parallel_loss(one[0])
        schedule = build_schedule(one, [0], 1, group, 2, "gpipe", None, tokens[:1])
        from boost_compile.distributed.pipeline import pipeline_step

        with pytest.raises(PipelineError, match="a batch of 3 is not divisible by 2 micro-batches"):
            pipeline_step(schedule, tokens[:1].expand(3, -1), tokens[:1].expand(3, -1))
    finally:
        dist.destroy_process_group()

def test_stream_dtype_follows_a_cast():
    """PipelineStage is told the stream's dtype: a stage cast to bf16 sends and receives bf16."""
    from boost_compile.distributed.pipeline import _example_io

    model = Llama(LlamaConfig.preset("tiny"))
    stage = split_model(model, 0, 2)
    tokens = torch.zeros(2, 16, dtype=torch.long)
    assert _example_io(stage, tokens)[1].dtype == torch.float32
    stage.to(torch.bfloat16)
    inp, out = _example_io(stage, tokens)
    assert inp.dtype == torch.long and out.dtype == torch.bfloat16
