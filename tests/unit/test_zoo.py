"""The zoo's representative subset: one forward+backward of tiny transformers models through
boost (aot_eager), judged by the parity rule against eager fp32 and float64.

The full zoo (``make zoo``, ``python -m boost_compile.bench.zoo``) runs every causal-LM
architecture of transformers, each in a child process, with torch's own aot_eager beside
boost; here one architecture of each structure runs in this process with the same runner
(:func:`boost_compile.bench.zoo.run_one`), without the aot_eager reference and with
``verify`` off: the passes themselves must get these models right, not the safety net that
undoes a wrong rewrite.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from boost_compile.bench import zoo  # noqa: E402

#: boost's options here: the passes alone (verify would undo a wrong rewrite and hide it)
OPTIONS = {"verify": False}

#: name -> (model_type, extra config overrides) for the variants of one architecture
VARIANTS = {
    # latent attention with a dense MLP in both layers
    "deepseek_v3:dense": ("deepseek_v3", {"first_k_dense_replace": 2}),
}

#: one architecture of each structure the zoo finds, and whether group_linears has sites in it
EXACT = {
    "deepseek_v3": True,         # latent attention (MLA), layer 1 routed + shared experts (3-D weights)
    "deepseek_v3:dense": True,   # latent attention, dense MLP
    "deepseek_v2": True,         # latent attention without q LoRA, experts in both layers
    "minicpm3": True,            # latent attention, dense
    "gpt_oss": True,             # experts with biases (3-D weights), attention sinks
    "llama4_text": True,         # experts (3-D weights) + shared expert, chunked attention
    "nemotron_h": True,          # Mamba-2 + attention + experts hybrid
    "qwen3_next": True,          # gated DeltaNet linear attention + full attention, experts
    "gpt2": False,               # Conv1D: addmm linears against [d_in, d_out] weights
    "mamba": False,              # torch.vmap bookkeeping left unused by the capture (kept by the passes)
    "phimoe": True,              # an autograd.Function router whose backward writes in place
    "gemma3n_text": True,        # a grouped member's output scaled in place (not grouped, the rest is)
}

#: architectures boost gets wrong today, with the construct that does it (the zoo's report);
#: none at the last full run: the ones it found are fixed and in EXACT
KNOWN_BUGS: dict[str, tuple[str, str]] = {}


def _run(name: str) -> zoo.ZooResult:
    model_type, extra = VARIANTS.get(name, (name, None))
    model = zoo.build(model_type, extra=extra)
    return zoo.run_one(model_type, reference=False, options=OPTIONS, model=model)


#: variants of a structure another entry already covers (MLA dense: minicpm3; MLA with experts:
#: deepseek_v3): make test-extended
EXTENDED = {"deepseek_v3:dense", "deepseek_v2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if n in EXTENDED else n for n in EXACT])
def test_exact(name):
    result = _run(name)
    assert result.cls == "exact", f"{name}: {result.cls}: {result.reason}\n{result.worst}"
    assert bool(result.grouped) == EXACT[name], f"{name}: group_linears rewrote {result.grouped_sites}"


@pytest.mark.parametrize("name", list(KNOWN_BUGS))
def test_known_bugs(name):
    """Each known bug still ends in the class its description says (xfail); a fixed one fails
    here until it moves to EXACT, a changed failure fails as news."""
    expected, why = KNOWN_BUGS[name]
    result = _run(name)
    assert result.cls != "exact", f"{name} is exact now: move it from KNOWN_BUGS to EXACT"
    assert result.cls == expected, f"{name}: {result.cls} (expected {expected}): {result.reason}"
    pytest.xfail(why)
