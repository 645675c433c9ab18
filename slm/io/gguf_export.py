"""Write a model as one GGUF file for llama.cpp, ollama and LM Studio (`export_hf.py --format gguf`).

The file is written with the `gguf` package (llama.cpp's own gguf-py) and holds everything llama.cpp needs:
the architecture's metadata, the weights (f32, f16 or q8_0) and the tokenizer. transformers reads it too
(`AutoModelForCausalLM.from_pretrained(DIR, gguf_file=NAME)`, which dequantizes it to torch).

Architecture. The model is a Llama block stack (slm.io.hf_export), so the file says `llama`; a model with
q/k/v biases (Qwen2) says `qwen2`, whose llama.cpp graph adds them. Tensors are the Hugging Face export's
(hf_state_dict: torch (out, in) layouts) under GGUF's names (gguf.get_tensor_name_map: token_embd,
blk.N.attn_q, ..., output_norm; no output.weight when the head is tied, and llama.cpp then reuses
token_embd). A (out, in) array is written as is: GGUF lists dimensions innermost first, so ggml sees
ne = (in, out), as llama.cpp's converter writes them.

RoPE. Our model (and transformers) rotate the pairs (j, j + K/2) of each head: the "NeoX" layout, which is what
llama.cpp's qwen2 graph applies. Its llama graph rotates adjacent pairs (2j, 2j + 1) instead (Meta's original
layout), so for `llama` the rows of each q and k head are reordered so that row 2j holds our row j and row
2j + 1 our row j + K/2: the same attention scores, in llama.cpp's order (llama.cpp's convert_hf_to_gguf.py
does this to every HF Llama checkpoint, and transformers' GGUF reader undoes it).

Types. 1-D tensors (norms, biases) stay float32, as llama.cpp keeps them. `q8_0` stores each block of 32
weights of a row as int8 with one float16 scale; a matrix whose rows are not a multiple of 32 long is written
f16 instead (the converter's fallback).

Tokenizer. A byte-level BPE (the trainer's own, GPT-2's, Qwen2's, Llama 3's) is written as llama.cpp's
"gpt2" tokenizer model: tokens in id order (ids the tokenizer lacks up to the model's vocab_size are
"[PAD<id>]", type UNUSED), token types (added special tokens CONTROL, other added ones USER_DEFINED), the
merges, and `tokenizer.ggml.pre`, the name of the pre-tokenizer's split regex in llama.cpp. bos is the token a
sample starts from (slm.data.tokenizer.SpecialIds.start: the end-of-text token for a GPT-2-style vocabulary),
eos the document separator, and add_bos_token is set so that llama.cpp starts every prompt the way training
started every document. Other tokenizers (SentencePiece-style, WordLevel) are refused in one line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from slm.data.tokenizer import SpecialIds
from slm.errors import ExportError
from slm.io.atomic import write_atomically
from slm.io.hf_export import export_family, hf_state_dict
from slm.model.sizing import ModelShape

GGUF_TYPES = ("f32", "f16", "q8_0")

# The split regexes of byte-level BPE tokenizers, as their tokenizer.json spells them, by llama.cpp's name.
_SPLIT_NAMES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
}


def pre_tokenizer_name(spec: Mapping[str, Any]) -> str | None:
    """llama.cpp's name for a tokenizer.json's byte-level pre-tokenizer, or None when it has none for it."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False):
        return "gpt-2"  # ByteLevel's own regex is GPT-2's
    steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else []
    if (len(steps) == 2 and steps[0].get("type") == "Split" and steps[0].get("behavior") == "Isolated"
            and not steps[0].get("invert") and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex", True) and not steps[1].get("add_prefix_space", False)):
        return _SPLIT_NAMES.get((steps[0].get("pattern") or {}).get("Regex"))
    return None


def gguf_vocab(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int], list[str], str]:
    """(tokens, token types, merges, pre-tokenizer name) of a byte-level BPE `tokenizers.Tokenizer`, padded to
    the model's vocab_size; an ExportError naming what the tokenizer is when it is not one."""
    from gguf import TokenType

    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    pre = pre_tokenizer_name(spec)
    if model.get("type") != "BPE" or pre is None:
        what = f"{model.get('type')} with pre-tokenizer {(spec.get('pre_tokenizer') or {}).get('type')}"
        raise ExportError(f"--format gguf: the run's tokenizer ({what}) is not a byte-level BPE with a GPT-2, Qwen2 "
                          f"or Llama 3 split, the ones written here; export --format hf and convert that folder "
                          f"with llama.cpp's convert_hf_to_gguf.py")
    if tokenizer.get_vocab_size() > vocab_size:
        raise ExportError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, more than the model's "
                          f"vocab_size {vocab_size}")
    added = {t["id"]: t for t in spec.get("added_tokens") or []}
    tokens, types = [], []
    for i in range(vocab_size):
        token = tokenizer.id_to_token(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        tokens.append(token)
        types.append(TokenType.NORMAL if i not in added else
                     TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return tokens, [int(t) for t in types], merges, pre


def permute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """q or k (heads * K, ...) with each head's rows in the halves order (j, j + K/2) -> llama.cpp's llama order
    (row 2j = row j, row 2j + 1 = row j + K/2)."""
    K = w.shape[0] // heads
    return np.ascontiguousarray(w.reshape(heads, 2, K // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def gguf_arch(shape: ModelShape) -> str:
    """llama.cpp's architecture for the shape (qwen3: q/k norms, neox rope; gemma3: its block), or an ExportError
    for a Gemma 3 llama.cpp would compute differently: its gemma3 graph fixes the sliding pattern (5 local
    layers, then a global one), the local rope theta (10,000) and the query scale (1/sqrt(head_dim))."""
    family = export_family(shape)
    if family != "gemma3":
        return family
    pattern = tuple(0 if (i + 1) % 6 == 0 else 1 for i in range(shape.n_layers))
    if (tuple(bool(shape.window(i)) for i in range(shape.n_layers)) != tuple(map(bool, pattern))
            or shape.rope_local_theta != 10000.0 or abs(shape.query_scale * shape.head_dim ** 0.5 - 1) > 1e-6):
        raise ExportError("this Gemma 3 differs from llama.cpp's gemma3 (5 sliding layers then a global one, local "
                          "rope theta 10000, query_pre_attn_scalar = head_dim); export it with --format hf")
    return "gemma3"


def gguf_tensors(params: Mapping[str, Any], shape: ModelShape, arch: str) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array (torch (out, in) layout; q/k rows reordered for `llama`)."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, shape.n_layers)
    out = {}
    for hf_name, x in hf_state_dict(params, shape).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ExportError(f"no GGUF name for {hf_name} in architecture {arch}")
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            x = permute_rope_rows(x, shape.n_heads if "q_proj" in hf_name else shape.kv_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            x = x + 1.0  # llama.cpp scales by w where Gemma scales by (1 + w), as its converter shifts them
        out[name] = x
    if shape.rope_scaling and shape.rope_scaling[0] == "llama3":
        if arch != "llama":
            raise ExportError(f"llama3 rope scaling has no GGUF form in architecture {arch}")
        out["rope_freqs.weight"] = llama3_freq_factors(shape.head_dim, shape.rope_theta, shape.rope_scaling)
    return out


def llama3_freq_factors(head_dim: int, theta: float, scaling: tuple) -> np.ndarray:
    """llama.cpp's `rope_freqs` tensor for llama3 rope scaling: the divisor of each pair's frequency (1 for
    short wavelengths, `factor` for long ones, blended between), as its converter computes it."""
    _, factor, low, high, original = scaling
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended)).astype(np.float32)


def _encode(x: np.ndarray, gguf_type: str) -> tuple[np.ndarray, Any]:
    """(data, GGML type) for one tensor: float32 for 1-D ones, else `gguf_type` (q8_0 falls back to f16 for
    rows that are not whole blocks of 32)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if x.ndim <= 1 or gguf_type == "f32":
        return x.astype(np.float32), Q.F32
    if gguf_type == "q8_0" and x.shape[-1] % 32 == 0:
        return quants.quantize(x, Q.Q8_0), Q.Q8_0
    return x.astype(np.float16), Q.F16


def _write_metadata(w: Any, shape: ModelShape, arch: str, max_positions: int, gguf_type: str, name: str) -> None:
    from gguf import GGML_QUANT_VERSION, GGUFType, LlamaFileType

    w.add_type(GGUFType.MODEL)
    w.add_name(name)
    w.add_file_type({"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
                     "q8_0": LlamaFileType.MOSTLY_Q8_0}[gguf_type])
    w.add_quantization_version(GGML_QUANT_VERSION)
    w.add_vocab_size(shape.vocab_size)
    w.add_context_length(int(max_positions))
    w.add_embedding_length(shape.d_model)
    w.add_block_count(shape.n_layers)
    w.add_feed_forward_length(shape.d_ff)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(float(shape.rope_theta))
    w.add_layer_norm_rms_eps(float(shape.norm_eps))
    w.add_rope_dimension_count(shape.head_dim)
    if shape.rope_scaling and shape.rope_scaling[0] == "linear":
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(shape.rope_scaling[1]))
    if shape.sandwich_norms:
        w.add_sliding_window(max(shape.layer_windows or (0,)))
    if shape.head_dim * shape.n_heads != shape.d_model:  # llama.cpp's default is d_model / heads
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)


def _write_tokenizer(w: Any, tokenizer: Any, special: SpecialIds, vocab_size: int, chat_template: str | None) -> None:
    tokens, types, merges, pre = gguf_vocab(tokenizer, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if special.start:
        w.add_bos_token_id(special.start[0])
    if special.eos is not None:
        w.add_eos_token_id(special.eos)
    w.add_add_bos_token(bool(special.start))
    w.add_add_eos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)


def write_gguf(path: str, params: Mapping[str, Any], shape: ModelShape, max_positions: int, tokenizer: Any,
               special: SpecialIds, gguf_type: str = "f16", name: str = "slm", chat_template: str | None = None) -> str:
    """Write the model and its tokenizer to `path` (through a temporary file beside it, renamed at the end);
    returns the architecture written."""
    import gguf

    if gguf_type not in GGUF_TYPES:
        raise ExportError(f"--gguf-type {gguf_type}: choose one of {', '.join(GGUF_TYPES)}")
    arch = gguf_arch(shape)
    tensors = gguf_tensors(params, shape, arch)  # before the file: a mapping error leaves nothing behind

    def write(tmp: str) -> None:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            _write_metadata(writer, shape, arch, max_positions, gguf_type, name)
            _write_tokenizer(writer, tokenizer, special, shape.vocab_size, chat_template)
            for key in list(tensors):
                data, qtype = _encode(tensors.pop(key), gguf_type)
                writer.add_tensor(key, data, raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()

    write_atomically(path, write)  # a failure leaves no partial file behind
    return arch
