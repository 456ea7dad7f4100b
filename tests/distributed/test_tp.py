"""Tensor parallelism over two gloo processes on CPU, against one process.

Every scenario runs 3 AdamW steps (or 1) on an unsharded model, on its float64 copy
and on its sharded, compiled copy (same starting weights). The loss of every step,
every gathered gradient of every step and the gathered weights after the last
follow the parity rule (conftest.assert_parity): no further from the fp64 run than a
small multiple of the unsharded eager run's own error, in fp32 and in bf16. A
planted bug (one forward all-reduce removed) fails the same rule. The compiled
graphs' collectives are checked against BOOST.md's bytes-per-layer formulas.
"""

from __future__ import annotations

import json
import os

import pytest
import torch.multiprocessing as mp
from conftest import ParityError, assert_parity, extended_deselected

BF16 = 2
T = 2 * 16  # tokens per micro-batch in tp_worker (BATCH * SEQ)
FP32 = 4

SCENARIOS = [
    {"name": "dense-megatron", "model": "tiny-dense:4", "plan": "megatron"},
    {"name": "cola-btp", "model": "tiny:4", "plan": "btp"},
    {"name": "cola-btp-gqa", "model": "tiny", "plan": "btp"},
    {"name": "cola-vanilla", "model": "tiny:4", "plan": "vanilla"},
    {"name": "cola-auto", "model": "tiny:4", "plan": "auto"},
    {"name": "lowrank-btp", "model": "tiny-lowrank:4", "plan": "btp"},
    {"name": "lowrank-vanilla", "model": "tiny-lowrank:4", "plan": "vanilla"},
    {"name": "lowrank-auto", "model": "tiny-lowrank:4", "plan": "auto"},
    {"name": "dense-auto", "model": "tiny-dense:4", "plan": "auto", "steps": 1},
    {"name": "hf-factorized-btp", "model": "hf", "plan": "btp"},
    {"name": "cola-btp-inductor", "model": "tiny:4", "plan": "btp", "inner": "inductor", "steps": 1},
    {"name": "cola-btp-ckpt-lowrank", "model": "tiny:4", "plan": "btp", "checkpoint": "lowrank", "steps": 1},
    {"name": "cola-btp-ckpt-full", "model": "tiny:4", "plan": "btp", "checkpoint": "full", "steps": 1},
    {"name": "cola-btp-separate", "model": "tiny:4", "plan": "btp", "options": {"tp": {"norm_statistic": "separate"}}, "steps": 1},
    {"name": "cola-btp-bf16", "model": "tiny:4", "plan": "btp", "dtype": "bfloat16", "steps": 1},
    {"name": "cola-btp-bf16-separate", "model": "tiny:4", "plan": "btp", "dtype": "bfloat16",
     "options": {"tp": {"norm_statistic": "separate"}}, "steps": 1},
    # the vocabulary-parallel head and loss (the default under btp and megatron): a vocabulary the
    # TP degree does not divide (255: each rank holds 128 columns, the last one padding), a Hugging
    # Face model whose loss (view(-1, vocab_size), cross_entropy) is in the graph, PyTorch's own
    # loss-parallel for vanilla, and the head kept whole on request
    {"name": "cola-btp-vocab255", "model": "tiny:4:vocab255", "plan": "btp"},
    {"name": "dense-megatron-vocab255", "model": "tiny-dense:4:vocab255", "plan": "megatron"},
    {"name": "hf-factorized-btp-vocab255", "model": "hf:vocab255", "plan": "btp", "loss_only": True},
    {"name": "cola-vanilla-loss-parallel", "model": "tiny:4", "plan": "vanilla", "parallelize": {"vocab_parallel": True}},
    {"name": "cola-btp-replicated-head", "model": "tiny:4", "plan": "btp", "parallelize": {"vocab_parallel": False}, "steps": 1},
    # collectives issued early and waited for late (tp.overlap), under both inner compilers
    {"name": "cola-btp-overlap", "model": "tiny:4", "plan": "btp", "options": {"tp": {"overlap": True}}},
    {"name": "cola-btp-overlap-inductor", "model": "tiny:4", "plan": "btp", "inner": "inductor",
     "options": {"tp": {"overlap": True}}, "steps": 1},
    # LaX (the reference model's lax projections, GQA): every projection's latent crosses into the next block
    {"name": "lax-btp", "model": "tiny-lax", "plan": "btp"},
    {"name": "lax-btp-ckpt-lowrank", "model": "tiny-lax", "plan": "btp", "checkpoint": "lowrank", "steps": 1},
    {"name": "bad", "bad_inputs": True},
]

