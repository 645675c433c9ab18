"""Load a Hugging Face LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM folder into this trainer's model.

    shape = shape_from_hf_config(json.load(open("folder/config.json")))
    params = load_hf_params("folder", shape)           # numpy float32, tensor by tensor

The inverse of slm.io.hf_export: transformers stores each Linear as (out, in), Flax as (in, out); q/k/v
are fused into one "qkv" kernel (q, then k, then v, as the model slices them) and gate/up into "gate_up".
RoPE needs no permutation: the model rotates the two halves of each head, as transformers' rotate_half.

Safe by construction: weights are read from safetensors only (a folder with only pickled `.bin` weights is
refused, naming the conversion; nothing is unpickled), one tensor at a time, and no remote code runs.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from slm.errors import RunError
from slm.memory.gpu_host import READ_CHUNK, read_buffer_bytes
from slm.model import hf_config
from slm.model.sizing import ModelShape


def shape_from_hf_config(cfg: dict, where: str = "config.json") -> ModelShape:
    """The ModelShape of a transformers config.json; one-line RunErrors for what this model cannot do."""
    return hf_config.shape_from_hf_config(cfg, where)


def weight_files(folder: str) -> list[str]:
    """The folder's safetensors files (one, or the shards of model.safetensors.index.json)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    if any(n.endswith((".bin", ".pt", ".pth")) for n in os.listdir(folder)):
        raise RunError(f"{folder}: only pickled .bin weights, which are never loaded here (unpickling runs code); "
                       f"convert them to safetensors first, e.g. with transformers: "
                       f"AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)")
    raise RunError(f"{folder}: no model.safetensors or model.safetensors.index.json")


_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def checkpoint_dtype(folder: str) -> str | None:
    """The one dtype every weight of a model folder is stored in ("bfloat16", "float16", "float32"), from the
    safetensors headers; without weights, what config.json's torch_dtype says; None where the tensors mix
    dtypes, a trainer run (its float32 checkpoints) or nothing says."""
    if os.path.isdir(os.path.join(folder, "checkpoints")):
        return "float32"
    try:
        files = weight_files(folder)
    except RunError:
        files = []
    if not files:
        return config_dtype(folder)
    stored = set()
    for path in files:
        with open(path, "rb") as f:
            stored |= {info["dtype"] for info in _header(f)[1].values()}
    return _DTYPES.get(stored.pop()) if len(stored) == 1 else None


def config_dtype(folder: str) -> str | None:
    """The dtype a model folder's config.json says its weights are stored in (torch_dtype, or dtype):
    "bfloat16", "float16" or "float32"; None where it says nothing else or cannot be read."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    said = str(cfg.get("torch_dtype") or cfg.get("dtype") or "").removeprefix("torch.")
    return said if said in ("bfloat16", "float16", "float32") else None


def _tensors(files: list[str], dtype: Any = np.float32) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 numpy array), one tensor at a time, in file order.

    Read with plain file reads rather than safetensors' memory map: a mapped file's pages count in the
    process's RSS once touched, which would add the whole file to the loading peak. The format is an
    8-byte header length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw bytes
    (https://github.com/huggingface/safetensors#format).
    """
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy (a jax dependency)

    for path in files:
        with open(path, "rb") as f:
            size, header = _header(f)
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                if info["dtype"] not in _DTYPES:
                    raise RunError(f"{path}: tensor {name} has dtype {info['dtype']}; expected floating point weights")
                start, end = info["data_offsets"]
                f.seek(8 + size + start)
                yield name, _read_tensor(f, info["shape"], np.dtype(_DTYPES[info["dtype"]]), np.dtype(dtype),
                                         end - start, f"{path}: truncated at tensor {name}; download it again")


def _header(f: Any) -> tuple[int, dict]:
    """A safetensors file's header length and its tensors' {name: {dtype, shape, data_offsets}}."""
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return size, header


