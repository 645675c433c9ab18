"""A Hugging Face config.json (as a dict) -> ModelShape. Pure Python: no jax, no files, no weights.

The model layer's one place that knows transformers' config keys, so the memory arithmetic can plan a
pretrained model from its config alone (slm.memory.finetune) and the loader (slm.io.hf_import) builds the
same shape. Raises a one-line RunError for what this trainer's model cannot express.
"""

from __future__ import annotations

from slm.errors import RunError
from slm.model.sizing import ModelShape

FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def shape_from_hf_config(cfg: dict, where: str = "config.json") -> ModelShape:
    """The ModelShape of a transformers config.json; one-line RunErrors for what this model cannot do."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in FAMILIES:
        raise RunError(f"{where}: architecture {arch!r} is not supported; use one of {', '.join(FAMILIES)}")
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type") if isinstance(scaling, dict) else None
    if kind not in (None, "default"):
        raise RunError(f"{where}: rope scaling {kind!r} is not supported yet; use a checkpoint without rope_scaling")
    if cfg.get("mlp_bias"):
        raise RunError(f"{where}: mlp_bias is not supported")
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    head = cfg.get("head_dim") or D // H
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return ModelShape(
        vocab_size=cfg["vocab_size"], n_layers=cfg["num_hidden_layers"], d_model=D, n_heads=H,
        d_ff=cfg["intermediate_size"], n_kv_heads=cfg.get("num_key_value_heads") or H,
        head_size=None if head * H == D else head,
        qkv_bias=FAMILIES[arch] == "qwen2" or bool(cfg.get("attention_bias")),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), rope_theta=float(theta),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    )
