"""LoRA: low-rank adapters on a frozen base (Hu et al. 2021; the layout Hugging Face PEFT uses).

A targeted projection y = x W becomes y = x W + (alpha / r) * dropout(x) A B, with A (in, r) initialised
like PEFT (uniform +-1/sqrt(in)) and B (r, out) zero, so step 0 computes exactly the base model. The model
fuses q/k/v into one "qkv" kernel and gate/up into "gate_up"; each Hugging Face target maps to a column
range of one of those (`target_columns`), so an adapter on q_proj alone adds only to q's columns.

Adapters live in the same parameter tree as the base, named `<target>_lora_a` / `<target>_lora_b` inside the
module whose kernel they adapt (block_i/attn/q_proj_lora_a ...). `split` and `merge` move between the one
tree and (base, adapters), which is how the train step differentiates the adapters only; `fold` adds each
adapter into its kernel, for export and fast sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from slm.model.matmul import linear
from slm.model.sizing import ModelShape

TARGET_MODULE = {"q_proj": ("attn", "qkv"), "k_proj": ("attn", "qkv"), "v_proj": ("attn", "qkv"),
                 "o_proj": ("attn", "o"), "gate_proj": ("mlp", "gate_up"), "up_proj": ("mlp", "gate_up"),
                 "down_proj": ("mlp", "down")}
MARK = "_lora_"


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def target_columns(shape: ModelShape, target: str) -> tuple[int, int]:
    """The column range [a, b) of the fused kernel that Hugging Face's `target` projection is."""
    H, G, K, F = shape.n_heads, shape.kv_heads, shape.head_dim, shape.d_ff
    q, kv = H * K, G * K
    return {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv), "o_proj": (0, shape.d_model),
            "gate_proj": (0, F), "up_proj": (F, 2 * F), "down_proj": (0, shape.d_model)}[target]


def in_features(shape: ModelShape, target: str) -> int:
    return {"o_proj": shape.n_heads * shape.head_dim, "down_proj": shape.d_ff}.get(target, shape.d_model)


def adapted(module: nn.Module, lora: LoraSpec | None, y: jax.Array, x: jax.Array, kernel: str) -> jax.Array:
    """`y` (the output of `module`'s dense `kernel` on `x`) plus the adapters of every target on that kernel.

    Called inside a compact module method, so the adapters are that module's parameters. Dropout draws from
    the "dropout" rng stream when the caller gives one (training); otherwise it is off (eval, sampling).
    """
    if lora is None:
        return y
    shape = module.shape
    for target in lora.targets:
        if TARGET_MODULE[target][1] != kernel:
            continue
        a, b = target_columns(shape, target)
        fan_in = in_features(shape, target)
        bound = 1.0 / np.sqrt(fan_in)
        A = module.param(f"{target}{MARK}a", _uniform(bound), (fan_in, lora.rank), jnp.float32)
        B = module.param(f"{target}{MARK}b", nn.initializers.zeros, (lora.rank, b - a), jnp.float32)
        h = x
        if lora.dropout > 0 and module.has_rng("dropout"):
            h = nn.Dropout(lora.dropout, deterministic=False)(h)
        # The scale on the rank-r side (no pass over the (..., out) delta), and the kernel's product precision
        # with its backward's layouts (slm.model.matmul): jnp's own transpose of (h A) B fed dB a transposed
        # copy of the (tokens, out) cotangent: 19% of the profiled Qwen3-0.6B LoRA step on CPU (bf16 products).
        mm = getattr(module, "matmul", "float32")
        hA = linear(h.astype(y.dtype), A, mm) * lora.scale
        y = y.at[..., a:b].add(linear(hA, B, mm))
    return y


def _uniform(bound: float):
    """PEFT's A init (kaiming-uniform with a = sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))."""
    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def is_adapter(path: tuple[str, ...]) -> bool:
    return MARK in path[-1]


def split(params: Any) -> tuple[dict, dict]:
    """(base, adapters): one tree in, two nested dicts out (the arrays are shared, nothing is copied)."""
    flat = traverse_util.flatten_dict(params)
    base = {k: v for k, v in flat.items() if not is_adapter(k)}
    adapters = {k: v for k, v in flat.items() if is_adapter(k)}
    return traverse_util.unflatten_dict(base), traverse_util.unflatten_dict(adapters)


def merge(base: Any, adapters: Any) -> dict:
    """The one tree the model applies: base and adapters side by side (no arithmetic, no copies)."""
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(base), **traverse_util.flatten_dict(adapters)})


def fold(params: Any, shape: ModelShape, lora: LoraSpec) -> dict:
    """Base + (alpha / r) A B added into each targeted kernel, adapters dropped: a plain model's tree (float32
    where folded). Works on numpy or jax arrays."""
    base, adapters = split(params)
    flat = traverse_util.flatten_dict(base)
    for (block, module, name), A in traverse_util.flatten_dict(adapters).items():
        if not name.endswith(f"{MARK}a"):
            continue
        target = name[: -len(f"{MARK}a")]
        B = adapters[block][module][f"{target}{MARK}b"]
        kernel_key = (block, module, TARGET_MODULE[target][1], "kernel")
        a, b = target_columns(shape, target)
        xp = jnp if isinstance(flat[kernel_key], jax.Array) else np
        kernel = xp.asarray(flat[kernel_key], dtype=np.float32)
        delta = xp.asarray(A, np.float32) @ xp.asarray(B, np.float32) * lora.scale
        flat[kernel_key] = kernel.at[:, a:b].add(delta) if xp is jnp else _np_add(kernel, a, b, delta)
    return traverse_util.unflatten_dict(flat)


def _np_add(kernel: np.ndarray, a: int, b: int, delta: np.ndarray) -> np.ndarray:
    out = np.array(kernel, dtype=np.float32)
    out[:, a:b] += delta
    return out