def read_transient_mb(folder: str, held: np.dtype, chunk_bytes: int = READ_CHUNK) -> tuple[float, float]:
    """(what the host holds while load_hf_params reads the folder beyond what it has placed, the largest layer
    as held), MB, from the headers alone. The first is the larger of the embedding/head as held plus its read
    buffer (_read_buffer) and twice the largest layer (its tensors as read and as assembled: the bound while
    _block fuses them), plus one more layer where a layer's tensors span two files (it waits, half read, while
    the next file's other layers are read). tracemalloc's peak on this CPU (2026-11-27): Gemma-3-1B's float32
    read as bf16 640 MB (this: 640), two Mistral-7B layers as bf16 752 MB (this: 834)."""
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy

    tops, layers, files_of = [0], {}, {}
    for path in weight_files(folder):
        with open(path, "rb") as f:
            for name, info in _header(f)[1].items():
                n, stored = math.prod(info["shape"]), np.dtype(_DTYPES.get(info["dtype"], "float32"))
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    tops.append(n * held.itemsize + _read_buffer(n, stored, held, chunk_bytes))
                elif name.startswith("model.layers."):
                    i = name[len("model.layers."):].split(".", 1)[0]
                    layers[i] = layers.get(i, 0) + n * held.itemsize
                    files_of.setdefault(i, set()).add(path)
    layer = max(layers.values(), default=0)
    split = any(len(files) > 1 for files in files_of.values())
    return max(max(tops), (3 if split else 2) * layer) / 2**20, layer / 2**20


def _read_buffer(n: int, stored: np.dtype, held: np.dtype, chunk_bytes: int) -> int:
    """Bytes _read_tensor holds beside a tensor of `n` values held in `held` (slm.memory.gpu_host's rule)."""
    return read_buffer_bytes(n, stored.itemsize, held.itemsize, chunk_bytes, same=stored == held)


