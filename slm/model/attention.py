"""Causal attention for the training step, eval, the sampler's prefill and --plan-for's programs (the
KV-cache decoder's one-token steps keep slm.model.transformer.attend): exact softmax attention computed
block by block, each block of queries against only the keys it can see.

Shapes are in the names: B batch, L queries, S keys, H query heads, G key/value heads (H = G x R), K head dim.

Why blocks: under a causal mask half of the (L, S) scores are thrown away. Query block i (rows i*c..(i+1)*c-1)
sees only keys 0..(i+1)*c-1, so it is computed against that prefix alone: with n blocks the products and the
probabilities kept for the backward pass shrink to (n + 1) / 2n of the full square (62% at n = 4, 56% at 8).
Each block's softmax runs over its whole visible row at once, so no online rescaling is needed and the result
is the plain attention's, not an approximation of it.

Why a custom VJP (`_block`): the backward pass is written out (dS = P * (dP - rowsum(dO * O))) with every
product in a form XLA:CPU's dot emitter takes without transposing an (L, S) operand (dV and dK are computed
transposed, `_by_rows`), and with bf16 operands and float32 sums when `bf16` is set (--matmul-precision
bfloat16: the CPUs with native bf16 products), the way slm.model.matmul does for the projections; jax's own
transpose of a cast-then-dot would run the backward products in float32. The probabilities are kept
unnormalised (exp(s - rowmax), in the operands' dtype) with their row sums: the division by the row sum goes
on the (L, K) output and gradients instead of a pass over (L, S). Against the normalised form with P^T
products (2-core Zen 3 EPYC, one host device per core, 2026-11-26, bench/attention.py --devices 2 [--step]):
attention alone 1.09-1.58x at seq 1,024-2,048, level at shorter ones; the 10M train step 1.05x at seq 1,024,
1.13x at 2,048.

Grouped-query heads: query head h uses key/value head h // R (transformers' repeat_kv order); the R query
heads of a group are one matrix against their group's keys, so no key/value copies are made.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from slm.model.sizing import attention_block

Dtype = Any
NEG = float(jnp.finfo(jnp.float32).min)


def causal_attend(q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, dtype: Dtype,
                  scale: float | None = None, *, window: int = 0, mask_BxLxS: jax.Array | None = None,
                  bf16: bool = False, block: int | None = None) -> jax.Array:
    """softmax(q k^T * scale + causal mask) v -> (B, L, H, K) in `dtype`, for queries at positions S-L..S-1 of
    the keys (L = S in training; the decoder's prefill after a cache has L < S). `window`: keys `window` or
    more positions behind a query are hidden too (a sliding-window layer); `mask_BxLxS`: a further boolean
    mask (document masking), ANDed with the causal one. `bf16`: the products' operands in bfloat16, sums and
    softmax in float32. `block`: the query block (default slm.model.sizing.attention_block(L))."""
    B, L, H, K = q_BxLxHxK.shape
    S, G = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2]
    scale = K ** -0.5 if scale is None else scale
    carry = jnp.result_type(q_BxLxHxK.dtype, k_BxSxGxK.dtype)
    operand = jnp.bfloat16 if bf16 else carry
    # Head-major once (copies of L x H x K, small): every product below then has its batch axes leading. The
    # blocks take them in `carry` and cast to `operand` themselves, so that each block's key/value gradient
    # comes back in `carry` and their sum over the blocks is not rounded to bf16 at every term (with bf16
    # slices, XLA:CPU fused that sum, the head-major transposes and rope's backward into one loop fusion
    # that converted back and forth: ~12% of the 10M step's op time, 6 x 28 ms of 1,408 summed).
    q_BxGxLxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K).transpose(0, 2, 1, 3, 4).astype(carry)
    k_BxGxSxK, v_BxGxSxK = (x.transpose(0, 2, 1, 3).astype(carry) for x in (k_BxSxGxK, v_BxSxGxK))
    offset, c = S - L, block or attention_block(L)
    outs = []
    for start in range(0, L, c):
        stop = min(start + c, L)
        first = max(0, offset + start - window + 1) if window else 0
        last = offset + stop  # keys first..last-1 are the only ones rows start..stop-1 can see
        rows, cols = jnp.arange(offset + start, offset + stop), jnp.arange(first, last)
        visible = cols[None, :] <= rows[:, None]
        if window:
            visible &= rows[:, None] - cols[None, :] < window
        visible = visible[None]  # (1, Lc, Sc): broadcast over the batch unless a document mask differs per row
        if mask_BxLxS is not None:
            visible = visible & mask_BxLxS[:, start:stop, first:last]
        outs.append(_block(q_BxGxLxRxK[:, :, start:stop], k_BxGxSxK[:, :, first:last],
                           v_BxGxSxK[:, :, first:last], visible, scale, operand, carry))
    out_BxGxLxRxK = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
    return out_BxGxLxRxK.transpose(0, 2, 1, 3, 4).reshape(B, L, H, K).astype(dtype)


def _scores(q_BxGxLxRxK: jax.Array, k_BxGxSxK: jax.Array, visible_BxLxS: jax.Array, scale: float) -> jax.Array:
    """Masked, scaled logits (B, G, L, R, S) in float32; the R query heads of a group ride with L. The mask's
    batch axis may be 1 (the same mask for every row)."""
    s = lax.dot_general(q_BxGxLxRxK, k_BxGxSxK, (((4,), (3,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)
    return jnp.where(visible_BxLxS[:, None, :, None, :], s * scale, NEG)


def _exps(q: jax.Array, k: jax.Array, visible: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    """exp(s - rowmax(s)) (B, G, L, R, S) and its row sums l (B, G, L, R, 1), both float32: the probabilities
    times l. A hidden key's exp is exactly 0 (its score is float32's lowest)."""
    s_BxGxLxRxS = _scores(q, k, visible, scale)
    e = jnp.exp(s_BxGxLxRxS - jnp.max(s_BxGxLxRxS, axis=-1, keepdims=True))
    return e, jnp.sum(e, axis=-1, keepdims=True)


def _mix(p_BxGxLxRxS: jax.Array, v_BxGxSxK: jax.Array) -> jax.Array:
    """P v -> (B, G, L, R, K) in float32."""
    return lax.dot_general(p_BxGxLxRxS, v_BxGxSxK, (((4,), (2,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)


def _by_rows(a_BxGxLxRxM: jax.Array, b_BxGxLxRxN: jax.Array) -> jax.Array:
    """b^T a summed over the rows (L, R) -> (B, G, N, M) in float32, computed as (a^T b)^T: XLA:CPU's dot then
    reads the big operand b (probabilities or score gradients, N keys wide) as it lies and only the (M = K, N)
    result is transposed; b^T a written directly makes it copy b transposed first. bf16 operands keep the direct
    form: XLA:CPU has no kernel for the transposed one in bf16 x bf16 -> float32 (the step aborts with
    "Unsupported element type for DotThunk"; tests/model/test_matmul.py)."""
    rows = (((2, 3), (2, 3)), ((0, 1), (0, 1)))
    if b_BxGxLxRxN.dtype == jnp.bfloat16:
        return lax.dot_general(b_BxGxLxRxN, a_BxGxLxRxM, rows, preferred_element_type=jnp.float32)
    return lax.dot_general(a_BxGxLxRxM, b_BxGxLxRxN, rows, preferred_element_type=jnp.float32).swapaxes(2, 3)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _block(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float, operand: Dtype,
           carry: Dtype) -> jax.Array:
    """One query block (B, G, Lc, R, K) against its visible keys (B, G, Sc, K) -> (B, G, Lc, R, K) in float32,
    the products' operands in `operand`; q, k, v (and so their gradients) in `carry`."""
    return _block_fwd(q, k, v, visible, scale, operand, carry)[0]