#: Model code written in other styles (tests/models/style_models.py) and tied heads, made
#: low-rank and sharded with btp, or dense with megatron; SGD with momentum, 3 steps.
STYLE_MODELS = {
    "btp": ["nanogpt-fused-lowrank", "nanogpt-split-lowrank", "meta-llama-lowrank", "raw-cola", "raw-cola-transposed",
            "hf-llama-tied-lowrank", "hf-qwen2-lowrank", "hf-gemma-lowrank", "hf-phi3-lowrank",
            # LayerNorm (online LayerNorm) and weightless norms
            "nanogpt-layernorm-lowrank", "nanogpt-layernorm-bias-lowrank", "nanogpt-layernorm-mean100-lowrank",
            "hf-gpt2-lowrank", "hf-opt-lowrank", "modded-lowrank", "modded-layernorm-lowrank",
            # LaX: latents crossing to the next block, and with a gate and a scale on the latent
            "raw-lax", "raw-lax-gated"],
    "megatron": ["nanogpt-fused-dense", "nanogpt-split-dense", "meta-llama-dense", "hf-llama-tied-dense",
                 "hf-qwen2-dense", "hf-gemma-dense", "hf-gpt2-dense", "hf-phi3-dense",
                 "nanogpt-layernorm-dense", "nanogpt-layernorm-bias-dense", "hf-opt-dense", "modded-dense"],
}
STYLE_SCENARIOS = [
    {"name": f"{model}-{plan}", "model": f"style:{model}", "plan": plan, "optim": "sgd"}
    for plan, models in STYLE_MODELS.items() for model in models
] + [
    {"name": "nanogpt-layernorm-bias-lowrank-btp-separate", "model": "style:nanogpt-layernorm-bias-lowrank", "plan": "btp",
     "optim": "sgd", "options": {"tp": {"norm_statistic": "separate"}}},
    {"name": "nanogpt-layernorm-bias-lowrank-btp-ckpt", "model": "style:nanogpt-layernorm-bias-lowrank", "plan": "btp",
     "optim": "sgd", "checkpoint": "lowrank"},
    {"name": "raw-lax-btp-ckpt", "model": "style:raw-lax", "plan": "btp", "optim": "sgd", "checkpoint": "lowrank"},
    {"name": "cola-tied-btp", "model": "tiny:4:tied", "plan": "btp", "optim": "sgd"},
    {"name": "dense-tied-megatron", "model": "tiny-dense:4:tied", "plan": "megatron", "optim": "sgd"},
]
#: Compiled block by block (compile_blocks on the sharded model): each block's graph made this
#: rank's program, the code around the blocks eager on the shards; -> the graphs compiled (blocks
#: of one class and shapes share one; LaX's first block, which receives no latents, has its own).
BLOCK_SCENARIOS = {
    "dense-megatron-block": ({"model": "tiny-dense:4", "plan": "megatron"}, 1),
    "cola-btp-block": ({"model": "tiny:4", "plan": "btp", "explain_block": True}, 1),
    "cola-vanilla-block": ({"model": "tiny:4", "plan": "vanilla"}, 1),
    "cola-btp-vocab255-block": ({"model": "tiny:4:vocab255", "plan": "btp"}, 1),
    "cola-tied-btp-block": ({"model": "tiny:4:tied", "plan": "btp", "optim": "sgd"}, 1),
    # Hugging Face's own loss (a shift, view(-1, V)) on the eager head's vocabulary slice
    # (with config.use_cache=False, as boost-train sets it: a KV cache would make each block compile its own graph)
    "hf-factorized-btp-vocab255-block": ({"model": "hf:vocab255", "plan": "btp"}, 1),
    "lax-btp-block": ({"model": "tiny-lax", "plan": "btp"}, 2),
    "cola-btp-ckpt-lowrank-block": ({"model": "tiny:4", "plan": "btp", "checkpoint": "lowrank", "steps": 1}, 1),
    "cola-btp-inductor-block": ({"model": "tiny:4", "plan": "btp", "inner": "inductor", "steps": 1}, 1),
    # GPT-2: a tied head, wte + wpe, and an output shape read from the stream's width before the blocks
    "hf-gpt2-lowrank-btp-block": ({"model": "style:hf-gpt2-lowrank", "plan": "btp", "optim": "sgd"}, 1),
    # modded-nanogpt: a weightless norm on the embedding and a functional final norm, outside any module
    "modded-lowrank-btp-block": ({"model": "style:modded-lowrank", "plan": "btp", "optim": "sgd"}, 1),
    # OPT: the stream flattened around the MLP and viewed back inside each block
    "hf-opt-lowrank-btp-block": ({"model": "style:hf-opt-lowrank", "plan": "btp", "optim": "sgd"}, 1),
    "meta-llama-dense-megatron-block": ({"model": "style:meta-llama-dense", "plan": "megatron", "optim": "sgd"}, 1),
}
#: Deeper than the two blocks parallelize_ captures: the later blocks' specs are read from the
#: second block's, and must be those a capture of every block gives (whole and per block)
DEEP_SCENARIOS = [
    {"name": "cola-btp-deep", "model": "tiny:4:layers5", "plan": "btp", "whole_capture": True, "steps": 1},
    {"name": "dense-megatron-deep-block", "model": "tiny-dense:4:layers5", "plan": "megatron", "whole_capture": True,
     "unit": "block", "steps": 1},
    {"name": "lax-btp-deep-block", "model": "tiny-lax::layers5", "plan": "btp", "whole_capture": True, "unit": "block",
     "steps": 1},
]
#: VocabShardedLogits (distributed/vocab_logits.py) against the whole logits, two vocabularies
VOCAB_LOGITS = [{"name": "vocab-logits", "vocab_logits": True}]
#: Planted bugs (tp_worker.planted): the parity rule rejects one with verify off; verify finds each,
#: drops it and the run keeps one process's numbers
PLANTED = [{"name": "planted-drop-all-reduce", "model": "tiny:4", "plan": "btp", "plant": "drop_all_reduce", "steps": 1,
            "options": {"verify": False}},
           {"name": "verified-drop-all-reduce", "model": "tiny:4", "plan": "btp", "plant": "drop_all_reduce", "steps": 1},
           {"name": "verified-swap-grouped", "model": "tiny:4", "plan": "btp", "plant": "swap_grouped", "steps": 1},
           {"name": "verified-swap-grouped-block", "model": "tiny:4", "plan": "btp", "plant": "swap_grouped", "steps": 1,
            "unit": "block"}]


