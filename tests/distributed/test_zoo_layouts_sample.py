"""A sample of the layout zoo (boost_compile/bench/zoo_layouts.py) inside the suite: tiny Hugging Face
models, one per construct that tensor parallelism must shard exactly, each 3 SGD steps on 2 gloo
ranks with the loss and every gathered gradient of every step judged by the parity rule against one
process and its float64 copy (``make zoo-layouts`` runs every architecture).

Under megatron: Qwen3 (q/k norms over head_dim, one weight shared by the heads: its gradient summed
over the group), OLMo 2 (q/k norms over all heads: cut like the projection, the statistic summed),
gpt-oss (per-head attention sinks cut by heads, experts), Cohere (an interleaved rotary written with
``stack``), Apertus (xIELU's scalar parameters in the sharded MLP), DeepSeek-V3 (latent attention
and experts; tests/distributed/test_tp_mla.py, marked extended, has the MLA variants); the last
three are marked extended, for the suite's time. Under FSDP2
as boost-train applies it, blocks compiled one by one: Gemma 3 (sliding windows, q/k norms) and
Mixtral (experts). Each must come out ``exact``.
The same constructs under btp, whole model and per block, are tests/distributed/test_tp_head_params.py's
(one process group for both plans there; a second group here would cost its start-up)."""

from __future__ import annotations

import pytest

from boost_compile.bench import zoo_layouts as zl

SAMPLE = {"tp2-megatron": ("qwen3", "olmo2", "gpt_oss"),
          "fsdp2": ("gemma3_text", "mixtral")}
#: marked extended, for the suite's time: the rest of the megatron sample
MORE = {"tp2-megatron-more": ("tp2-megatron", ("cohere", "apertus", "deepseek_v3"))}


@pytest.mark.parametrize("layout", [*sorted(SAMPLE), *(pytest.param(k, marks=pytest.mark.extended) for k in MORE)])
def test_the_sample_is_exact(layout, tmp_path):
    pytest.importorskip("transformers")
    name, names = MORE.get(layout, (layout, SAMPLE.get(layout)))
    results, groups = zl.run_layout(zl.LAYOUTS[name], names, tmp_path / f"{layout}.jsonl", timeout=300,
                                    echo=lambda _line: None)
    assert groups == 1
    got = {r.model_type: (r.cls, r.reason) for r in results}
    assert got == {n: ("exact", "") for n in names}, got
    for r in results:
        assert r.missing == [] and 0 <= r.margin < 1, (r.model_type, r.missing, r.margin)
