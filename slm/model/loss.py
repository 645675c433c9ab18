"""Cross-entropy over vocabulary chunks: the per-token loss and its gradient without the (B, L, V) logits
(--loss-chunk). What it is for: a fine-tune of a big-vocabulary model (Qwen2.5: V = 151,936) holds
B*L*V float32 logits plus their softmax and gradient, 3.7 GB at batch 1 x seq 2,048, more than the
model's own activations; here the step holds B*L*C of them (C = the chunk) at a time.

Forward: a scan over the head's rows C at a time, an online log-sum-exp (running max and sum) and the
target's logit picked out of the chunk that holds it. Backward: the same scan recomputes each chunk's logits
(one more x.head^T product: 2*B*L*V*D FLOPs, a third more than the head's forward and backward), turns
them into softmax - onehot and adds its products into dx (carried, B*L*D) and dhead (the chunk's own rows).
Chunking the vocabulary rather than the tokens keeps the batch axis whole in every chunk, so a batch split
over devices (data parallel) stays split; each chunk's dhead rows are summed over the devices in the loop, the
bytes of one all-reduce of the head's gradient in pieces. Under FSDP the head is split along V and each chunk
reads a slice of it at a traced offset (not measured).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from slm.model.matmul import contract_f32

Dtype = Any


def _chunk_logits(x_BxLxD: jax.Array, head_VxD: jax.Array, i: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chunk i's float32 logits (B, L, C), the row its slice of the head starts at, and the slice (C, D) in x's
    dtype (cast a chunk at a time: no copy of the whole head in the products' dtype, rows_in_loop).

    Entries i*C .. i*C+C-1; the last chunk's slice is moved back to end at V (no padded copy of the head), and
    its columns below i*C, which the chunk before it counted, are -inf."""
    start, h_CxD = _head_rows(head_VxD, i, chunk, x_BxLxD.dtype)
    logits = contract_f32(x_BxLxD, (2,), h_CxD, (1,))
    return jnp.where(start + jnp.arange(chunk) >= i * chunk, logits, -jnp.inf), start, h_CxD


def _head_rows(head_VxD: jax.Array, i: jax.Array, chunk: int, dtype: Dtype) -> tuple[jax.Array, jax.Array]:
    """Chunk i's first row (the last chunk moved back to end at V) and its `chunk` rows of the head in `dtype`."""
    start = jnp.minimum(i * chunk, head_VxD.shape[0] - chunk)
    return start, rows_in_loop(head_VxD, i, start, chunk).astype(dtype)


def rows_in_loop(a_VxD: jax.Array, i: jax.Array, start: jax.Array, rows: int) -> jax.Array:
    """Rows start..start+rows of `a`, read inside a loop whose counter is `i`, in a's own dtype.

    The barrier ties `a` to the counter: otherwise XLA's loop-invariant code motion hoists the cast XLA:CPU
    puts before a 16-bit slice (bf16 is not native there) out of the loop, a float32 copy of the whole table
    (1.2 GB for Gemma-3-1B's head) held for `rows` of it; slicing the bit pattern instead left a 16-bit copy.
    Gemma-3-1B's bf16 head, the loss's value and input gradient at 2 x 128 tokens: 580 -> 4 MB of XLA's
    temporaries, 1.06-1.3x faster (2-core EPYC, 2026-11-27). On an H100 the barrier costs nothing: the same
    loss at 1 x 512 and 8 x 512 tokens, 0.99-1.006x a plain slice's time, the same temporaries."""
    a_VxD, _ = lax.optimization_barrier((a_VxD, i))
    return lax.dynamic_slice_in_dim(a_VxD, start, rows)


