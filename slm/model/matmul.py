"""Matrix products with bfloat16 operands and float32 accumulation, forward and backward (--matmul-precision
bfloat16): what `jax.default_matmul_precision("bfloat16")` means on a TPU, made explicit for CPUs and GPUs.

Why a custom VJP rather than casting the operands: XLA:CPU (jax 0.10) runs a bf16 x bf16 -> f32 product in
YNNPACK at ~2x its f32 speed on AVX512-BF16 cores, but only in the forms it recognises. JAX's own transpose of
a cast-then-dot feeds the f32 cotangent into the backward products, so they ran in f32; a bf16 result type
(the Linen `dtype=bfloat16` path) runs at f32 speed or below. Here all three products of a linear layer
(y = x.w, dx = g.w^T, dw = x^T.g) take bf16 operands in YNNPACK's forms and accumulate in f32; activations and
gradients stay in their own dtypes (float32 outside --use-mixed-precision), so only the products round.
Measured in docs/performance.md ("bf16 matrix products").
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Dtype = Any
BF16 = jnp.dtype(jnp.bfloat16)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _linear(x: jax.Array, w: jax.Array, out_dtype: Dtype, w_rows_out: bool, op: Dtype) -> jax.Array:
    return _product(x.astype(op), w.astype(op), w_rows_out).astype(out_dtype)


def contract_f32(a: jax.Array, a_axes: tuple[int, ...], b: jax.Array, b_axes: tuple[int, ...]) -> jax.Array:
    """a's `a_axes` contracted with b's `b_axes` (no batch axes), summed in float32 whatever the operands."""
    return lax.dot_general(a, b, ((a_axes, b_axes), ((), ())), preferred_element_type=jnp.float32)


def _product(xb: jax.Array, wb: jax.Array, w_rows_out: bool) -> jax.Array:
    """x (..., D) with w (D, F), or with w (F, D) when `w_rows_out` -> (..., F) in float32."""
    return contract_f32(xb, (xb.ndim - 1,), wb, (1 if w_rows_out else 0,))


def _linear_fwd(x: jax.Array, w: jax.Array, out_dtype: Dtype, w_rows_out: bool, op: Dtype) -> tuple[jax.Array, tuple]:
    xb, wb = x.astype(op), w.astype(op)
    # The dtypes of x and w ride along as empty arrays (custom_vjp residuals must be arrays).
    return _product(xb, wb, w_rows_out).astype(out_dtype), (xb, wb, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _linear_bwd(out_dtype: Dtype, w_rows_out: bool, op: Dtype, res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """dx = g.w^T and dw = x^T.g, each with its operands in the row-major forms YNNPACK takes: the lhs's
    contracted axis last, or (for dw) the token axes, which XLA's dot decomposer turns into such a form."""
    xb, wb, x_tag, w_tag = res
    gb = g.astype(op)
    last, lead = gb.ndim - 1, tuple(range(xb.ndim - 1))
    dx = contract_f32(gb, (last,), wb, (0 if w_rows_out else 1,))
    dw = contract_f32(gb, lead, xb, lead) if w_rows_out else contract_f32(xb, lead, gb, lead)
    return dx.astype(x_tag.dtype), dw.astype(w_tag.dtype)


_linear.defvjp(_linear_fwd, _linear_bwd)


def bf16_linear(x_NxD: jax.Array, w_DxF: jax.Array, out_dtype: Dtype = None) -> jax.Array:
    """x (..., D) . w (D, F) -> (..., F) in `out_dtype` (default x's), bf16 operands, f32 accumulation."""
    return _linear(x_NxD, w_DxF, jnp.dtype(out_dtype or x_NxD.dtype), False, BF16)


def linear(x_NxD: jax.Array, w_DxF: jax.Array, precision: str) -> jax.Array:
    """x (..., D) . w (D, F) -> (..., F) in x's dtype, operands in bf16 where `precision` is "bfloat16", else in
    x's dtype, f32 sums: jnp's own transpose of x . w fed dw a transposed copy of g on XLA:CPU (LoRA's B)."""
    op = BF16 if precision == "bfloat16" else jnp.dtype(x_NxD.dtype)
    return _linear(x_NxD, w_DxF, jnp.dtype(x_NxD.dtype), False, op)


def bf16_linear_rows(x_NxD: jax.Array, w_FxD: jax.Array, out_dtype: Dtype = None) -> jax.Array:
    """x (..., D) . w (F, D)^T -> (..., F), e.g. the tied head's logits; no transpose of w is materialised."""
    return _linear(x_NxD, w_FxD, jnp.dtype(out_dtype or x_NxD.dtype), True, BF16)


def bf16_dot_general(x: jax.Array, w: jax.Array, dimension_numbers: Any, precision: Any = None,
                     preferred_element_type: Any = None, **_: Any) -> jax.Array:
    """`lax.dot_general` for flax.linen.Dense(dot_general=...): its one form, x's last axis with w's first."""
    if tuple(map(tuple, dimension_numbers[0])) != ((x.ndim - 1,), (0,)) or any(dimension_numbers[1]):
        raise ValueError(f"bf16_dot_general: only Dense's (..., D) . (D, F), got {dimension_numbers}")
    return bf16_linear(x, w, preferred_element_type)


def cpu_has_bf16_dot() -> bool:
    """Whether this host's CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16 in /proc/cpuinfo), where
    --matmul-precision bfloat16 pays; False where the file is missing (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_matmul_precision() -> str:
    """--matmul-precision's default: bfloat16 where jax runs on a CPU with native bf16 products (measured 1.2-1.6x
    faster steps there, the same losses), float32 elsewhere (accelerators have --use-mixed-precision)."""
    return "bfloat16" if jax.default_backend() == "cpu" and cpu_has_bf16_dot() else "float32"