def _read_tensor(f: Any, shape: list, stored: np.dtype, dtype: np.dtype, nbytes: int, truncated: str,
                 chunk_bytes: int = READ_CHUNK) -> np.ndarray:
    """The `nbytes` at f's position as a `shape` array held in `dtype`; RunError(`truncated`) where the file or
    the header's size falls short. A tensor stored wider than it is held (float32 weights read as bfloat16) is
    converted 64 MB at a time into its array: Gemma-3-1B's float32 embedding (1.2 GB) is never held whole
    beside its bf16 copy."""
    if nbytes != math.prod(shape) * stored.itemsize:
        raise RunError(truncated)
    if dtype.itemsize >= stored.itemsize:  # read whole; a bf16 file held in bf16 is never widened
        x = np.empty(shape, dtype=stored)
        _read_into(f, x.reshape(-1), truncated)
        return x.astype(dtype, copy=False)
    out = np.empty(shape, dtype=dtype)
    flat, step = out.reshape(-1), max(chunk_bytes // stored.itemsize, 1)
    buf = np.empty(min(step, flat.size), dtype=stored)
    for i in range(0, flat.size, step):
        part = buf[:min(step, flat.size - i)]
        _read_into(f, part, truncated)
        flat[i:i + part.size] = part  # numpy's cast: the same rounding as astype
    return out


def _read_into(f: Any, flat: np.ndarray, truncated: str) -> None:
    """Fill a 1-D array with its size in bytes from f, or RunError(`truncated`)."""
    if f.readinto(memoryview(flat.view(np.uint8))) != flat.nbytes:
        raise RunError(truncated)


def norm_names(shape: ModelShape) -> dict[str, str]:
    """The block's norms: transformers' name -> this model's. Llama's post_attention_layernorm is the MLP's
    input norm; Gemma's normalises the attention's output, and pre_feedforward_layernorm is the MLP's."""
    if shape.sandwich_norms:
        return {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
                "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"}
    return {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}


def _layer_names(shape: ModelShape) -> set[str]:
    names = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    names |= {f"{n}.weight" for n in norm_names(shape)}
    names |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"} if shape.qk_norm else set()
    names |= {"self_attn.o_proj.bias"} if shape.o_bias else set()
    return names | ({f"self_attn.{p}_proj.bias" for p in "qkv"} if shape.qkv_bias else set())


def load_hf_params(folder: str, shape: ModelShape, place: Callable[[np.ndarray], Any] = np.asarray,
                   dtype: Any = np.float32, block_transform: Callable[[dict], dict] | None = None) -> dict:
    """The model's params from the folder's safetensors, tensor by tensor: each layer is assembled (q/k/v and
    gate/up fused, kernels transposed) as soon as its tensors have been read, then (after `block_transform`,
    e.g. NF4 quantisation) handed to `place` (e.g. jax.device_put) and its pieces dropped, so the host holds
    the placed params plus about two layers (read_transient_mb)."""
    wanted = _layer_names(shape)
    V, D = shape.vocab_size, shape.d_model
    top = {"model.embed_tokens.weight": ("embed", (V, D)), "model.norm.weight": ("final_norm", (D,))}
    if not shape.tie_embeddings:
        top["lm_head.weight"] = ("unembed", (V, D))
    pending: dict[int, dict[str, np.ndarray]] = {}
    params: dict[str, Any] = {}
    for name, x in _tensors(weight_files(folder), dtype):
        if name in top:  # placed at once: the embedding and head are the largest tensors
            key, want = top[name]
            x = place(_need({name: x}, name, want, folder))
            params[key] = {"scale": x} if key == "final_norm" else x
            continue
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and shape.tie_embeddings):
            continue  # rotary buffers some older exports carry; a tied head's copy of the embedding
        if not name.startswith("model.layers."):
            raise unused(folder, [name])
        i, rest = name[len("model.layers."):].split(".", 1)
        if f"block_{i}" in params:  # a tensor of a layer already complete: _block would never see it
            raise unused(folder, [name])
        layer = pending.setdefault(int(i), {})
        layer[rest] = x
        del x  # the layer alone holds its tensors, so _block frees each one it has consumed
        if wanted <= layer.keys():
            del layer
            params[f"block_{i}"] = _placed_block(pending.pop(int(i)), shape, folder, place, block_transform)
    for i in range(shape.n_layers):
        if f"block_{i}" not in params:
            missing = min(wanted - pending.get(i, {}).keys())
            raise RunError(f"{folder}: the weights have no tensor model.layers.{i}.{missing}; is it a "
                           f"Llama/Mistral/Qwen2/Qwen3/Gemma3 checkpoint?")
    for name, (key, _) in top.items():
        if key not in params:
            raise RunError(f"{folder}: the weights have no tensor {name}; is it a Llama/Mistral/Qwen2/Qwen3/Gemma3 checkpoint?")
    return params


def _placed_block(tensors: dict, shape: ModelShape, folder: str, place: Callable[[np.ndarray], Any],
                  block_transform: Callable[[dict], dict] | None) -> dict:
    """One layer assembled, transformed and placed; no name outlives the call, so neither the layer as read
    nor as assembled stays on the host beside the next one (it did: Mistral's 436 MB bf16 layer, read twice
    over, 2026-11-27)."""
    block = _block(tensors, shape, folder)
    if block_transform is not None:
        block = block_transform(block)
    return map_leaves(place, block)