BLOCKS = [{"name": name, "unit": "block", **sc} for name, (sc, _graphs) in BLOCK_SCENARIOS.items()]
#: SCENARIOS that are products of claims make test checks one by one (plan auto, vanilla and btp on a
#: second bottleneck model, overlap under Inductor, LaX with checkpointing, a second checkpoint mode,
#: the Hugging Face loss with a padded vocabulary)
PRODUCTS = {"lowrank-auto", "lowrank-vanilla", "cola-btp-overlap-inductor", "lax-btp-ckpt-lowrank",
            "cola-btp-ckpt-full", "lowrank-btp", "hf-factorized-btp-vocab255"}
#: the scenarios only tests marked extended read (make test-extended): the style matrix, per block, deep
EXTENDED = {s["name"] for s in STYLE_SCENARIOS + BLOCKS + DEEP_SCENARIOS} | PRODUCTS


def params(names):
    """``names`` for parametrize, those of :data:`EXTENDED` scenarios marked extended."""
    return [pytest.param(n, marks=pytest.mark.extended) if n in EXTENDED else n for n in names]


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    from tp_worker import worker

    folder = tmp_path_factory.mktemp("tp")
    store, out = str(folder / "store"), str(folder / "results.json")
    scenarios = [s for s in SCENARIOS if s.get("name") not in PRODUCTS] + VOCAB_LOGITS + PLANTED
    if not extended_deselected(request.config):
        scenarios += [s for s in SCENARIOS if s.get("name") in PRODUCTS] + STYLE_SCENARIOS + BLOCKS + DEEP_SCENARIOS
    mp.spawn(worker, args=(2, store, scenarios, out), nprocs=2, join=True)
    with open(out) as f:
        return json.load(f)


def ok(results, name):
    r = results[name]
    assert "error" not in r, r.get("error")
    return r


@pytest.mark.parametrize("name", params([s["name"] for s in SCENARIOS if not s.get("bad_inputs")]))
def test_matches_single_process(results, name):
    r = ok(results, name)
    assert r["missing_grads"] == []
    assert r["graphs"] == 1, "the parallelized model must capture as one graph"
    assert_parity(r["parity"], r["dtype"], name)


@pytest.mark.parametrize("name", params(sorted(BLOCK_SCENARIOS)))
def test_block_by_block_matches_single_process(results, name):
    """Per block, under the same rule as whole: every gradient there, identical blocks one graph."""
    r = ok(results, name)
    assert r["missing_grads"] == []
    assert r["graphs"] == BLOCK_SCENARIOS[name][1]
    assert_parity(r["parity"], r["dtype"], name)
    if "loss_compiled" in r:  # the eager vocabulary-parallel loss is compiled by Inductor when the blocks are
        assert r["loss_compiled"] == (BLOCK_SCENARIOS[name][0].get("inner") == "inductor"), r["loss_compiled"]
    if BLOCK_SCENARIOS[name][0]["plan"] == "btp":  # the stream enters and leaves each block graph d-sharded
        (check, *_rest) = r["check"]["compile"]
        assert check["refused"] == 0


@pytest.mark.extended
def test_explain_per_block_under_tp(results):
    """explain(unit="block") of a model sharded with btp (a copy that keeps every shard's spec): the
    one block graph, shown once with both blocks that run it, is this rank's program (the check
    refused nothing) and sends one layer's btp bytes, none of it counted outside the blocks."""
    r = ok(results, "cola-btp-block")
    shown, cfg = r["explain_block"], r["config"]
    assert shown["blocks"] == {"0": ["layers.0", "layers.1"]} and shown["graphs"] == 1
    text = shown["text"]
    assert "Compiled once, run by 2 block(s): layers.0, layers.1" in text
    assert "nodes checked against the unsharded graph" in text and ", 0 refused" in text
    per_layer = T * (4 * cfg["rank_attn"] + 3 * cfg["rank_mlp"]) * FP32  # the [T, r] sums (test_btp_bytes_per_layer)
    assert f"- forward: 4 collectives, {per_layer + 2 * T * FP32:,} bytes" in text  # and the two norm statistics
    assert f"- backward: 4 collectives, {per_layer:,} bytes" in text
    assert "outside the blocks" not in text


@pytest.mark.parametrize("name", params(s["name"] for s in DEEP_SCENARIOS))
def test_deep_models_are_sharded_from_their_first_blocks(results, name):
    """A 5-layer model: parallelize_ captures 2 blocks (fewer nodes checked than a capture of all
    5), gives every parameter the spec the whole capture gives, and matches one process."""
    r = ok(results, name)
    assert r["specs"] == r["whole_capture"]["specs"]
    assert len([n for n in r["specs"] if n.startswith("layers.4.")]) > 0
    assert r["checked"] < r["whole_capture"]["checked"]
    assert r["missing_grads"] == []
    assert_parity(r["parity"], r["dtype"], name)


