"""Rotary position embeddings (RoPE): the frequency tables, with the rope scalings pretrained families use
(Llama 3.x's `llama3`, and `linear`), and the rotation itself. The tables are numpy constants, folded
into the compiled step.

A scaling is a plain tuple, so it can sit in the frozen ModelShape and round-trip through config.json:
("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) or ("linear", factor).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SCALINGS = ("llama3", "linear")


def inv_frequencies(head_dim: int, base: float, scaling: tuple | None = None) -> np.ndarray:
    """base^(-2i/K) for each pair i, in float32 like the reference formula, then the scaling's adjustment.

    llama3 leaves wavelengths shorter than original/high_freq_factor alone, divides those longer than
    original/low_freq_factor by `factor`, and blends the two in between (transformers'
    `_compute_llama3_parameters`); linear divides every frequency by `factor`.
    """
    f32 = np.float32
    inv = f32(1.0) / (f32(base) ** (np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)))
    if scaling is None:
        return inv
    kind, factor = scaling[0], f32(scaling[1])
    if kind == "linear":
        return inv / factor
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r}: use one of {', '.join(SCALINGS)}")
    low, high, original = f32(scaling[2]), f32(scaling[3]), f32(scaling[4])
    wavelen = f32(2 * math.pi) / inv
    scaled = np.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, blended, scaled).astype(f32)


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0,
                scaling: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(cos, signed sin) tables of shape (L, K) for `rotary`, as numpy constants (folded at compile time).

    cos = [cos, cos] and sin = [-sin, sin] over the two halves of each head, with angle
    position * inv_frequency for pair i.
    """
    angles_LxK2 = np.arange(seq_len, dtype=np.float32)[:, None] * inv_frequencies(head_dim, base, scaling)[None, :]
    cos, sin = np.cos(angles_LxK2), np.sin(angles_LxK2)
    return np.concatenate([cos, cos], axis=-1), np.concatenate([-sin, sin], axis=-1)


def rotary(x_BxLxHxK: jax.Array, base: float = 10000.0, scaling: tuple | None = None) -> jax.Array:
    """Rotate pairs (first half, second half) of each head by position-dependent angles (RoPE).

    out = [x1*cos - x2*sin, x2*cos + x1*sin], written as x*[cos, cos] + swap(x)*[-sin, sin] where swap
    exchanges the two halves with a reshape + reverse. On CPU this is one elementwise fusion forward and
    backward, where slicing the halves and concatenating them cost several pad/concatenate copies
    (about 4 ms of a ~65 ms train step at the 4x128 "baby" shape).
    """
    B, L, H, K = x_BxLxHxK.shape
    cos_LxK, sin_LxK = rope_tables(L, K, base, scaling)
    return _rotate(x_BxLxHxK, cos_LxK, sin_LxK)


def rotary_at(x_BxTxHxK: jax.Array, start: jax.Array, table_len: int, base: float = 10000.0,
              scaling: tuple | None = None) -> jax.Array:
    """`rotary` for T tokens at absolute positions start..start+T-1 (start may be traced).

    Slices rows of the same numpy tables `rotary` uses, built for `table_len` >= start + T positions, so
    position p gets exactly the rotation `rotary` gives position p of a full sequence.
    """
    B, T, H, K = x_BxTxHxK.shape
    cos_SxK, sin_SxK = rope_tables(table_len, K, base, scaling)
    cos_TxK = jax.lax.dynamic_slice_in_dim(jnp.asarray(cos_SxK), start, T, axis=0)
    sin_TxK = jax.lax.dynamic_slice_in_dim(jnp.asarray(sin_SxK), start, T, axis=0)
    return _rotate(x_BxTxHxK, cos_TxK, sin_TxK)


def rotary_positions(x_BxLxHxK: jax.Array, pos_BxL: jax.Array, base: float = 10000.0,
                     scaling: tuple | None = None) -> jax.Array:
    """`rotary` at per-token positions (document masking restarts them at each document)."""
    B, L, H, K = x_BxLxHxK.shape
    cos_LxK, sin_LxK = rope_tables(L, K, base, scaling)
    return _rotate(x_BxLxHxK, jnp.asarray(cos_LxK)[pos_BxL][:, :, None, :], jnp.asarray(sin_LxK)[pos_BxL][:, :, None, :])


def _rotate(x_BxLxHxK: jax.Array, cos: Any, sin: Any) -> jax.Array:
    """x * cos + swap(x) * sin; cos/sin are (L, K) tables, or already (B, L, 1, K) per token."""
    B, L, H, K = x_BxLxHxK.shape
    x = x_BxLxHxK.astype(jnp.float32)
    swapped = x.reshape(B, L, H, 2, K // 2)[..., ::-1, :].reshape(B, L, H, K)
    if cos.ndim == 2:
        cos, sin = cos[:, None, :], sin[:, None, :]
    out = x * cos + swapped * sin
    return out.astype(x_BxLxHxK.dtype)
