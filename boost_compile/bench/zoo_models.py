"""The zoo's tiny models: every causal-LM architecture of transformers built small from its own
config class (:data:`SHRINK`, and per architecture :data:`OVERRIDES`), in float32, train mode,
every dropout off. The runner and its tables are :mod:`boost_compile.bench.zoo`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Input shape (batch, tokens) and the vocabulary of the tiny models.
BATCH, SEQ, VOCAB = 2, 16, 128
#: Random input tokens are drawn from [TOKEN_LOW, TOKEN_HIGH); special tokens (padding,
#: image, audio ...) outside that range move to [TOKEN_HIGH, VOCAB).
TOKEN_LOW, TOKEN_HIGH = 4, 96

# ----------------------------------------------------------------------------- tiny configs

#: The shrunk value of every size field the config classes use for it; a field is set only
#: where the architecture's config has it. (Key/value heads follow :func:`_kv_heads`.)
SHRINK: dict[str, Any] = {
    # width
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "emb_dim", "word_embed_proj_dim", "embedding_size",
                     "hidden_dim", "hidden_size_global"), 64),
    # depth
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                     "num_decoder_layers", "num_encoder_layers"), 2),
    # attention heads
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "attention_heads", "num_decoder_attention_heads",
                     "num_encoder_attention_heads"), 4),
    **dict.fromkeys(("head_dim", "attention_head_size", "d_head", "dim_head", "kv_channels"), 16),
    # vocabulary
    "vocab_size": VOCAB,
    # feed-forward
    **dict.fromkeys(("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "shared_intermediate_size", "ffn_hidden_size", "dim_ff",
                     "feed_forward_size", "dense_intermediate_size", "first_dense_intermediate_size",
                     "prefix_dense_intermediate_size", "intermediate_size_mlp", "mlp_only_intermediate_size",
                     "expert_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                     "shared_experts_intermediate_size", "dff", "d_inner"), 128),
    # experts
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "top_k", "moe_topk", "num_experts_per_token", "top_k_experts", "moe_k"), 2),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    # multi-head latent attention (DeepSeek V2/V3 and the models built on it)
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "qk_head_dim": 24,
    "v_head_dim": 16,
    # sparse-attention indexers (DeepSeek V3.2's DSA)
    **dict.fromkeys(("index_n_heads", "index_num_heads", "indexer_n_heads"), 2),
    **dict.fromkeys(("index_head_dim", "indexer_head_dim"), 16),
    # linear attention (Gated DeltaNet, KDA)
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), 16),
    "linear_num_key_heads": 2,
    **dict.fromkeys(("linear_num_value_heads", "linear_num_heads"), 4),
    # state-space layers
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size"), 16),
    **dict.fromkeys(("mamba_n_groups", "mamba_ngroups"), 1),
    # Mamba-2 heads: n_heads * head_dim = expand (2) * hidden
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 8),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 16),
    "mamba_chunk_size": 8,
    "mamba_dt_rank": 4,
    "mamba_d_ssm": 128,
    # per-layer inputs (Gemma 3n, Gemma 4): a small table
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    # positions: a learned table stays small
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx"), 256),
    "rotary_dim": 8,
    # sliding-window layers with sizes of their own (Inkling)
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "unpadded_vocab_size": VOCAB,
    # training: no key/value cache
    "use_cache": False,
}

#: Per architecture, what the generic shrink cannot know: config values set on the text
#: config (``"top"``: on a composite config itself), a reason the architecture is skipped
#: (``"skip"``), or the number of layers where a hybrid needs more than two to hold one layer
#: of each kind. Keys outside the config's own fields are refused, so a typo shows.
OVERRIDES: dict[str, dict[str, Any]] = {
    # hybrids: one layer of each kind (the defaults put the first attention layer past layer 2)
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "use_mamba_kernels": False},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "chunk_size": 8},
    "dbrx": {"sub": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}}},
    "blt": {"top": {"encoder_hash_byte_group_vocab": 512}},
    "zaya": {"num_experts_per_tok": 1},
    # a sliding layer, an indexer layer and an indexed layer that reads the indexer's keys/values
    "kolibri1_1": {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "indexed_attention", "indexed_attention"],
                   "index_layers": [1], "kv_source_layers": [0, 1, 1], "mlp_only_layers": [0]},
    # shared attention blocks tied across the hybrid layers: two of them
    "zamba": {"num_hidden_layers": 3},
    "zamba2": {"num_hidden_layers": 3, "chunk_size": 8, "adapter_rank": 8},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 2, "hc_lowrank": 16, "ple_embed_dim": 64},
    "qwen4_exp": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                  "indexer_compress_ratio": 2, "hc_lowrank": 16, "ple_embed_dim": 64},
    "prophetnet": {"drop": ["num_hidden_layers"]},
    "reformer": {"is_decoder": True, "axial_pos_shape": [4, 4], "axial_pos_embds_dim": [16, 48],
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8},
    "xmod": {"default_language": "en_XX"},
    "musicgen": {"num_codebooks": 1},
    "musicgen_melody": {"num_codebooks": 1},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2},
    "gemma3n": {"num_hidden_layers": 4, "num_kv_shared_layers": 2},
    # DeepSeek-style latent attention whose sliding-window layers have their own sizes
    "dots3_note_text": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 32,
                        "swa_kv_lora_rank": 16, "swa_head_dim": 24, "swa_qk_nope_head_dim": 16, "swa_v_head_dim": 16},
    "dots3_note": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 32,
                   "swa_kv_lora_rank": 16, "swa_head_dim": 24, "swa_qk_nope_head_dim": 16, "swa_v_head_dim": 16,
                   "sub": {"vision_config": {"adapter_in_dim": 64, "adapter_out_dim": 64},
                           "audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64}}},
    "roc_bert": {"shape_vocab_size": VOCAB, "pronunciation_vocab_size": VOCAB, "shape_embed_dim": 16,
                 "pronunciation_embed_dim": 16},
    "gemma4_assistant": {"skip": "a draft model: its forward reads the key/value states of a main model"},
    "gemma4_unified_assistant": {"skip": "a draft model: its forward reads the key/value states of a main model"},
}


def architectures() -> dict[str, str]:
    """model_type -> class name of every causal-LM architecture of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class ZooSkip(Exception):  # noqa: N818 - a reason, not a failure
    """An architecture the zoo cannot run (no tiny config, eager fails ...): the reason."""