def _block_fwd(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float, operand: Dtype,
               carry: Dtype) -> tuple:
    q, k, v = q.astype(operand), k.astype(operand), v.astype(operand)
    e, l_BxGxLxRx1 = _exps(q, k, visible, scale)
    e = e.astype(v.dtype)
    o = _mix(e, v) / l_BxGxLxRx1  # normalised after the product: an (L, K) division instead of an (L, S) one
    return o, (q, k, v, e, l_BxGxLxRx1, o)  # no mask: e is already 0 where a key is hidden


def _block_bwd(scale: float, operand: Dtype, carry: Dtype, res: tuple, do_BxGxLxRxK: jax.Array) -> tuple:
    """With P = e / l: dV = e^T (dO / l), dP / l = (dO / l) V^T, dS = e (dP / l - rowsum(dO * O) / l),
    dQ = dS K scale, dK = dS^T Q scale: the 1 / l goes on (L, K) and (L, 1) operands, never on an (L, S) one."""
    q, k, v, e, l_BxGxLxRx1, o = res
    inv = 1.0 / l_BxGxLxRx1
    d_BxGxLxRx1 = jnp.sum(do_BxGxLxRxK * o, axis=-1, keepdims=True) * inv
    do = (do_BxGxLxRxK * inv).astype(operand)
    dv = _by_rows(do, e)
    dp = lax.dot_general(do, v, (((4,), (3,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)
    ds = (e.astype(jnp.float32) * (dp - d_BxGxLxRx1) * scale).astype(operand)  # (B, G, Lc, R, Sc)
    dq = lax.dot_general(ds, k, (((4,), (2,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)
    dk = _by_rows(q, ds)
    return dq.astype(carry), dk.astype(carry), dv.astype(carry), None


_block.defvjp(_block_fwd, _block_bwd)