def head_logits(x_BxLxD: jax.Array, head_VxD: jax.Array, chunk: int) -> jax.Array:
    """x . head^T as float32 logits (B, L, V), the products in x's dtype, the head cast `chunk` rows at a time
    (rows_in_loop): a head held in bfloat16 beside float32 activations is never copied whole. The last chunk
    ends at V (no padded copy of the head) and writes again the columns the chunk before wrote, same values."""
    V = head_VxD.shape[0]
    if chunk >= V or head_VxD.dtype == x_BxLxD.dtype:
        return contract_f32(x_BxLxD, (2,), head_VxD.astype(x_BxLxD.dtype), (1,))

    def body(i: jax.Array, out_BxLxV: jax.Array) -> jax.Array:
        start, h_CxD = _head_rows(head_VxD, i, chunk, x_BxLxD.dtype)
        return lax.dynamic_update_slice_in_dim(out_BxLxV, contract_f32(x_BxLxD, (2,), h_CxD, (1,)), start, axis=2)

    return lax.fori_loop(0, -(-V // chunk), body, jnp.zeros(x_BxLxD.shape[:2] + (V,), jnp.float32))


def _hits(targets_BxL: jax.Array, start: jax.Array, i: jax.Array, chunk: int) -> jax.Array:
    """(B, L, C): where chunk i's column is the token's target (never for targets < 0, nor in the columns the
    chunk before counted)."""
    col_C = start + jnp.arange(chunk)
    return (targets_BxL[..., None] == col_C) & (col_C >= i * chunk)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _nll(x_BxLxD: jax.Array, head_VxD: jax.Array, targets_BxL: jax.Array, chunk: int, dtype: Dtype) -> jax.Array:
    return _forward(x_BxLxD.astype(dtype), head_VxD, targets_BxL, chunk)[0]


def _forward(x_BxLxD: jax.Array, head_VxD: jax.Array, targets_BxL: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """(per-token NLL, log-partition), both (B, L) float32: one pass over the chunks, online log-sum-exp."""

    def body(carry, i):
        m_BxL, s_BxL, tgt_BxL = carry
        logits, start, _ = _chunk_logits(x_BxLxD, head_VxD, i, chunk)
        m_new = jnp.maximum(m_BxL, jnp.max(logits, axis=-1))
        s_BxL = s_BxL * jnp.exp(m_BxL - m_new) + jnp.sum(jnp.exp(logits - m_new[..., None]), axis=-1)
        tgt_BxL = tgt_BxL + jnp.sum(jnp.where(_hits(targets_BxL, start, i, chunk), logits, 0.0), axis=-1)
        return (m_new, s_BxL, tgt_BxL), None

    zeros = jnp.zeros(targets_BxL.shape, jnp.float32)
    n = -(-head_VxD.shape[0] // chunk)
    (m, s, tgt), _ = lax.scan(body, (zeros - jnp.inf, zeros, zeros), jnp.arange(n))
    logz_BxL = m + jnp.log(s)
    return jnp.where(targets_BxL >= 0, logz_BxL - tgt, 0.0), logz_BxL


def _nll_fwd(x, head, targets, chunk, dtype):
    """symbolic_zeros: each input comes with `perturbed`; a head that takes no gradient (LoRA's frozen base)
    gets none computed, which also frees the backward pass of a (V, D) accumulator."""
    xc = x.value.astype(dtype)
    nll, logz_BxL = _forward(xc, head.value, targets.value, chunk)
    # Dtypes ride along as empty arrays (residuals are arrays); None (in the tree's structure, so static under
    # any transform): the head takes no gradient.
    h_tag = jnp.zeros((0,), head.value.dtype) if head.perturbed else None
    return nll, (xc, head.value, targets.value, logz_BxL, jnp.zeros((0,), x.value.dtype), h_tag)


def _nll_bwd(chunk, dtype, res, g_BxL):
    xc, head_VxD, targets_BxL, logz_BxL, x_tag, h_tag = res
    if isinstance(g_BxL, SymbolicZero):  # the loss itself takes no gradient
        return None, None, None
    g_BxL = jnp.where(targets_BxL >= 0, g_BxL, 0.0).astype(jnp.float32)

    def body(carry, i):
        dx_BxLxD, dh_VxD = carry
        logits, start, h_CxD = _chunk_logits(xc, head_VxD, i, chunk)
        # 0 in the columns the chunk before counted: their logits are -inf and _hits leaves them out
        p = jnp.exp(logits - logz_BxL[..., None])
        d_BxLxC = ((p - _hits(targets_BxL, start, i, chunk)) * g_BxL[..., None]).astype(dtype)
        dx_BxLxD = dx_BxLxD + contract_f32(d_BxLxC, (2,), h_CxD, (0,))
        if dh_VxD is not None:  # each row belongs to one chunk: added once, to zeros
            dh_CxD = contract_f32(d_BxLxC, (0, 1), xc, (0, 1)).astype(dh_VxD.dtype)
            dh_VxD = lax.dynamic_update_slice_in_dim(
                dh_VxD, lax.dynamic_slice_in_dim(dh_VxD, start, chunk) + dh_CxD, start, 0)
        return (dx_BxLxD, dh_VxD), None

    dh = jnp.zeros(head_VxD.shape, head_VxD.dtype) if h_tag is not None else None
    n = -(-head_VxD.shape[0] // chunk)
    (dx, dh), _ = lax.scan(body, (jnp.zeros(xc.shape, jnp.float32), dh), jnp.arange(n))
    return dx.astype(x_tag.dtype), dh, None


_nll.defvjp(_nll_fwd, _nll_bwd, symbolic_zeros=True)


def chunked_token_nll(x_BxLxD: jax.Array, head_VxD: jax.Array, targets_BxL: jax.Array, chunk: int,
                      dtype: Dtype = None) -> jax.Array:
    """Per-token NLL (B, L) in nats, float32, of logits x.head^T, `chunk` vocabulary entries at a time; 0 where
    the target is negative. The products take operands in `dtype` (default x's) and sum in float32, as the
    full head does; log-sum-exp, softmax and the loss are float32."""
    if int(chunk) < 1:
        raise ValueError(f"chunked_token_nll: chunk {chunk} must be at least 1")
    chunk = min(int(chunk), head_VxD.shape[0])
    return _nll(x_BxLxD, head_VxD, targets_BxL, chunk, jnp.dtype(dtype or x_BxLxD.dtype))