def _kv_heads(default: Any, default_heads: Any) -> Any:
    """Key/value heads of the tiny model: as many as its 4 heads where the architecture has no
    grouped-query attention, one where it has multi-query attention, else 2."""
    if default is None:
        return SHRINK["num_attention_heads"]
    if not isinstance(default, int) or isinstance(default, bool):
        return default
    if default == 1:
        return 1
    return SHRINK["num_attention_heads"] if default == default_heads else 2


#: Fields set even where the default config leaves them None (None would mean "derive it",
#: or an architecture whose defaults do not run).
EVEN_IF_NONE = frozenset({"head_dim", "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "num_experts",
                          "moe_k"})
#: Fields that count leading dense layers before the expert layers.
DENSE_PREFIX_FIELDS = ("first_k_dense_replace", "num_dense_layers", "num_dense_blocks")
KV_HEAD_FIELDS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "num_query_groups", "n_kv_heads")
HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "n_heads")


def _is_dropout_field(name: str) -> bool:
    n = name.lower()
    return ("dropout" in n or n.endswith("pdrop") or "layerdrop" in n or n.endswith("drop_rate")
            or n in ("drop_path_rate", "mask_time_prob", "mask_feature_prob", "router_jitter_noise", "jitter_noise",
                     "input_jitter_noise"))


def _layer_lists(cfg: Any, n_layers: int) -> dict[str, list]:
    """The per-layer lists of ``cfg`` (``layer_types``, ``mlp_layer_types``, a size per layer
    ...): those as long as its layer count."""
    out = {}
    for key, value in cfg.to_dict().items():
        if isinstance(value, list) and len(value) == n_layers and n_layers > 1 and key not in ("architectures",):
            if all(isinstance(v, (str, bool, int, float)) or v is None for v in value):
                out[key] = value
    return out