@pytest.mark.parametrize("vocab", [256, 255])
def test_vocab_sharded_logits(results, vocab):
    """The eager head's vocabulary slice (per block under TP): the reference models' and Hugging
    Face's cross-entropy (view(-1, V) of the slice, a shift, ignore_index, sum, per row) take the
    vocabulary-parallel loss and gather nothing; label smoothing, a softmax, the last token's
    argmax and a concatenation (logits inside torch.cat's list) gather the logits first. Every
    value and gradient follows the parity rule against the whole logits in fp64 (a vocabulary of
    255 leaves a padded column on the second rank, whose gradient is zero)."""
    r = ok(results, "vocab-logits")
    for name in ("reference", "hugging_face", "per_row", "label_smoothing", "softmax", "last_token", "concatenated"):
        c = r[f"{name}/{vocab}"]
        assert_parity(c["parity"], "float32", f"vocab-sharded logits, {name}, vocabulary {vocab}")
        assert c["padding_grad"] == 0.0 and c["plain"], (name, c)  # the loss is a plain tensor
        parallel = name in ("reference", "hugging_face", "per_row")
        assert (c["vocab_parallel"], c["gather"] == 0) == (1 if parallel else 0, parallel), (name, c)


def test_planted_bug_fails_the_rule(results):
    """One forward all-reduce removed, verify off: the rule rejects the run by orders of magnitude."""
    r = ok(results, "planted-drop-all-reduce")
    assert len(r["planted"]) == 1, r["planted"]  # one all-reduce node removed from the forward graph
    with pytest.raises(ParityError, match=r"ratio \d{3,}"):
        assert_parity(r["parity"], r["dtype"], "one all-reduce removed")


@pytest.mark.parametrize("name", params(s["name"] for s in STYLE_SCENARIOS))
def test_style_matches_single_process(results, name):
    r = ok(results, name)
    assert r["missing_grads"] == []
    assert r["graphs"] == 1
    assert_parity(r["parity"], r["dtype"], name)
    # the sharding-consistency check ran on the compiled graph and refused nothing; explain shows it
    (check,) = r["check"]["compile"]
    assert check["checked"] > 50 and check["refused"] == 0
    (line,) = r["explain_check"]
    assert f"{check['checked']} nodes checked against the unsharded graph, {check['repaired']} repaired" in line


@pytest.mark.extended
def test_online_layernorm(results):
    """Every block LayerNorm of a low-rank nanoGPT rides in its down factor's all-reduce: one
    forward all-reduce per down factor, as with RMSNorm, each carrying the fp32 statistics
    (the sum of squares about the rank's mean and every rank's mean) and the [p + 1, r] rows of
    g_l @ A_l and b @ A; explain lists the sites. The final LayerNorm is gathered, then whole."""
    for name in ("nanogpt-layernorm-bias-lowrank-btp", "nanogpt-layernorm-lowrank-btp"):
        r = ok(results, name)
        online = [line for line in r["tp_collectives"] if line.startswith("layernorm ")]
        assert online == [f"layernorm transformer.h.{i}.ln_{j} (online, in the GEMM's all-reduce)"
                          for i in range(2) for j in (1, 2)], r["tp_collectives"]
        assert len(r["explain_norms"]) >= 4, r["explain_norms"]
        reduces = [c for c in r["collectives"]["forward"] if c["kind"] == "all_reduce" and c["dtype"] == "torch.float32"]
        tokens, p = 2 * 16, 2
        # per block: c_attn's down and c_fc's down read a LayerNorm: [tokens + p (+ 1), r + 1 + p]
        ln_rows = tokens + p + (1 if "bias" in name else 0)
        packed = [c["shape"] for c in reduces if c["shape"][0] == ln_rows]
        assert len(packed) == 2 * 2 and all(width > 1 + p for _rows, width in packed), [c["shape"] for c in reduces]


@pytest.mark.extended
def test_weightless_norms_find_their_place(results):
    """modded-nanogpt's weightless norms: the four block norms online in the down factors'
    all-reduce, the embedding's norm on the sharded stream with its own [T] statistic, the q/k
    norms over the head dim each rank's own, the final norm after the gather before the head."""
    r = ok(results, "modded-lowrank-btp")
    norms = [line for line in r["tp_collectives"] if line.startswith("rmsnorm ")]
    assert sum(line.endswith("(online, in the GEMM's all-reduce)") for line in norms) == 2 * 2, norms
    assert sum(line.endswith("(own statistic all-reduce)") for line in norms) == 1, norms
    gathers = [c for c in r["collectives"]["forward"] if c["kind"] == "all_gather_into_tensor"]
    assert len(gathers) == 1, gathers  # the stream, once, before the final norm
    # the same with OLMo's non-parametric LayerNorm everywhere
    norms = [line for line in ok(results, "modded-layernorm-lowrank-btp")["tp_collectives"] if line.startswith("layernorm ")]
    assert sum(line.endswith("(online, in the GEMM's all-reduce)") for line in norms) == 2 * 2, norms
    assert sum(line.endswith("(own statistic all-reduce)") for line in norms) == 1, norms


