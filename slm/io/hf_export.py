"""Write a model as a Hugging Face LlamaForCausalLM folder (`python export_hf.py --run RUN_DIR --out OUT_DIR`).

The folder loads offline with `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` and
`AutoTokenizer.from_pretrained(OUT_DIR)` and gives this model's float32 logits (to float rounding) and
this run's token ids. It holds config.json, model.safetensors, generation_config.json, tokenizer.json
(the run's, copied) and tokenizer_config.json. Pure numpy: no torch or transformers import here.

Why Llama. slm.model.transformer.Transformer is exactly a Llama block stack with one key/value head per query head:
pre-norm RMSNorm (eps 1e-6, computed in float32), rotary positions with base 10000 on (first half,
second half) pairs, attention scaled by 1/sqrt(head_dim), a SwiGLU MLP (silu(gate) * up), no biases,
a final RMSNorm and the embedding reused as the output head. The checks behind "exactly"
(transformers 5.x, models/llama/modeling_llama.py):
  * RoPE: HF's `rotate_half(x) = [-x2, x1]` over the two halves of each head and
    `x*cos + rotate_half(x)*sin` with cos = [cos, cos], sin = [sin, sin] give
    [x1 cos - x2 sin, x2 cos + x1 sin], which is `rotary` (x*[cos, cos] + [x2, x1]*[-sin, sin]);
    both take inv_freq = 1 / base^(arange(0, K, 2)/K) and angle = position * inv_freq in float32.
    HF views q_proj's output as (heads, head_dim) in head-major order, as our reshape to (3H, K) does,
    so no permutation of rows is needed (unlike Meta's interleaved-pair checkpoints).
  * Attention: scaling = head_dim**-0.5, causal mask, float32 softmax; num_key_value_heads = heads.
  * RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)) in float32, as ours (ours multiplies the scale
    before casting back to the compute dtype; in float32 that is the same arithmetic).

Name and layout mapping (ours -> HF). A Flax Dense kernel is (in, out) and is applied as x @ kernel; a
torch nn.Linear weight is (out, in) and is applied as x @ weight.T, so every kernel is transposed.
The fused kernels are split along their output axis, in the order the model splits its activations:
    embed (V, D)                        -> model.embed_tokens.weight (V, D)    (no transpose: a table)
    block_i/attn_norm/scale (D,)        -> model.layers.i.input_layernorm.weight
    block_i/attn/qkv/kernel (D, 3D)     -> [:, 0:D].T   model.layers.i.self_attn.q_proj.weight (D, D)
                                           [:, D:2D].T  model.layers.i.self_attn.k_proj.weight
                                           [:, 2D:3D].T model.layers.i.self_attn.v_proj.weight
       (the (B, L, 3D) activation is reshaped to (B, L, 3H, K) and split in three on the head axis, so
        columns 0:D are the H query heads, D:2D the keys, 2D:3D the values, each head's K columns
        contiguous: the same head-major layout HF's view(..., H, K) expects)
    block_i/attn/o/kernel (D, D)        -> .T  model.layers.i.self_attn.o_proj.weight
    block_i/mlp_norm/scale (D,)         -> model.layers.i.post_attention_layernorm.weight
    block_i/mlp/gate_up/kernel (D, 2F)  -> [:, :F].T  model.layers.i.mlp.gate_proj.weight (F, D)
                                           [:, F:].T  model.layers.i.mlp.up_proj.weight
    block_i/mlp/down/kernel (F, D)      -> .T  model.layers.i.mlp.down_proj.weight (D, F)
    final_norm/scale (D,)               -> model.norm.weight
The output head is tied: config.json says tie_word_embeddings true and model.safetensors has no
lm_head.weight. LlamaForCausalLM declares `_tied_weights_keys = {"lm_head.weight":
"model.embed_tokens.weight"}`, so transformers ties it on load without a missing-key report, and
`save_pretrained` itself writes tied checkpoints this way.

Tokens. The tokenizer is the run's tokenizer.json unchanged, loaded through PreTrainedTokenizerFast
(TokenizersBackend in transformers 5), so `AutoTokenizer(text)` gives the ids training got from
`tokenizer.encode(text, add_special_tokens=False)`: no add_bos_token is set and the tokenizer's own
post-processor is kept (a run's trained BPE has none, so nothing is prepended; a --tokenizer with a
BOS template would add it on the HF side only). The class is named so AutoTokenizer does not choose one
by model_type: for llama that is LlamaTokenizer, which prepends a BOS by default in transformers 4.x and
hard-codes a Metaspace pre-tokenizer in 5.x (5.23 notices a ByteLevel tokenizer.json and falls back to
TokenizersBackend, but that is a heuristic). bos and eos are both the end-of-text token: training puts
it between documents, so a document starts after it (generate.py prepends it to every prompt; do the
same with the exported model to show it a prompt as training did).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from slm.data.instruction import optional_chat_template
from slm.data.tokenizer import SpecialIds, special_ids
from slm.errors import ExportError
from slm.io.atomic import write_json
from slm.io.hf_import import norm_names
from slm.model.hf_config import SCALING_KEYS
from slm.model.sizing import ModelShape

WEIGHTS = "model.safetensors"


# --- weights and config (pure numpy / dicts) ---------------------------------------------------------


def _f32(x: Any) -> np.ndarray:
    """A C-contiguous float32 copy (safetensors writes raw bytes, so a transposed view must be copied)."""
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


def hf_state_dict(params: Mapping[str, Any], shape: ModelShape) -> dict[str, np.ndarray]:
    """model.Transformer params -> LlamaForCausalLM (Qwen2ForCausalLM with q/k/v biases) tensor names and
    (out, in) layouts (module docstring); with G key/value heads the fused kernel is (D, (H + 2G) * K)."""
    D, F, K = shape.d_model, shape.d_ff, shape.head_dim
    q_w, kv_w = shape.n_heads * K, shape.kv_heads * K
    embed = _f32(params["embed"])
    if embed.shape != (shape.vocab_size, D):
        raise ExportError(f"embed is {embed.shape}, the run's shape says ({shape.vocab_size}, {D})")
    out = {"model.embed_tokens.weight": embed, "model.norm.weight": _f32(params["final_norm"]["scale"])}
    if not shape.tie_embeddings:
        out["lm_head.weight"] = _f32(params["unembed"])
    cuts = {"q": (0, q_w), "k": (q_w, q_w + kv_w), "v": (q_w + kv_w, q_w + 2 * kv_w)}
    for i in range(shape.n_layers):
        block, pre = params[f"block_{i}"], f"model.layers.{i}"
        qkv = block["attn"]["qkv"]
        qkv_kernel = np.asarray(qkv["kernel"], dtype=np.float32)
        gate_up_Dx2F = np.asarray(block["mlp"]["gate_up"]["kernel"], dtype=np.float32)
        if qkv_kernel.shape != (D, q_w + 2 * kv_w) or gate_up_Dx2F.shape != (D, 2 * F):
            raise ExportError(f"block_{i}: qkv {qkv_kernel.shape} / gate_up {gate_up_Dx2F.shape} do not match "
                              f"d_model {D}, d_ff {F}")
        for theirs, ours in norm_names(shape).items():
            out[f"{pre}.{theirs}.weight"] = _f32(block[ours]["scale"])
        for name, (a, b) in cuts.items():
            out[f"{pre}.self_attn.{name}_proj.weight"] = _f32(qkv_kernel[:, a:b].T)
            if shape.qkv_bias:
                out[f"{pre}.self_attn.{name}_proj.bias"] = _f32(np.asarray(qkv["bias"])[a:b])
        out[f"{pre}.self_attn.o_proj.weight"] = _f32(np.asarray(block["attn"]["o"]["kernel"]).T)
        if shape.o_bias:
            out[f"{pre}.self_attn.o_proj.bias"] = _f32(np.asarray(block["attn"]["o"]["bias"]))
        if shape.qk_norm:
            for p in "qk":
                out[f"{pre}.self_attn.{p}_norm.weight"] = _f32(block["attn"][f"{p}_norm"]["scale"])
        out[f"{pre}.mlp.gate_proj.weight"] = _f32(gate_up_Dx2F[:, :F].T)
        out[f"{pre}.mlp.up_proj.weight"] = _f32(gate_up_Dx2F[:, F:].T)
        out[f"{pre}.mlp.down_proj.weight"] = _f32(np.asarray(block["mlp"]["down"]["kernel"]).T)
    return out


def hf_config(shape: ModelShape, max_positions: int, special: SpecialIds) -> dict:
    """config.json for the model's transformers family (Llama, Qwen2, Qwen3 or Gemma 3).

    transformers 5.x spells RoPE as `rope_parameters: {rope_type, rope_theta}` and the dtype as `dtype`;
    4.x reads top-level `rope_theta` and `torch_dtype`. Both spellings are written: 5.x folds a top-level
    rope_theta into rope_parameters (keeping rope_parameters' own value) and takes torch_dtype silently
    when dtype is set, and 4.x ignores the keys it does not know.
    """
    family = export_family(shape)
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM"}[family]],
        "model_type": "gemma3_text" if family == "gemma3" else family,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.d_model,
        "intermediate_size": shape.d_ff,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(max_positions),
        "rms_norm_eps": shape.norm_eps,
        "rope_parameters": {"rope_theta": shape.rope_theta, **rope_scaling_config(shape)},
        "rope_scaling": rope_scaling_config(shape) if shape.rope_scaling else None,
        "rope_theta": shape.rope_theta,
        "attention_bias": shape.o_bias,  # q, k, v and o_proj biases (Qwen2's q/k/v-only ones need none)
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": shape.tie_embeddings,
        "bos_token_id": special.start[0] if special.start else None,
        "eos_token_id": special.eos,
        "pad_token_id": None,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "dtype": "float32",
        "torch_dtype": "float32",
    }
    return gemma3_config(shape, config) if family == "gemma3" else config


def export_family(shape: ModelShape) -> str:
    """The transformers family that computes what this shape computes."""
    if shape.sandwich_norms:
        return "gemma3"
    if shape.o_bias and not shape.qkv_bias:
        raise ExportError("a bias on o_proj without q/k/v biases has no transformers family to export to")
    if shape.qkv_bias and not shape.o_bias and shape.qk_norm:  # attention_bias would put a bias on o_proj too
        raise ExportError("a model with both q/k/v biases and q/k norms has no transformers family to export to")
    if shape.o_bias:  # attention_bias: true (q, k, v and o biases)
        return "qwen3" if shape.qk_norm else "llama"
    return "qwen3" if shape.qk_norm else "qwen2" if shape.qkv_bias else "llama"


def gemma3_config(shape: ModelShape, config: dict) -> dict:
    """Gemma 3's keys in both layouts: the hub's (sliding_window_pattern, rope_local_base_freq, rope_scaling)
    and transformers 5's (layer_types, per-type rope_parameters)."""
    windows = {w for w in shape.layer_windows or () if w}
    if len(windows) > 1 or shape.query_scale is None:
        raise ExportError("a Gemma 3 model needs one sliding window and a query scale")
    del config["hidden_act"], config["pretraining_tp"]
    full = {"rope_theta": shape.rope_theta, **rope_scaling_config(shape)}
    local = {"rope_type": "default", "rope_theta": shape.rope_local_theta or shape.rope_theta}
    return {**config, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": round(shape.query_scale ** -2),
            "sliding_window": windows.pop() if windows else None, "rope_local_base_freq": local["rope_theta"],
            "layer_types": ["sliding_attention" if shape.window(i) else "full_attention" for i in range(shape.n_layers)],
            "rope_parameters": {"full_attention": full, "sliding_attention": local},
            "attn_logit_softcapping": None, "final_logit_softcapping": None, "use_bidirectional_attention": False}


def rope_scaling_config(shape: ModelShape) -> dict:
    """The rope type and its parameters as config.json spells them (slm.model.hf_config reads them back)."""
    if not shape.rope_scaling:
        return {"rope_type": "default"}
    kind, *values = shape.rope_scaling
    out = {"rope_type": kind, **dict(zip(SCALING_KEYS[kind], values))}
    if "original_max_position_embeddings" in out:
        out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    return out


def generation_config(special: SpecialIds) -> dict:
    """Stop at end-of-text; pad with it too (no separate pad token), so generate() does not warn."""
    bos = special.start[0] if special.start else None
    return {"_from_model_config": False, "bos_token_id": bos, "eos_token_id": special.eos,
            "pad_token_id": special.eos if special.eos is not None else bos}


def tokenizer_config(tokenizer: Any, special: SpecialIds, max_positions: int, chat_template: str | None = None) -> dict:
    name = lambda i: None if i is None else tokenizer.id_to_token(i)
    return {**({"chat_template": chat_template} if chat_template else {}),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(special.start[0] if special.start else None),
        "eos_token": name(special.eos),
        "model_max_length": int(max_positions),
        "clean_up_tokenization_spaces": False,
    }


def save_tensors(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
    """safetensors as torch writes it ({"format": "pt"} in the header), with the umask's usual permissions."""
    from safetensors.numpy import save_file

    save_file(dict(tensors), path, metadata={"format": "pt", **(metadata or {})})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # save_file creates it 0600 (a temp file); make it like the others


def write_export(out_dir: str, params: Mapping[str, Any], shape: ModelShape, max_positions: int,
                 tokenizer: Any | None = None, special: SpecialIds | None = None, tokenizer_file: str | None = None,
                 metadata: Mapping[str, str] | None = None) -> list[str]:
    """Write the HF folder; returns the file names written.

    `tokenizer` (a tokenizers.Tokenizer) is optional so a bare model can be exported in tests; without
    it no tokenizer files are written. `special` (default: found in the tokenizer) names bos and eos. `tokenizer_file`, the tokenizer.json it
    was loaded from, is copied byte for byte when given (else the tokenizer is serialized), and the chat template
    of the tokenizer_config.json beside it goes into the export's.
    """
    if tokenizer is not None:
        special = special or special_ids(tokenizer)
        if tokenizer.get_vocab_size() > shape.vocab_size:
            raise ExportError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, more than the model's "
                              f"vocab_size {shape.vocab_size}")
    special = special or SpecialIds(None, None, "none")
    tensors = hf_state_dict(params, shape)
    os.makedirs(out_dir, exist_ok=True)
    save_tensors(os.path.join(out_dir, WEIGHTS), tensors, metadata)
    write_json(os.path.join(out_dir, "config.json"), hf_config(shape, max_positions, special))
    write_json(os.path.join(out_dir, "generation_config.json"), generation_config(special))
    written = ["config.json", WEIGHTS, "generation_config.json"]
    if tokenizer is not None:
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, os.path.join(out_dir, "tokenizer.json"))
        else:
            tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
        template = optional_chat_template(tokenizer_file) if tokenizer_file else None  # the run's, if it has one
        write_json(os.path.join(out_dir, "tokenizer_config.json"),
                   tokenizer_config(tokenizer, special, max_positions, template))
        written += ["tokenizer.json", "tokenizer_config.json"]
    return written
