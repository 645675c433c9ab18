"""Tiny random Llama (2 and 3.x), Mistral, Qwen2 and Qwen3 models saved by transformers (grouped-query attention,
each family's rope theta, rope scaling and RMSNorm eps, Qwen2's q/k/v biases, Qwen3's q/k norms, tied and untied
heads; norms and biases randomised so a mix-up shows), for the loading and fine-tuning tests."""

from __future__ import annotations

import torch

FAMILIES = {
    "llama": dict(rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "mistral": dict(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # Qwen3: per-head q/k RMSNorms, and a head_dim (32) that is not hidden / heads (16)
    "qwen3": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, head_dim=32),
    # Llama 3.x: llama3 rope scaling, with an original context short enough (32) that pairs of the tiny
    # head (16) fall in all three bands: unchanged, blended and divided by the factor
    "llama3": dict(rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)),
    # Gemma 3: (1 + w) and sandwich norms, scaled embeddings, GeGLU, q/k norms, a query scale that is not
    # head_dim's, and sliding-window layers (window 8, shorter than the tests' sequences) with their own rope
    # theta around a global one (every 3rd layer here)
    "gemma3": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, head_dim=32,
                   query_pre_attn_scalar=24, sliding_window=8, num_hidden_layers=3,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    # attention_bias: true puts biases on q, k, v and o_proj (issue 41: o_proj's was dropped, logits off by 0.85)
    "llama_bias": dict(rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True),
    "qwen3_bias": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, head_dim=32,
                       attention_bias=True),
}
CLASSES = {"llama": "Llama", "llama3": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
           "gemma3": "Gemma3", "llama_bias": "Llama", "qwen3_bias": "Qwen3"}


def save_tiny(family: str, out, seed: int = 0, vocab_size: int = 128, tokenizer=None, dtype=None):
    """Save a tiny random model of `family` to `out` (with `tokenizer` as its tokenizer.json when given), its
    weights stored in `dtype` (a torch dtype; default float32)."""
    import transformers

    cls = CLASSES[family]
    config_cls = getattr(transformers, "Gemma3TextConfig" if family == "gemma3" else f"{cls}Config")
    config = config_cls(**{**dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
                           **FAMILIES[family]})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms and biases off their init, so a mix-up shows
            if "norm" in name:  # Gemma's norms scale by (1 + w): its w around 0
                p.copy_((0.0 if family == "gemma3" else 1.0) + 0.5 * (torch.rand(p.shape, generator=gen) * 2 - 1))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    (model if dtype is None else model.to(dtype)).save_pretrained(str(out), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save(str(out / "tokenizer.json"))
    return model