#: Shape arguments re-derived per graph: the model's own view/reshape/expand/split
#: sizes that name a sharded dim (2 layers each).
REPAIRS = {
    # per layer: split(n_embd) of the fused c_attn, q/k/v view(B, T, n_head, C // n_head), y.view(B, T, C)
    "nanogpt-fused-lowrank-btp": 2 * 5,
    "nanogpt-fused-dense-megatron": 2 * 5,
    # per layer: the three views and y.view(B, T, C)
    "nanogpt-split-lowrank-btp": 2 * 4,
    # per layer: q/k/v views, the two complex reshapes of RoPE, repeat_kv's expand + reshape for k and v
    "meta-llama-lowrank-btp": 2 * 9,
    "meta-llama-dense-megatron": 2 * 9,
    # per layer: c_attn's and c_fc's Conv1D views back to [B, T, width], the split of c_attn,
    # and the flattening view(-1, width) before each row-parallel Conv1D (q/k/v views use -1 heads)
    "hf-gpt2-dense-megatron": 2 * 5,
}


@pytest.mark.parametrize("name", params(sorted(REPAIRS)))
def test_shape_arguments_repaired(results, name):
    r = ok(results, name)
    assert r["check"]["parallelize"]["repaired"] == REPAIRS[name], r["check"]["repairs"]
    assert r["check"]["compile"][0]["repaired"] == REPAIRS[name]
    if "nanogpt-fused" in name:
        assert sum("split sizes 64 -> 32" in line for line in r["check"]["repairs"]) == 2


@pytest.mark.parametrize("name", params(["nanogpt-fused-lowrank-btp", "hf-llama-tied-lowrank-btp", "hf-gemma-lowrank-btp",
                                         "cola-tied-btp"]))
def test_tied_embedding_is_sliced_once(results, name):
    # the tied table stays whole; its output is sliced where it enters the d-sharded stream,
    # once, and the stream is gathered once before the final norm (Hugging Face models also
    # return their KV cache, sharded on heads: k and v of 2 layers are gathered too)
    check = ok(results, name)["check"]["compile"][0]
    assert (check["scatters"], check["gathers"]) == (1, 1 + (4 if name.startswith("hf-") else 0))


@pytest.mark.extended
def test_megatron_tied_needs_no_slicing(results):
    check = ok(results, "dense-tied-megatron")["check"]["compile"][0]
    assert (check["scatters"], check["gathers"], check["repaired"]) == (0, 0, 0)


def test_auto_picks_the_plan(results):
    # auto on bottleneck blocks sends the same collectives as btp; on dense blocks as megatron
    assert payloads(ok(results, "cola-auto")["collectives"]) == payloads(ok(results, "cola-btp")["collectives"])
    fwd = ok(results, "dense-auto")["collectives"]["forward"]
    assert [c["kind"] for c in fwd] == [c["kind"] for c in ok(results, "dense-megatron")["collectives"]["forward"]]


@pytest.mark.parametrize("mode", ["lowrank", pytest.param("full", marks=pytest.mark.extended)])
def test_checkpointing_repeats_no_collective(results, mode):
    # recompute stops before every all-reduce: backward issues exactly the
    # collectives it issues without checkpointing
    ckpt = ok(results, f"cola-btp-ckpt-{mode}")["collectives"]
    assert payloads(ckpt) == payloads(ok(results, "cola-btp")["collectives"])


def payloads(collectives):
    """What each graph sends, in order: kind, shape, dtype, bytes."""
    return {g: [(c["kind"], c["shape"], c["dtype"], c["bytes"]) for c in cs] for g, cs in collectives.items()}


def reduce_bytes(collectives):
    return sum(c["bytes"] for c in collectives if c["kind"] == "all_reduce")


#: the vocabulary-parallel cross-entropy's forward collectives: the row maximum [T] and the
#: sum of exponentials with the target's logit [T, 2], fp32; its backward needs none
LOSS_FWD = [("all_reduce", [T], T * FP32), ("all_reduce", [T, 2], 2 * T * FP32)]


def head_and_loss(collectives):
    """The head/loss collectives: everything whose payload has a T-sized last dim or T rows of 2."""
    return [(c["kind"], c["shape"], c["bytes"]) for c in collectives if c["shape"] in ([T], [T, 2])]


@pytest.mark.parametrize("name", params(["cola-btp", "lowrank-btp"]))
def test_btp_bytes_per_layer(results, name):
    r = ok(results, name)
    cfg = r["config"]
    n, r_attn, r_mlp, d = cfg["n_layers"], cfg["rank_attn"], cfg["rank_mlp"], cfg["dim"]
    fwd = r["collectives"]["forward"]
    # T*(4 r_attn + 3 r_mlp)*e plus the two fp32 norm statistics [T, 1] per layer, then the loss's
    expected = T * (4 * r_attn + 3 * r_mlp) * FP32 + 2 * T * FP32
    assert head_and_loss(fwd) == LOSS_FWD and head_and_loss(fwd[-2:]) == LOSS_FWD  # the loss's come last
    assert [c["source"] for c in fwd[-2:]] == ["cross_entropy"] * 2
    assert reduce_bytes(fwd) == n * expected + sum(b for _, _, b in LOSS_FWD)
    # one all-reduce per norm+group (q/k/v, gate/up) and per o/down down factor, two for the loss
    assert sum(c["kind"] == "all_reduce" for c in fwd) == 4 * n + 2
    # the stream is gathered once before the final norm
    assert [c["kind"] for c in fwd if c["kind"] != "all_reduce"] == ["all_gather_into_tensor"]
    # backward: the vocabulary-parallel head's input gradient [T, d] (partial sums over the
    # vocabulary slices), then the up factors' input gradients, the same [T, r] widths, summed
    # once per group above the split (q/k/v, gate/up) and once for o and down
    bwd = r["collectives"]["backward"]
    assert head_and_loss(bwd) == []
    assert (bwd[0]["kind"], bwd[0]["bytes"]) == ("all_reduce", T * d * FP32)
    assert reduce_bytes(bwd) == n * T * (4 * r_attn + 3 * r_mlp) * FP32 + T * d * FP32
    assert sum(c["kind"] == "all_reduce" for c in bwd) == 4 * n + 1