def _is_kind_list(values: list) -> bool:
    """A list of layer kinds ("full_attention", "mamba", True ...), not of numbers."""
    return all(isinstance(v, (str, bool)) or v is None for v in values)


def _first_of_each(values: list) -> list:
    seen: list = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def _layer_count_field(cfg: Any) -> str | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
        if isinstance(getattr(cfg, key, None), int):
            return key
    return None


def tiny_text_kwargs(default: Any, override: Mapping[str, Any]) -> dict[str, Any]:
    """The config kwargs that make ``default`` (an architecture's default config, or its text
    config) tiny: :data:`SHRINK` where it has the field, zero dropout, one layer of each kind
    of its per-layer lists, special tokens inside the vocabulary, then ``override``."""
    fields = default.to_dict()
    kw: dict[str, Any] = {k: v for k, v in SHRINK.items() if k in fields and (fields[k] is not None or k in EVEN_IF_NONE)}
    default_heads = next((fields[h] for h in HEAD_FIELDS if isinstance(fields.get(h), int)), None)
    for key in KV_HEAD_FIELDS:
        if key in fields:
            kw[key] = _kv_heads(fields[key], default_heads)
    for key in DENSE_PREFIX_FIELDS:  # a leading dense layer or none, so that layer 1 has experts
        if isinstance(fields.get(key), int) and not isinstance(fields[key], bool):
            kw[key] = min(fields[key], 1)
    if isinstance(fields.get("qk_rope_head_dim"), int) and fields.get("head_dim") == fields["qk_rope_head_dim"]:
        kw["head_dim"] = SHRINK["qk_rope_head_dim"]  # latent attention: head_dim is the rotary part
    for key, value in fields.items():
        if _is_dropout_field(key) and isinstance(value, float):
            kw[key] = 0.0
    # per-layer lists: one layer of each kind, in the order they first appear
    count_key = _layer_count_field(default)
    if count_key is not None:
        lists = _layer_lists(default, getattr(default, count_key))
        n = max([2, *(len(_first_of_each(v)) for v in lists.values() if _is_kind_list(v))])
        n = override.get(count_key, n)
        kw[count_key] = n
        for key, values in lists.items():
            if key in kw and not isinstance(kw[key], list):  # a size per layer: the shrunk size in each
                kw[key] = [kw[key]] * n
                continue
            kinds = _first_of_each(values)
            kw[key] = (kinds + [kinds[-1]] * n)[:n] if len(kinds) <= n else values[:n]
    # special tokens: inside the tiny vocabulary, above the random tokens
    spare = iter(range(VOCAB - 1, TOKEN_HIGH - 1, -1))
    for key, value in fields.items():
        if not (key.endswith("_token_id") or key.endswith("_token_index") or key.endswith("_token_ids")):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= TOKEN_HIGH:
            kw[key] = next(spare)
        elif isinstance(value, list) and any(isinstance(v, int) and v >= TOKEN_HIGH for v in value):
            kw[key] = [next(spare) if isinstance(v, int) and v >= TOKEN_HIGH else v for v in value]
    kw.update({k: v for k, v in override.items() if k not in ("top", "skip", "sub", "drop")})
    for key in override.get("drop", ()):
        kw.pop(key, None)
    return kw


def _composite_text_key(cfg: Any) -> str | None:
    for key in ("text_config", "decoder_config", "decoder"):
        if getattr(cfg, key, None) is not None and hasattr(getattr(cfg, key), "to_dict"):
            return key
    return None


def _sub_configs(cfg: Any) -> list[str]:
    return [k for k in getattr(cfg, "sub_configs", {}) if getattr(cfg, k, None) is not None]


