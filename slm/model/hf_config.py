"""A Hugging Face config.json (as a dict) -> ModelShape. Pure Python: no jax, no files, no weights.

The model layer's one place that knows transformers' config keys, so the memory arithmetic can plan a
pretrained model from its config alone (slm.memory.finetune) and the loader (slm.io.hf_import) builds the
same shape. Raises a one-line RunError for what this trainer's model cannot express.
"""

from __future__ import annotations

from slm.errors import RunError
from slm.model.sizing import ModelShape

FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3"}

# The rope scalings slm.model.rope computes, with their parameters in the order of its scaling tuple.
SCALING_KEYS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "linear": ("factor",)}


def shape_from_hf_config(cfg: dict, where: str = "config.json") -> ModelShape:
    """The ModelShape of a transformers config.json; one-line RunErrors for what this model cannot do."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in FAMILIES:
        raise RunError(f"{where}: architecture {arch!r} is not supported; use one of {', '.join(FAMILIES)}")
    family = FAMILIES[arch]
    if family == "gemma3":
        fields = gemma3_fields(cfg, where)
    else:
        refuse_unsupported(cfg, where)
        # attention_bias (Llama, Mistral, Qwen3): biases on q, k, v and o_proj alike; Qwen2's are on q, k, v only
        fields = dict(qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias")),
                      o_bias=family != "qwen2" and bool(cfg.get("attention_bias")), rope_theta=rope_theta(cfg),
                      tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), qk_norm=family == "qwen3",
                      rope_scaling=rope_scaling(cfg, where))
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    head = cfg.get("head_dim") or D // H
    return ModelShape(vocab_size=cfg["vocab_size"], n_layers=cfg["num_hidden_layers"], d_model=D, n_heads=H,
                      d_ff=cfg["intermediate_size"], n_kv_heads=cfg.get("num_key_value_heads") or H,
                      head_size=None if head * H == D else head, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                      **fields)


def gemma3_fields(cfg: dict, where: str) -> dict:
    """Gemma 3's block: (1 + w) norms, sandwich norms, embeddings x sqrt(hidden), GeGLU (tanh), q/k norms, a
    query scale, sliding-window layers with their own rope theta, in either config layout (the hub's
    `sliding_window_pattern` + `rope_local_base_freq`, or transformers 5's `layer_types` + per-type
    `rope_parameters`). Soft-capping, bidirectional attention and other activations are refused."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise RunError(f"{where}: {key} {cfg[key]} is not supported (Gemma 3 has none; Gemma 2 does)")
    if cfg.get("use_bidirectional_attention"):
        raise RunError(f"{where}: use_bidirectional_attention is not supported (this model is causal)")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise RunError(f"{where}: hidden_activation {act!r} is not supported (Gemma 3's is gelu_pytorch_tanh)")
    if cfg.get("attention_dropout") or cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise RunError(f"{where}: attention_dropout, attention_bias and mlp_bias are not supported; set them off")
    n, window = cfg["num_hidden_layers"], int(cfg.get("sliding_window") or 0)
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                       for i in range(n)]
    if set(types) - {"full_attention", "sliding_attention"} or len(types) != n:
        raise RunError(f"{where}: layer_types {sorted(set(types))} (for {len(types)} of {n} layers) not supported")
    per_type = cfg.get("rope_parameters") if "full_attention" in (cfg.get("rope_parameters") or {}) else None
    if per_type:  # transformers 5: {"full_attention": {...}, "sliding_attention": {...}}
        full, local = per_type["full_attention"], per_type.get("sliding_attention") or {}
        if (local.get("rope_type") or "default") != "default":
            raise RunError(f"{where}: rope scaling {local['rope_type']!r} on the sliding layers is not supported")
        theta, local_theta = float(full.get("rope_theta", 1e6)), float(local.get("rope_theta", 10000.0))
        scaling = rope_scaling({"rope_parameters": full}, where)
    else:  # the hub's layout
        theta, local_theta = float(cfg.get("rope_theta") or 1e6), float(cfg.get("rope_local_base_freq") or 10000.0)
        scaling = rope_scaling({"rope_scaling": cfg.get("rope_scaling")}, where)
    return dict(tie_embeddings=bool(cfg.get("tie_word_embeddings", True)), rope_theta=theta, qk_norm=True,
                rope_scaling=scaling, norm_plus_one=True, sandwich_norms=True, embed_scale=True, mlp_act="gelu_tanh",
                query_scale=float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5, rope_local_theta=local_theta,
                layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types))


def rope_settings(cfg: dict) -> dict:
    """The rotary embedding's settings in either layout found in the wild: the hub's `rope_scaling` (+ a
    top-level `rope_theta`), or transformers 5's `rope_parameters` (type, theta and scaling together)."""
    merged: dict = {}
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(cfg.get(key), dict):
            merged.update(cfg[key])
    return merged


def rope_theta(cfg: dict) -> float:
    return float(cfg.get("rope_theta") or rope_settings(cfg).get("rope_theta") or 10000.0)


def rope_scaling(cfg: dict, where: str = "config.json") -> tuple | None:
    """slm.model.rope's scaling tuple for the config's rope type (either layout), None for plain RoPE; a
    type the model cannot compute, or one missing a parameter, is refused in one line naming the key."""
    rope = rope_settings(cfg)
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default"):
        return None
    layout = "rope_parameters" if (cfg.get("rope_parameters") or {}).get("rope_type") == kind else "rope_scaling"
    keys = SCALING_KEYS.get(kind)
    if keys is None:
        raise RunError(f"{where}: rope scaling {kind!r} (in {layout}) is not supported yet; supported: "
                       f"{', '.join(SCALING_KEYS)} or none")
    missing = [k for k in keys if rope.get(k) is None]
    if missing:
        raise RunError(f"{where}: rope scaling {kind!r} (in {layout}) lacks {', '.join(missing)}")
    return (kind, *(float(rope[k]) for k in keys))


def refuse_unsupported(cfg: dict, where: str) -> None:
    """Every config key that would change the computation is honoured or refused here, in one line (rope
    scaling other than llama3/linear is rope_scaling's to refuse): partial rotary, another activation, attention
    dropout, layers that are not full attention, an MLP bias."""
    rope = rope_settings(cfg)
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise RunError(f"{where}: partial_rotary_factor is not supported (this model rotates the whole head)")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise RunError(f"{where}: hidden_act {act!r} is not supported (this model's MLP is SwiGLU: silu)")
    if cfg.get("attention_dropout"):
        raise RunError(f"{where}: attention_dropout {cfg['attention_dropout']} is not supported (this model has no "
                       f"attention dropout); set it to 0.0, and use --dropout or --lora-dropout")
    kinds = set(cfg.get("layer_types") or [])
    if kinds - {"full_attention"}:
        raise RunError(f"{where}: layer_types {sorted(kinds)} are not supported; every layer here attends over "
                       f"the whole context (full_attention)")
    if cfg.get("mlp_bias"):
        raise RunError(f"{where}: mlp_bias is not supported")


def attention_window(cfg: dict) -> int | None:
    """The sliding window a config asks for (Mistral's `sliding_window`; Qwen2/3's with `use_sliding_window`),
    or None. Full causal attention equals it while the sequence fits in the window: the trainer refuses a
    longer --seq-len rather than attend differently from the model's training."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False or "Gemma3ForCausalLM" in (cfg.get("architectures") or []):
        return None  # (Gemma 3's sliding layers are computed as such)
    return int(window)
