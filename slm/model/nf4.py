"""QLoRA's 4-bit NormalFloat (NF4) for a frozen base (Dettmers et al. 2023, and bitsandbytes' layout).

Each weight matrix, in transformers' (out, in) layout and flattened row-major, is cut into blocks of 64
values; a block keeps its absmax (float32) and each value the index (4 bits) of the nearest of the 16 NF4
levels to value / absmax. Two indices share a byte, the first in the high nibble. So a block of 64 weights
whose `in` is a multiple of 64 never spans two output rows, and the blocks are bitsandbytes' own. The
absmax values are not quantised again (no double quantisation): 4 + 32/64 = 4.5 bits a weight.

Quantising is numpy on the host, once, as the weights load. `nf4_linear` dequantises inside the jitted step,
per matmul, and its custom VJP dequantises again for the input gradient instead of keeping the dequantised
matrix from the forward: the step holds the 4-bit codes, never a 16- or 32-bit copy of the base.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from slm.model.matmul import contract_f32
from slm.model.sizing import ModelShape, hidden_matrix_shapes

# The 16 NF4 levels (QLoRA, appendix E; bitsandbytes' dDequantizeNF4), index 0b0000 .. 0b1111.
LEVELS = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                   -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                   0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                   0.7229568362236023, 1.0], np.float32)
BLOCK = 64
KERNELS = (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down"))  # the block's matmul kernels
_MIDPOINTS = (LEVELS[1:] + LEVELS[:-1]) / 2


def blocks_of(n_in: int, n_out: int) -> int:
    return -(-(n_in * n_out) // BLOCK)


def quantize(kernel_IxO: np.ndarray, chunk: int = 1 << 14) -> dict[str, np.ndarray]:
    """A kernel (in, out) -> {"nf4_codes": uint8 (blocks * 32,), "nf4_absmax": float32 (blocks,)}, `chunk` blocks
    at a time so the float32 and index temporaries stay a few MB whatever the kernel's size."""
    flat = np.ascontiguousarray(np.asarray(kernel_IxO).T).reshape(-1)  # (out, in) row-major, in its own dtype
    n_blocks = blocks_of(*kernel_IxO.shape)
    codes, absmax = np.empty(n_blocks * BLOCK // 2, np.uint8), np.empty(n_blocks, np.float32)
    for b0 in range(0, n_blocks, chunk):
        b1 = min(b0 + chunk, n_blocks)
        blocks = np.zeros((b1 - b0) * BLOCK, np.float32)
        part = flat[b0 * BLOCK: b1 * BLOCK]
        blocks[: part.size] = part
        blocks = blocks.reshape(-1, BLOCK)
        absmax[b0:b1] = np.abs(blocks).max(axis=1)
        scaled = blocks / np.where(absmax[b0:b1] > 0, absmax[b0:b1], 1.0)[:, None]
        idx = np.searchsorted(_MIDPOINTS, scaled).astype(np.uint8).reshape(-1)  # the nearest level's index
        codes[b0 * BLOCK // 2: b1 * BLOCK // 2] = (idx[0::2] << 4) | idx[1::2]
    return {"nf4_codes": codes, "nf4_absmax": absmax}


def layout_for(platform: str, decoding: bool = False) -> str:
    """How a backend dequantises (nf4_linear's `layout`): "halves" (dequantize_halves) on a TPU, and in the CPU's
    KV-cache decoder, where the selects vectorise and the pair lookup's gather is a scalar loop: SmolLM2-135M's
    QLoRA sampler 1.97x faster a token (2-core EPYC, 2026-11-28, bench/qlora.py --decode), the same 6.8 MB of
    XLA:CPU temporaries. "pairs" (dequantize_rows) elsewhere: the CPU's and a GPU's training memory terms and
    speeds, and a GPU's sampler on real cards, were measured with the pair lookup."""
    return "halves" if platform == "tpu" or (decoding and platform == "cpu") else "pairs"


def dequantize_rows(codes: jax.Array, absmax: jax.Array, n_in: int, n_out: int, dtype: Any,
                    levels: jax.Array | None = None) -> jax.Array:
    """The weights back as (out, in) rows in `dtype` (jax; traced inside the step, or for exports)."""
    table = jnp.asarray(LEVELS) if levels is None else levels
    byte = jnp.arange(256)
    # (256, 2): what each byte stands for; built from `levels`, never a constant, so the lookup still depends on
    # the layer's input (see _after)
    pair_table = jnp.stack([table[byte >> 4], table[byte & 15]], axis=-1)
    # one lookup a byte for both its weights: XLA:CPU's gathers are scalar loops, and this halves them and
    # reads one row of 8 bytes: 9x faster than a lookup a nibble (1152 x 6912, float32, 2-core EPYC), the same bits
    pairs = jnp.take(pair_table, codes.astype(jnp.int32), axis=0, mode="clip")
    values = pairs.reshape(-1, BLOCK) * absmax[:, None]
    return values.reshape(-1)[: n_in * n_out].reshape(n_out, n_in).astype(dtype)


def dequantize_halves(codes: jax.Array, absmax: jax.Array, n_in: int, n_out: int, dtype: Any,
                      levels: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(even_OxH, odd_OxH): the weights of the even and of the odd inputs, H = in / 2 (the high and the low
    half-bytes), computed in `dtype`; `in` a multiple of the block. For a TPU, where a lookup (a gather) and
    any (n, 2) or (.., 32) array are laid out padded to 128 lanes and the step held ~14 bytes a weight of its
    largest kernel (Mistral-7B's 4,096 x 28,672: 1.6 GB): here each level is picked by 15 selects on the
    nibble's bits and scaled in `dtype`, elementwise, so libtpu fuses it into one pass from the codes to the
    two halves (1.5 of the bf16 kernel's bytes in all, bench/plan_for_xla.py; a float32 product cast to bf16
    is not fused, hence `dtype`'s arithmetic: bf16 levels x bf16 absmax, within three bf16 roundings)."""
    table = (jnp.asarray(LEVELS) if levels is None else levels).astype(dtype)
    c_OxBx32 = codes[: n_in * n_out // 2].reshape(n_out, n_in // BLOCK, BLOCK // 2)
    # times the top level (1.0, but the layer's input's: _after), so that the scales too depend on the anchor: else
    # libtpu shares their broadcast, (out, in / 64, 32) in `dtype`, between forward and backward and holds it for
    # every layer from one to the other (on several chips, float32: ~1 byte a block weight a layer)
    scale_OxBx1 = absmax[: n_in * n_out // BLOCK].reshape(n_out, -1, 1).astype(dtype) * table[-1]

    def level(nibble: jax.Array) -> jax.Array:
        values = [table[i] for i in range(16)]
        for bit in range(4):  # a binary tree of selects, lowest bit first: 8, 4, 2, 1 candidates left
            on = (nibble & (1 << bit)) != 0
            values = [jnp.where(on, values[2 * j + 1], values[2 * j]) for j in range(len(values) // 2)]
        return values[0]

    return tuple((level(half) * scale_OxBx1).reshape(n_out, n_in // 2) for half in (c_OxBx32 >> 4, c_OxBx32 & 15))


def dequantize(q: dict[str, Any], n_in: int, n_out: int) -> np.ndarray:
    """The float32 kernel (in, out) that a quantized one stands for, as numpy (exports, tests)."""
    return np.asarray(dequantize_rows(jnp.asarray(q["nf4_codes"]), jnp.asarray(q["nf4_absmax"]), n_in, n_out,
                                      jnp.float32).T)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def nf4_linear(x: jax.Array, codes: jax.Array, absmax: jax.Array, n_out: int, dtype: Any, bf16: bool,
               layout: str = "pairs") -> jax.Array:
    """x (..., in) . W (in, out) with W dequantised to `dtype` (bf16 operands and float32 sums when `bf16`;
    `layout`: layout_for's)."""
    return _forward(x, codes, absmax, n_out, dtype, bf16, layout)


def _in_halves(layout: str, n_in: int) -> bool:
    """Whether a kernel of `n_in` inputs is dequantised in halves (a block never spans two rows)."""
    return layout == "halves" and n_in % BLOCK == 0


def _dot(a: jax.Array, a_dim: int, w: jax.Array, w_dim: int, bf16: bool) -> jax.Array:
    if bf16:
        return contract_f32(a.astype(jnp.bfloat16), (a_dim,), w, (w_dim,))
    return lax.dot_general(a.astype(w.dtype), w, (((a_dim,), (w_dim,)), ((), ())))


def _forward(x: jax.Array, codes: jax.Array, absmax: jax.Array, n_out: int, dtype: Any, bf16: bool,
             layout: str) -> jax.Array:
    levels, wd, last = _after(x), jnp.bfloat16 if bf16 else dtype, x.ndim - 1
    if _in_halves(layout, x.shape[-1]):  # two half-width products: the weights never interleaved
        even, odd = dequantize_halves(codes, absmax, x.shape[-1], n_out, wd, levels)
        return (_dot(x[..., 0::2], last, even, 1, bf16) + _dot(x[..., 1::2], last, odd, 1, bf16)).astype(dtype)
    return _dot(x, last, dequantize_rows(codes, absmax, x.shape[-1], n_out, wd, levels), 1, bf16).astype(dtype)


def _after(anchor: jax.Array) -> jax.Array:
    """The 16 levels, made to depend on one element of `anchor` (the layer's input, or its output's cotangent).

    Otherwise the dequantisation depends on the parameters alone: XLA computes every layer's up front and
    merges the backward's with the forward's (common-subexpression elimination), holding the whole base
    dequantised for the step. XLA:CPU drops optimization barriers before scheduling, so the dependency is
    a real one: x0 * 0 (not folded for floats; a non-finite x0 would make this layer's output non-finite
    anyway)."""
    return jnp.asarray(LEVELS) + anchor.reshape(-1)[0].astype(jnp.float32) * 0.0


def _fwd(x: jax.Array, codes: jax.Array, absmax: jax.Array, n_out: int, dtype: Any, bf16: bool,
         layout: str) -> tuple:
    # the residuals are the 4-bit codes (held anyway) and x's dtype: no activation, no dequantised matrix
    return (_forward(x, codes, absmax, n_out, dtype, bf16, layout),
            (codes, absmax, jnp.zeros((0, x.shape[-1]), x.dtype)))


def _bwd(n_out: int, dtype: Any, bf16: bool, layout: str, res: tuple, g: jax.Array) -> tuple:
    codes, absmax, x_tag = res  # x_tag: x's dtype and width, as an empty array
    levels, wd, n_in, last = _after(g), jnp.bfloat16 if bf16 else dtype, x_tag.shape[1], g.ndim - 1
    if _in_halves(layout, n_in):  # dequantised again, here, once g exists (see _after)
        even, odd = dequantize_halves(codes, absmax, n_in, n_out, wd, levels)
        dx = jnp.stack([_dot(g, last, even, 0, bf16), _dot(g, last, odd, 0, bf16)], axis=-1)
        dx = dx.reshape(*g.shape[:-1], n_in)  # the even and the odd inputs' gradients interleaved back
    else:
        dx = _dot(g, last, dequantize_rows(codes, absmax, n_in, n_out, wd, levels), 0, bf16)
    return dx.astype(x_tag.dtype), np.zeros(codes.shape, jax.dtypes.float0), jnp.zeros_like(absmax)


nf4_linear.defvjp(_fwd, _bwd)


def quantize_params(params: dict) -> dict:
    """A model's params (numpy) with each block's matmul kernels quantized; everything else as it was."""
    out = dict(params)
    for name, block in params.items():
        if name.startswith("block_"):
            out[name] = quantize_block(block)
    return out


def quantize_block(block: dict) -> dict:
    """One block's params with its four matmul kernels replaced by their NF4 codes and absmax."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in block.items()}
    for part, name in KERNELS:
        module = dict(out[part][name])
        module.update(quantize(module.pop("kernel")))
        out[part] = {**out[part], name: module}
    return out


def kernel_shapes(shape: ModelShape) -> dict:
    """{(part, name): (in, out)} of a block's four matmul kernels (KERNELS), in sizing's order."""
    return dict(zip(KERNELS, hidden_matrix_shapes(shape)[:len(KERNELS)]))


def dequantize_params(params: dict, shape: ModelShape) -> dict:
    """The inverse, for sampling and exports: every quantized kernel back to a float32 (in, out) jax array
    (NF4's level times its block's absmax); the other leaves as they were."""
    shapes, out = kernel_shapes(shape), dict(params)
    for name, block in params.items():
        if not name.startswith("block_"):
            continue
        block = {k: dict(v) if isinstance(v, dict) else v for k, v in block.items()}
        for part, kernel in KERNELS:
            module = dict(block[part][kernel])
            codes, absmax = jnp.asarray(module.pop("nf4_codes")), jnp.asarray(module.pop("nf4_absmax"))
            module["kernel"] = dequantize_rows(codes, absmax, *shapes[(part, kernel)], jnp.float32).T
            block[part] = {**block[part], kernel: module}
        out[name] = block
    return out
