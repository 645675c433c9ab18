"""8-bit Adam: Adam's moments stored as uint8 codes plus one float32 scale per block (jax/optax only).

The JAX counterpart of block-wise 8-bit optimizer state (Dettmers et al., "8-bit Optimizers via
Block-wise Quantization", ICLR 2022), as an optax GradientTransformation usable in any optax chain:

    tx = optax.chain(optax.clip_by_global_norm(1.0), scale_by_adam_8bit(), optax.add_decayed_weights(0.1),
                     optax.scale_by_learning_rate(3e-4))      # or simply adamw_8bit(3e-4)

Each step, per parameter: dequantize m and v -> the float32 Adam update (the update uses these
unrounded float32 moments) -> new absmax of each block of the *updated* moments -> round each element to
the nearest code of its map. Design choices, each tested in tests/optim/test_adam8bit.py:
- Blocks are 256 consecutive elements of the flattened parameter, whatever its shape (a last-dim rule
  leaves 128-wide models mostly unquantized); the last block of a leaf may be partial. Codes keep the
  parameter's shape, so they shard like the parameter on a device mesh.
- m uses a signed dynamic map, v an unsigned one (`dynamic_map`): 7 decades with linearly spaced codes
  inside each decade and more codes in the upper decades, where most of a block's values sit. The
  v map has no zero: a v rounded to 0 would turn the next update into m / eps.
- Leaves under `min_8bit_size` elements (norm scales) keep float32 moments: they cost nothing.
- Nearest-code rounding reads the float's exponent and top mantissa bits as a bucket number: a table
  gives the codes below the bucket and one compare with the bucket's midpoint finishes it (two small
  gathers per element, no jnp.searchsorted, which breaks under explicit sharding).
- Non-finite gradients (`nonfinite`): "skip" (default) leaves the whole state untouched and returns a
  zero update for a step with any NaN/Inf gradient, counting it in `state.skipped`; "zero" treats
  non-finite elements as 0 and updates the rest. Either way no NaN ever reaches a block's absmax,
  which would silently wreck all 256 of its elements. (Raising is the caller's job outside jit: the
  trainer wraps its whole chain in optax.apply_if_finite and stops on the step's `finite` flag.)

State per quantized parameter: 1 + 1 bytes of codes per element + 2 x 4 bytes per 256-element block
= 2.03 bytes/param, against 8 for float32 Adam.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

BLOCK = 256
# Blocks of a leaf updated at a time on a TPU (1M elements; the trainer's choice, slm.train.builder). Whole, the
# update of one leaf held ~48 bytes an element of temporaries on a v5e (libtpu materializes the code maps'
# gathers): 7.1 GiB for Qwen3-0.6B's embedding alone; in chunks 6 (in_chunks). XLA:GPU and XLA:CPU hold 12 and 8
# bytes an element for the leaf alone, 0.1 in chunks, but within the train step the whole leaf's update is
# fused into the weights' and the chunks' is not (every leaf's update materialized): H100, Qwen3-0.6B's step
# 5,808 -> 7,745 MB in chunks. So the default is the whole leaf.
CHUNK_BLOCKS = 4096


def dynamic_map(signed: bool, zero_free: bool = False) -> np.ndarray:
    """256 sorted float32 codes in [-1, 1] (signed) or [0, 1] (unsigned), dense near 1, spanning ~7 decades.

    Decade i (values 10^(i-7)..10^(i-6)) gets 2^i codes per sign when signed and 2^(i+1) when not,
    each the midpoint of an equal split of [0.1, 1] x 10^(i-6); the two remaining codes are 0 and 1.
    With `zero_free` the 0 becomes 1e-7, the bottom of the range.
    """
    codes = [0.0, 1.0]
    for i in range(7):
        n = 2**i if signed else 2 ** (i + 1)
        edges = np.linspace(0.1, 1.0, n + 1)
        mids = 10.0 ** (i - 6) * (edges[:-1] + edges[1:]) / 2
        codes += list(mids) + (list(-mids) if signed else [])
    if zero_free:
        codes[0] = 1e-7
    out = np.sort(np.array(codes, np.float32))
    assert out.shape == (256,) and len(np.unique(out)) == 256
    return out


def linear_map(signed: bool) -> np.ndarray:
    """256 evenly spaced codes over [-1, 1] or [0, 1]: the map the paper saw diverge (negative control)."""
    return np.linspace(-1.0 if signed else 0.0, 1.0, 256, dtype=np.float32)


class QuantizedArray(NamedTuple):
    codes: jax.Array   # uint8, the parameter's shape
    scales: jax.Array  # float32 (n_blocks,): absmax of each block of 256 flattened elements


def _blocks(x: jax.Array) -> jax.Array:
    """Flatten and zero-pad to (n_blocks, BLOCK)."""
    flat = x.reshape(-1)
    pad = -flat.size % BLOCK
    if pad:
        flat = jnp.pad(flat, (0, pad))
    return flat.reshape(-1, BLOCK)


def _unblocks(x_NxB: jax.Array, shape: tuple) -> jax.Array:
    size = int(np.prod(shape))
    return x_NxB.reshape(-1)[:size].reshape(shape)


_SUB_BITS = 8         # buckets per binade = 2^8: finer than any two adjacent midpoints of the maps here
_MIN_EXP = -30        # |x| < 2^-30 of the block max shares one bucket (all maps' codes are far above it)
_K0 = (127 + _MIN_EXP) << _SUB_BITS
_J = -_MIN_EXP << _SUB_BITS  # bucket of 1.0


def _bucket_table(qmap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the bucket of every float in [-1, 1]: the number of midpoints below it (see _nearest_code).

    Buckets are the float32 bit pattern of |x| shifted right by 23 - _SUB_BITS (exponent plus the top
    mantissa bits), clamped below 2^_MIN_EXP, mirrored for negative x. Each holds at most one midpoint,
    so the nearest code is table[bucket] + (x > that midpoint): two gathers instead of a binary search.
    """
    mid = ((qmap[1:] + qmap[:-1]) / 2).astype(np.float32)
    edge = (np.arange(_J + 2, dtype=np.int64) + _K0) << (23 - _SUB_BITS)
    edge = edge.astype(np.uint32).view(np.float32).astype(np.float64)  # edge[j] = lower end of bucket j
    edge[0] = 0.0
    lo_pos = np.searchsorted(mid, edge[:-1], side="left")            # bucket j: [edge[j], edge[j+1])
    lo_neg = np.searchsorted(mid, -edge[1:], side="right")           # bucket -j: (-edge[j+1], -edge[j]]
    lo_neg[0] = lo_pos[0] = np.searchsorted(mid, -edge[1], side="right")  # bucket 0: (-edge[1], edge[1])
    hi_pos = np.searchsorted(mid, edge[1:], side="left")
    assert np.all(hi_pos - lo_pos <= 1) and np.all(np.searchsorted(mid, -edge[:-1], side="right")[1:] - lo_neg[1:] <= 1)
    table = np.concatenate([lo_neg[::-1][:-1], lo_pos]).astype(np.int32)  # index = signed bucket + _J
    return table, np.append(mid, np.float32(np.inf))