def tiny_config(model_type: str, extra: Mapping[str, Any] | None = None) -> Any:
    """A tiny config of ``model_type`` (its own config class), as :func:`tiny_text_kwargs` makes
    it; for a composite config the text config is shrunk and every other sub-config too.
    ``extra``: more overrides, on top of :data:`OVERRIDES` (a variant: ``first_k_dense_replace=2``)."""
    from transformers import AutoConfig

    override = {**OVERRIDES.get(model_type, {}), **(extra or {})}
    if "skip" in override:
        raise ZooSkip(override["skip"])
    top = dict(override.get("top", {}))
    try:
        default = AutoConfig.for_model(model_type, **top)
    except Exception as exc:  # noqa: BLE001 - a config class that cannot build its own defaults
        raise ZooSkip(f"default config fails: {_one_line(exc)}") from exc
    text_key = _composite_text_key(default)
    subs = _sub_configs(default)
    kw = {k: v for k, v in tiny_text_kwargs(default, override if text_key is None else {}).items() if k not in subs}
    for key in subs:
        sub = getattr(default, key)
        sub_override = override if key == text_key else override.get("sub", {}).get(key, {})
        kw[key] = {"model_type": sub.model_type, **tiny_text_kwargs(sub, sub_override)}
    kw.update(top)
    try:
        return AutoConfig.for_model(model_type, **kw)
    except Exception as exc:  # noqa: BLE001
        raise ZooSkip(f"tiny config fails: {_one_line(exc)}") from exc


def _dropout_types() -> tuple[type, ...]:
    import torch.nn as nn

    return (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def zero_dropout(model: Any) -> None:
    """Every dropout of ``model`` off: ``nn.Dropout`` modules and float attributes named so."""

    dropouts = _dropout_types()
    for module in model.modules():
        if isinstance(module, dropouts):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if isinstance(value, float) and not isinstance(value, bool) and _is_dropout_field(key):
                setattr(module, key, 0.0)


def build(model_type: str, seed: int = 0, extra: Mapping[str, Any] | None = None) -> Any:
    """The tiny model of ``model_type`` in float32, train mode, every dropout off (``extra``:
    more config overrides)."""
    import torch
    import transformers

    cfg = tiny_config(model_type, extra)
    name = architectures()[model_type]
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ZooSkip(f"transformers has no class {name}")
    cfg = _config_for(cls, cfg)
    torch.manual_seed(seed)
    try:
        model = cls(cfg)
    except Exception as exc:  # noqa: BLE001
        raise ZooSkip(f"building {name} fails: {_one_line(exc)}") from exc
    _eager_experts(model)
    model = model.float().train()
    zero_dropout(model)
    return model


def _eager_experts(model: Any) -> None:
    """Mixtures of experts run transformers' "eager" experts (a loop over the experts):
    its default on CPU, ``torch._grouped_mm``, has no float64 kernel, and the truth must run
    the same program as the two float32 runs."""
    cfgs = [model.config, *(getattr(model.config, k) for k in _sub_configs(model.config))]
    if not any(getattr(c, "_experts_implementation", None) not in (None, "eager") for c in cfgs):
        return
    try:
        model.set_experts_implementation("eager")
    except Exception as exc:  # noqa: BLE001
        raise ZooSkip(f"cannot set the eager experts: {_one_line(exc)}") from exc


def _config_for(cls: Any, cfg: Any) -> Any:
    """``cfg``, or the sub-config of it that ``cls`` is built from (a text-only class mapped to a
    composite config: ``Qwen3_5ForCausalLM`` for ``qwen3_5``)."""
    want = getattr(cls, "config_class", None)
    if want is None or isinstance(cfg, want):
        return cfg
    for key in _sub_configs(cfg):
        if isinstance(getattr(cfg, key), want):
            return getattr(cfg, key)
    return cfg


def _one_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception (with the line that names the cause where the first
    only introduces it, as a config validator's does)."""
    text = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    line = text[0] if text else ""
    if line.endswith(":") and len(text) > 1:
        line = f"{line} {text[1]}"
    return f"{type(exc).__name__}: {line}"[:300]