#: scenarios whose graph holds the loss and whose head is not tied: the cross-entropy becomes the
#: vocabulary-parallel one (Hugging Face's ForCausalLMLoss included). Meta's Llama returns its
#: logits (loss outside the model), Phi-3's loss runs outside the captured graph (the graph
#: returns its logits), and nanoGPT/GPT-2/Gemma tie their heads: none there
VOCAB_PARALLEL = ["cola-btp", "dense-megatron", "lowrank-btp", "hf-factorized-btp", "cola-btp-vocab255",
                  "dense-megatron-vocab255", "hf-factorized-btp-vocab255", "hf-qwen2-lowrank-btp",
                  "hf-qwen2-dense-megatron"]


#: Hugging Face models return their logits beside the loss: the caller gets them whole (one
#: all-gather per step; the loss-only scenario compiles a step that returns the loss alone)
RETURN_LOGITS = {"hf-factorized-btp", "hf-qwen2-lowrank-btp", "hf-qwen2-dense-megatron"}


@pytest.mark.parametrize("name", params(VOCAB_PARALLEL))
def test_vocab_parallel_loss(results, name):
    r = ok(results, name)
    (check,) = r["check"]["compile"]
    assert check["vocab_parallel_losses"] == 1
    assert "1 vocab-parallel cross-entropy" in r["explain_check"][0]
    # the loss's two [T]-row all-reduces in forward, nothing of the loss in backward, and the
    # [T, V] logits never all-reduced; gathered (forward only) just where the model returns them
    assert head_and_loss(r["collectives"]["forward"]) == LOSS_FWD
    assert head_and_loss(r["collectives"]["backward"]) == []
    vocab = r["config"]["vocab_size"]
    logits = [(g, c["kind"]) for g in ("forward", "backward") for c in r["collectives"][g]
              if c["shape"] and c["shape"][-1] in (vocab, -(-vocab // 2))]
    assert logits == ([("forward", "all_gather_into_tensor")] if name in RETURN_LOGITS else [])


def test_explain_lists_head_and_loss_collectives(results):
    # forward: the stream's gather before the final norm and the loss's two all-reduces, named by
    # the op they come from; backward: the head's [T, d] input gradient (module: the final norm,
    # whose output the head reads)
    r = ok(results, "cola-btp")
    d = r["config"]["dim"]
    fwd, bwd = r["explain_outside"]
    gather = T * d // 2 * FP32
    assert fwd.startswith(f"- outside the blocks (embedding, final norm, head, loss): 3 collectives, {gather + 3 * T * FP32:,} bytes")
    assert f"all_reduce (32,) {T * FP32:,} B (cross_entropy)" in fwd and "(gather_from_tp)" in fwd
    assert bwd.startswith(f"- outside the blocks (embedding, final norm, head, loss): 1 collectives, {T * d * FP32:,} bytes")


@pytest.mark.parametrize("name", params(["meta-llama-lowrank-btp", "meta-llama-dense-megatron", "hf-phi3-lowrank-btp",
                                         "hf-phi3-dense-megatron"]))
def test_returned_logits_are_gathered(results, name):
    # the loss is computed outside the graph from the logits it returns: the head is still
    # cut on the vocabulary, and the logits are gathered whole for the caller
    r = ok(results, name)
    (check,) = r["check"]["compile"]
    assert check["vocab_parallel_losses"] == 0
    vocab_half = 256 // 2
    gathers = [c for c in r["collectives"]["forward"] if c["kind"] == "all_gather_into_tensor"]
    assert gathers[-1]["shape"][-1] == vocab_half


def test_replicated_head_on_request(results):
    r = ok(results, "cola-btp-replicated-head")
    (check,) = r["check"]["compile"]
    assert check["vocab_parallel_losses"] == 0
    assert head_and_loss(r["collectives"]["forward"]) == [] and head_and_loss(r["collectives"]["backward"]) == []


@pytest.mark.parametrize("name", params(["cola-btp-overlap", "cola-btp-overlap-inductor"]))
def test_overlap_moves_waits_not_payloads(results, name):
    # exact (test_matches_single_process), the same collectives in the same order, and in
    # backward work (the weight-gradient GEMMs) now runs between collectives and their waits
    r = ok(results, name)
    assert payloads(r["collectives"]) == payloads(ok(results, "cola-btp")["collectives"])
    by_graph = {d["graph"]: d for d in r["overlap"]}
    n = r["config"]["n_layers"]
    assert by_graph["backward"]["ops_between"] >= 4 * n and by_graph["backward"]["delayed"] > 0
    assert ok(results, "cola-btp")["overlap"] == []  # off by default


def test_vanilla_loss_parallel(results):
    # PyTorch's loss-parallel on the vanilla plan: the head's DTensor plan, exact, and no
    # [T, V] logits gathered
    r = ok(results, "cola-vanilla-loss-parallel")
    vocab = r["config"]["vocab_size"]
    assert not [c for c in r["collectives"]["forward"] if c["kind"] == "all_gather_into_tensor" and c["shape"][-1] * 2 == vocab]


def test_btp_separate_norm_statistic(results):
    """The statistic in its own all-reduce: same bytes in fp32, two more collectives per layer."""
    r, packed = ok(results, "cola-btp-separate"), ok(results, "cola-btp")
    n = r["config"]["n_layers"]
    fwd, fwd_packed = r["collectives"]["forward"], packed["collectives"]["forward"]
    assert reduce_bytes(fwd) == reduce_bytes(fwd_packed)
    assert sum(c["kind"] == "all_reduce" for c in fwd) == 6 * n + len(LOSS_FWD)
    stats = [c for c in fwd if c["kind"] == "all_reduce" and c["shape"] == [2, 16, 1]]
    assert len(stats) == 2 * n and all(c["bytes"] == T * FP32 for c in stats)
    assert r["collectives"]["backward"] == packed["collectives"]["backward"]


def test_btp_bf16_packing_bytes(results):
    """bf16: packing makes the normed groups' payload fp32; separate keeps it bf16 plus fp32 statistics."""
    packed, separate = ok(results, "cola-btp-bf16"), ok(results, "cola-btp-bf16-separate")
    cfg = packed["config"]
    n, ra, rm, d = cfg["n_layers"], cfg["rank_attn"], cfg["rank_mlp"], cfg["dim"]
    # q/k/v and gate/up with their statistic in fp32; o and down in bf16; the loss's
    # collectives are fp32 (the model upcasts its logits)
    per_layer_packed = T * (3 * ra + 1) * FP32 + T * (2 * rm + 1) * FP32 + T * ra * BF16 + T * rm * BF16
    per_layer_separate = T * (4 * ra + 3 * rm) * BF16 + 2 * T * FP32
    loss = sum(b for _, _, b in LOSS_FWD)
    assert reduce_bytes(packed["collectives"]["forward"]) == n * per_layer_packed + loss
    assert reduce_bytes(separate["collectives"]["forward"]) == n * per_layer_separate + loss
    # backward sums the up factors' input gradients and the head's [T, d] input gradient in bf16 either way
    for r in (packed, separate):
        assert reduce_bytes(r["collectives"]["backward"]) == n * T * (4 * ra + 3 * rm) * BF16 + T * d * BF16


@pytest.mark.extended
def test_lax_sends_what_cola_sends(results):
    """LaX under btp: the latent is whole on every rank after its down factor's all-reduce, so
    the crossing adds no collective: forward sends btp's bytes per layer (the [T, r] sums and the
    two norm statistics), exactly what the same model without crossings sends, and backward sums
    each latent's gradient once where its two uses (its own up factor, the next block's) meet.
    A gate on the latent adds one [r] all-reduce of its gradient per projection; low-rank
    checkpointing repeats no collective."""
    lax, cola = ok(results, "raw-lax-btp")["collectives"], ok(results, "raw-cola-btp")["collectives"]
    r, n = 16, 2  # style_models: rank d/4 in every projection, 2 blocks
    assert reduce_bytes(lax["forward"]) == n * (T * 7 * r * FP32 + 2 * T * FP32)
    assert payloads(lax) == payloads(cola)
    gated = ok(results, "raw-lax-gated-btp")["collectives"]
    assert payloads({"forward": gated["forward"]}) == payloads({"forward": lax["forward"]})
    gates = [c for c in gated["backward"] if c["shape"] == [r]]
    assert len(gates) == 7 * n and all(c["bytes"] == r * FP32 for c in gates)
    assert reduce_bytes(gated["backward"]) == reduce_bytes(lax["backward"]) + 7 * n * r * FP32
    assert payloads(ok(results, "raw-lax-btp-ckpt")["collectives"]) == payloads(lax)
    # the reference model's LaX preset (GQA) sends what its CoLA preset sends, checkpointed or not
    ref = ok(results, "lax-btp")["collectives"]
    assert payloads(ref) == payloads(ok(results, "cola-btp-gqa")["collectives"])
    assert payloads(ok(results, "lax-btp-ckpt-lowrank")["collectives"]) == payloads(ref)


@pytest.mark.parametrize("name", params(["cola-vanilla", "lowrank-vanilla"]))
def test_vanilla_bytes_per_layer(results, name):
    r = ok(results, name)
    d, d_ff, n = r["config"]["dim"], r["config"]["ffn_dim"], r["config"]["n_layers"]
    assert reduce_bytes(r["collectives"]["forward"]) == n * T * (5 * d + 2 * d_ff) * FP32


def test_btp_sends_far_less_than_vanilla(results):
    btp = reduce_bytes(ok(results, "cola-btp")["collectives"]["forward"])
    vanilla = reduce_bytes(ok(results, "cola-vanilla")["collectives"]["forward"])
    assert btp * 5 <= vanilla


def test_bad_inputs(results):
    r = results["bad"]
    assert "TP degree 2 must divide heads (1)" in r["heads"]
    assert "TP degree 2 must divide kv-heads (1)" in r["kv_heads"]  # read from Meta's model.params
    assert "plan megatron is for dense blocks" in r["megatron_on_lowrank"]
    assert "plan btp needs every block linear to be a bottleneck" in r["btp_on_dense"]
    # refused before any step, naming the op and the model's source line
    for case, op, source in [("hand_layernorm", "mean over dim 2, which is sharded", "style_models.py"),
                             ("stream_mean", "mean over dim 2, which is sharded", "tp_worker.py"),
                             ("stream_view", "merged under dim 2", "tp_worker.py"),
                             ("stream_gram", "contracts over a sharded dim", "tp_worker.py"),
                             ("stream_cumsum", "cumsum has a sharded input and no sharding rule", "tp_worker.py")]:
        assert r[case].startswith("ParallelizeError"), r[case]
        assert op in r[case] and "model source: " in r[case] and source in r[case], r[case]
    assert "choose one of" in r["plan_name"]
    assert "DeviceMesh or a ProcessGroup" in r["not_a_group"]
    # per block: code between two blocks would run on a d-slice under btp (named, with its line);
    # replicated under megatron it runs whole; only the boost backend makes a block this rank's program
    assert r["block_between"].startswith("BlockCompileError"), r["block_between"]
    assert "view between two blocks (tp_worker.py:" in r["block_between"], r["block_between"]
    assert r["block_megatron_between"] == "no error"
    assert "compiles only with the boost backend" in r["block_backend"]
    assert "backend='boost'" in r["eager_run"]
    assert "backend='boost'" in r["other_backend"]


def test_not_initialised():
    import torch

    import boost_compile as bc
    from boost_compile.models import Llama, LlamaConfig

    if torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(bc.ParallelizeError, match="not initialised"):
        bc.parallelize_(Llama(LlamaConfig.preset("tiny")), (torch.zeros(1, 8, dtype=torch.long),), 2, "btp")


os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


#: what verify says of each graph: the rank's program after the TP passes, then the finished compile
RANK_PROGRAM = "tp_localize + group_linears + tp_collectives: verified"


def rank_program_verified(line: str) -> bool:
    """The TP passes' check (group_linears between them where it grouped something)."""
    return line.startswith("tp_localize + ") and " + tp_collectives: verified (" in line


@pytest.mark.parametrize("name", params(["cola-btp", "dense-megatron", "lax-btp", "cola-btp-vocab255", "cola-btp-inductor",
                                         "cola-btp-ckpt-lowrank", "hf-factorized-btp-vocab255", "cola-btp-overlap"]))
def test_verify_checks_the_rank_program(results, name):
    """Each rank's program is run by both ranks against the unsharded model (the shards gathered,
    the markers read as identities) and judged by the parity rule on this rank's slices: after the
    TP passes and whatever ran between them, as one program, and the finished compile."""
    r = ok(results, name)
    for lines in r["verify"]:
        assert any(rank_program_verified(line) for line in lines), lines
        assert any(line.startswith("compiled (") and ": verified" in line for line in lines), lines
        assert not any("dropped" in line for line in lines), lines
    assert r["verify_warnings"] == [] and r["dropped"] == []


@pytest.mark.parametrize("name", params(sorted(BLOCK_SCENARIOS)))
def test_verify_checks_each_block_program(results, name):
    """Per block under btp a block takes and returns this rank's slice of the stream: its input is
    gathered for the reference, and its output's cotangent and its input's gradient are this rank's
    slices of the whole ones. DTensor parameters (vanilla) are said to be unverified."""
    r = ok(results, name)
    for lines in r["verify"]:
        if BLOCK_SCENARIOS[name][0]["plan"] == "vanilla":
            assert lines == ["not verified: DTensor inputs (each rank's program is part of a whole)"], lines
        else:
            assert any(rank_program_verified(line) for line in lines) and not any("dropped" in x for x in lines), lines


def test_verify_drops_a_planted_aten_bug_under_tp(results):
    """The forward all-reduce removed by an ATen pass: the finished compile fails on both ranks, each
    falls back to its rank's program as the Torch-IR passes left it (verified), and trains as one process."""
    r = ok(results, "verified-drop-all-reduce")
    assert len(r["planted"]) == 1, r["planted"]
    (lines,) = r["verify"]
    assert lines[0].startswith(RANK_PROGRAM), lines
    assert lines[1].startswith("compiled (aot_eager, ATen passes planted_drop_all_reduce): dropped"), lines
    assert lines[2].startswith("this rank's program (eager): verified"), lines
    assert len(r["verify_warnings"]) == 1 and "this rank's program runs eagerly" in r["verify_warnings"][0]
    assert_parity(r["parity"], r["dtype"], "planted all-reduce drop, verified")


@pytest.mark.parametrize("name", ["verified-swap-grouped", "verified-swap-grouped-block"])
def test_verify_drops_a_planted_rewrite_between_the_tp_passes(results, name):
    """A pass after group_linears hands one grouped member another's output: the rank's program (checked
    once tp_collectives made it whole) fails, the planted pass is undone, tp_collectives runs again on
    the graph before it, and that program (grouping kept) is verified; both ranks agree."""
    r = ok(results, name)
    for lines in r["verify"]:
        assert lines[0].startswith("tp_localize + group_linears + planted_swap_grouped_outputs + tp_collectives: dropped"), lines
        assert lines[1].startswith(RANK_PROGRAM), lines
    assert r["dropped"] == ["planted_swap_grouped_outputs"] * len(r["verify"])
    assert "not searched under TP" in r["verify_warnings"][0]
    assert_parity(r["parity"], r["dtype"], name)