def _nearest_code(x: jax.Array, qmap: np.ndarray) -> jax.Array:
    """Index of the code nearest to each element of x (values in [-1, 1]), as uint8; ties go down."""
    table, mid = _bucket_table(qmap)
    bits = jax.lax.bitcast_convert_type(jnp.abs(x), jnp.int32)
    j = jnp.clip((bits >> (23 - _SUB_BITS)) - _K0, 0, _J)
    lo = jnp.asarray(table)[jnp.where(x < 0, -j, j) + _J]
    return (lo + (x > jnp.asarray(mid)[lo])).astype(jnp.uint8)


def quantize_blocks(x_NxB: jax.Array, qmap: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """float32 (n_blocks, BLOCK) -> (uint8 codes of the same shape, float32 absmax per block)."""
    absmax_N = jnp.max(jnp.abs(x_NxB), axis=1)
    safe_N = jnp.where(absmax_N > 0, absmax_N, 1.0)
    return _nearest_code(x_NxB / safe_N[:, None], qmap), absmax_N


def dequantize_blocks(codes_NxB: jax.Array, scales_N: jax.Array, qmap: np.ndarray) -> jax.Array:
    return jnp.asarray(qmap)[codes_NxB.astype(jnp.int32)] * scales_N[:, None]


def quantize(x: jax.Array, qmap: np.ndarray) -> QuantizedArray:
    codes, scales = quantize_blocks(_blocks(x.astype(jnp.float32)), qmap)
    return QuantizedArray(_unblocks(codes, x.shape), scales)


def dequantize(q: QuantizedArray, qmap: np.ndarray) -> jax.Array:
    return _unblocks(dequantize_blocks(_blocks(q.codes), q.scales, qmap), q.codes.shape)


def in_chunks(fn: Callable[..., tuple], g_NxB: jax.Array, state: tuple, chunk: int) -> tuple:
    """fn(first_block, g blocks, *state blocks) -> (update, *new state), applied `chunk` blocks at a time: (the
    whole update, *the whole new state). A fori_loop's carry is one buffer from start to end, so each chunk's
    results are written where the old state lay and the temporaries are one chunk's; the blocks past the last
    whole chunk go after the loop. Elementwise per block: one call on the whole's numbers to XLA's rounding (the
    two are fused apart; tests/optim/test_adam8bit.py)."""
    n = g_NxB.shape[0]
    if n <= chunk:
        return fn(0, g_NxB, *state)

    def body(i: jax.Array, carry: tuple) -> tuple:
        first = i * chunk
        part = fn(first, *(jax.lax.dynamic_slice_in_dim(x, first, chunk) for x in (g_NxB, *carry[1:])))
        return tuple(jax.lax.dynamic_update_slice_in_dim(x, p, first, 0) for x, p in zip(carry, part))

    carry = jax.lax.fori_loop(0, n // chunk, body, (jnp.zeros_like(g_NxB), *state))
    first = n - n % chunk
    if first < n:
        part = fn(first, *(x[first:] for x in (g_NxB, *carry[1:])))
        carry = tuple(jax.lax.dynamic_update_slice_in_dim(x, p, first, 0) for x, p in zip(carry, part))
    return carry


class ScaleByAdam8bitState(NamedTuple):
    count: jax.Array    # int32: Adam steps taken (bias correction)
    skipped: jax.Array  # int32: steps skipped for a non-finite gradient ("skip" policy)
    mu: Any             # per parameter: QuantizedArray, or a float32 array for small/kept leaves
    nu: Any


def scale_by_adam_8bit(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    min_8bit_size: int = 4096,
    keep_fp32: Callable[[tuple, jax.Array], bool] | None = None,
    nonfinite: str = "skip",
    m_map: np.ndarray | None = None,
    v_map: np.ndarray | None = None,
    chunk_blocks: int | None = None,
) -> optax.GradientTransformation:
    """optax.scale_by_adam with m and v stored block-wise in 8 bits (see the module docstring).

    keep_fp32(path, param) -> True keeps that leaf's moments in float32 (e.g. a "stable embedding");
    m_map / v_map override the code maps (tests use linear_map as a negative control). `chunk_blocks`: a
    quantized leaf is updated that many blocks at a time (in_chunks; None: whole).
    """
    if nonfinite not in ("skip", "zero"):
        raise ValueError(f"nonfinite={nonfinite!r}: use 'skip' or 'zero'")
    m_map = dynamic_map(signed=True) if m_map is None else m_map
    v_map = dynamic_map(signed=False, zero_free=True) if v_map is None else v_map

    def quantized(path: tuple, p: jax.Array) -> bool:
        return p.size >= min_8bit_size and not (keep_fp32 and keep_fp32(path, p))

    def init(params: Any) -> ScaleByAdam8bitState:
        def zeros(path, p):
            if quantized(path, p):
                return QuantizedArray(jnp.zeros(p.shape, jnp.uint8), jnp.zeros((-(-p.size // BLOCK),), jnp.float32))
            return jnp.zeros(p.shape, jnp.float32)

        mu = jax.tree_util.tree_map_with_path(zeros, params)
        nu = jax.tree_util.tree_map_with_path(zeros, params)
        return ScaleByAdam8bitState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), mu, nu)

    def update(updates: Any, state: ScaleByAdam8bitState, params: Any = None):
        del params
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(updates)]))
        count = optax.safe_increment(state.count) if nonfinite == "zero" else jnp.where(finite, state.count + 1, state.count)
        t = jnp.maximum(count, 1).astype(jnp.float32)
        c1, c2 = 1 - b1**t, 1 - b2**t

        def moments(first, g_NxB, mc, ms, vc, vs, size):
            """Adam on blocks first.. of a quantized leaf of `size` elements: (update, m codes, m scales, v ...)."""
            m_NxB = b1 * dequantize_blocks(mc, ms, m_map) + (1 - b1) * g_NxB
            v_NxB = b2 * dequantize_blocks(vc, vs, v_map) + (1 - b2) * g_NxB * g_NxB
            if size % BLOCK:  # padded lanes of a partial last block: code 0 is not 0.0, keep them out of absmax
                valid = (first * BLOCK + jnp.arange(m_NxB.size).reshape(m_NxB.shape)) < size
                m_NxB, v_NxB = jnp.where(valid, m_NxB, 0.0), jnp.where(valid, v_NxB, 0.0)
            u_NxB = (m_NxB / c1) / (jnp.sqrt(v_NxB / c2) + eps)
            new = (u_NxB, *quantize_blocks(m_NxB, m_map), *quantize_blocks(v_NxB, v_map))
            if nonfinite == "skip":  # keep the old state; the caller gets a zero update
                new = (jnp.where(finite, new[0], 0.0),
                       *(jnp.where(finite, a, b) for a, b in zip(new[1:], (mc, ms, vc, vs))))
            return new

        def leaf(g, m, v):
            g = g.astype(jnp.float32)
            if nonfinite == "zero":
                g = jnp.where(jnp.isfinite(g), g, 0.0)
            if isinstance(m, QuantizedArray):
                state_NxB = (_blocks(m.codes), m.scales, _blocks(v.codes), v.scales)
                u, mc, ms, vc, vs = in_chunks(lambda first, *x: moments(first, *x, g.size), _blocks(g), state_NxB,
                                              chunk_blocks or g.size)
                return (_unblocks(u, g.shape), QuantizedArray(_unblocks(mc, g.shape), ms),
                        QuantizedArray(_unblocks(vc, g.shape), vs))
            new_m = b1 * m + (1 - b1) * g
            new_v = b2 * v + (1 - b2) * g * g
            u = (new_m / c1) / (jnp.sqrt(new_v / c2) + eps)
            if nonfinite == "skip":  # keep the old state; the caller gets a zero update
                new_m, new_v, u = jnp.where(finite, new_m, m), jnp.where(finite, new_v, v), jnp.where(finite, u, 0.0)
            return u, new_m, new_v

        out = jax.tree.map(leaf, updates, state.mu, state.nu)
        treedef = jax.tree.structure(updates)
        u, mu, nu = (treedef.unflatten(x) for x in zip(*treedef.flatten_up_to(out)))
        u = jax.tree.map(lambda x, g: x.astype(g.dtype), u, updates)
        skipped = state.skipped + (1 - finite.astype(jnp.int32)) if nonfinite == "skip" else state.skipped
        return u, ScaleByAdam8bitState(count, skipped, mu, nu)

    return optax.GradientTransformation(init, update)


def adamw_8bit(
    learning_rate: float | optax.Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Any = None,
    **kwargs: Any,
) -> optax.GradientTransformation:
    """Drop-in for optax.adamw with 8-bit moments (kwargs go to scale_by_adam_8bit)."""
    return optax.chain(
        scale_by_adam_8bit(b1, b2, eps, **kwargs),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


def state_bytes(tree: Any) -> int:
    """Total bytes of every array in a pytree (e.g. an optimizer state); works on jax.eval_shape output too."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def quantized_fraction(state: Any, params: Any) -> float:
    """Fraction of the parameters whose moments are stored in 8 bits."""
    n_q = sum(q.codes.size for q in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QuantizedArray))
              if isinstance(q, QuantizedArray))
    return n_q / 2 / sum(p.size for p in jax.tree.leaves(params))  # codes for both m and v