def map_leaves(fn: Callable, tree: dict) -> dict:
    """`fn` on every leaf of a nested dict (no jax import needed here)."""
    return {k: map_leaves(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def _block(t: dict, shape: ModelShape, folder: str) -> dict:
    """One layer's tensors (transformers' names and (out, in) layouts) -> the model's block params."""
    H, G, K, D, F = shape.n_heads, shape.kv_heads, shape.head_dim, shape.d_model, shape.d_ff
    heads = (("q", H), ("k", G), ("v", G))
    qkv = {"kernel": np.concatenate([_need(t, f"self_attn.{p}_proj.weight", (n * K, D), folder).T
                                     for p, n in heads], axis=1)}
    if shape.qkv_bias:
        qkv["bias"] = np.concatenate([_need(t, f"self_attn.{p}_proj.bias", (n * K,), folder) for p, n in heads])
    gate_up = [_need(t, f"mlp.{p}_proj.weight", (F, D), folder).T for p in ("gate", "up")]
    attn = {"qkv": qkv, "o": {"kernel": np.ascontiguousarray(_need(t, "self_attn.o_proj.weight", (D, H * K), folder).T)}}
    if shape.o_bias:
        attn["o"]["bias"] = _need(t, "self_attn.o_proj.bias", (D,), folder)
    if shape.qk_norm:
        attn |= {f"{p}_norm": {"scale": _need(t, f"self_attn.{p}_norm.weight", (K,), folder)} for p in "qk"}
    block = {
        **{ours: {"scale": _need(t, f"{theirs}.weight", (D,), folder)} for theirs, ours in norm_names(shape).items()},
        "attn": attn,
        "mlp": {"gate_up": {"kernel": np.concatenate(gate_up, axis=1)},
                "down": {"kernel": np.ascontiguousarray(_need(t, "mlp.down_proj.weight", (D, F), folder).T)}},
    }
    if t:  # a tensor this model has no place for would be dropped: the load is whole or refused
        raise unused(folder, sorted(t))
    return block


def unused(folder: str, names: list[str]) -> RunError:
    """The refusal of a checkpoint holding tensors this model has no place for (its config.json does not
    describe them): a load is whole or refused."""
    return RunError(f"{folder}: the weights have tensor(s) this model does not use: {', '.join(names)[:200]}; its "
                    f"config.json does not describe them")


def _need(tensors: dict, name: str, shape: tuple, folder: str) -> np.ndarray:
    x = tensors.pop(name, None)
    if x is None:
        raise RunError(f"{folder}: the weights have no tensor {name}; is it a Llama/Mistral/Qwen2/Qwen3/Gemma3 checkpoint?")
    if tuple(x.shape) != shape:
        raise RunError(f"{folder}: {name} is {tuple(x.shape)}, config.json implies {shape}")
    return x


def load_hf_folder(folder: str, weights: bool = True, place: Callable[[np.ndarray], Any] = np.asarray,
                   dtype: Any = np.float32,
                   block_transform: Callable[[dict], dict] | None = None) -> tuple[ModelShape, dict | None, dict]:
    """(shape, params in `dtype` or None without `weights`, config.json) of a local Hugging Face model folder;
    each array goes through `place` as soon as it is assembled (see load_hf_params)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise RunError(f"{folder}: no config.json; pass a Hugging Face model folder")
    with open(path) as f:
        cfg = json.load(f)
    shape = shape_from_hf_config(cfg, path)
    return shape, load_hf_params(folder, shape, place, dtype, block_transform) if weights else None, cfg


def resolve_pretrained(spec: str, revision: str | None, log) -> tuple[str, str | None]:
    """(local folder, pinned revision) for --init-from: a folder as is; a hub id downloaded with
    huggingface_hub (config, tokenizer and safetensors only: never pickles or code) at `revision`,
    which is returned resolved to its commit so the run's config.json pins it."""
    if os.path.isdir(spec):
        return spec, revision
    if os.path.exists(spec) or spec.startswith((".", "/", "~")):
        raise RunError(f"--init-from {spec}: not a folder; pass a Hugging Face model folder or a hub id")
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(spec, revision=revision, allow_patterns=["*.json", "*.safetensors", "tokenizer*"])
    except Exception as e:  # noqa: BLE001 - offline, unknown id, no access: one line
        raise RunError(f"--init-from {spec}: could not download it from the hub ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:160] if str(e) else ''}); pass a local folder") from None
    commit = os.path.basename(os.path.normpath(folder))  # .../snapshots/<commit>
    log(f"[init] {spec}: downloaded revision {commit}")
    return folder, commit
