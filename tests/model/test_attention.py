"""Blocked causal attention (slm.model.attention) against the textbook formula written out in numpy and, for
the gradients, jax's own autodiff of that formula (the module's backward is written by hand)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slm.model.attention import causal_attend
from slm.model.sizing import attention_block, visible_keys


def _inputs(B, L, S, H, G, K, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(B, L, H, K)).astype(np.float32), rng.normal(size=(B, S, G, K)).astype(np.float32),
            rng.normal(size=(B, S, G, K)).astype(np.float32))


def _visible(B, L, S, window=0, mask=None):
    rows, cols = np.arange(S - L, S)[:, None], np.arange(S)[None, :]
    seen = cols <= rows
    if window:
        seen &= rows - cols < window
    seen = np.broadcast_to(seen, (B, L, S))
    return seen & mask if mask is not None else seen


def _numpy_attention(q, k, v, seen, scale):
    """Query head h reads key/value head h // (H / G); masked scores are dropped before the softmax."""
    B, L, H, K = q.shape
    rep = H // k.shape[2]
    k, v = np.repeat(k, rep, axis=2).astype(np.float64), np.repeat(v, rep, axis=2).astype(np.float64)
    s = np.einsum("blhk,bshk->bhls", q.astype(np.float64), k) * scale
    s = np.where(seen[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhls,bshk->blhk", p, v)


def _jnp_attention(q, k, v, seen, scale):
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.where(seen[:, None], jnp.einsum("blhk,bshk->bhls", q, k) * scale, -jnp.inf)
    return jnp.einsum("bhls,bshk->blhk", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("B,L,S,H,G,K,block,window", [
    (2, 16, 16, 4, 4, 8, None, 0),  # one block (short sequence)
    (2, 100, 100, 6, 2, 8, 32, 0),  # grouped heads, a last block shorter than the others
    (1, 64, 64, 4, 1, 16, 16, 24),  # one kv head, a sliding window narrower than the prefix
    (2, 12, 40, 4, 2, 8, 5, 0),  # queries at the end of longer keys (a prefill after a cache)
])
def test_values_and_gradients_equal_the_textbook_formula(B, L, S, H, G, K, block, window):
    q, k, v = _inputs(B, L, S, H, G, K)
    seen, scale = _visible(B, L, S, window), 0.3
    out = causal_attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.float32, scale, window=window,
                        block=block)
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, k, v, seen, scale), rtol=2e-5, atol=2e-5)
    w = np.random.default_rng(1).normal(size=(B, L, H, K)).astype(np.float32)
    ours = jax.grad(lambda *a: jnp.sum(causal_attend(*a, jnp.float32, scale, window=window, block=block) * w),
                    argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(lambda *a: jnp.sum(_jnp_attention(*a, seen, scale) * w), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4, err_msg=name)


def test_a_document_mask_hides_other_documents_in_every_block():
    B, L, H, G, K = 2, 48, 4, 2, 8
    q, k, v = _inputs(B, L, L, H, G, K, seed=3)
    doc = np.cumsum(np.random.default_rng(4).random((B, L)) < 0.1, axis=1)
    same = doc[:, :, None] == doc[:, None, :]
    seen = _visible(B, L, L, mask=same)
    out = causal_attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.float32, mask_BxLxS=jnp.asarray(same),
                        block=16)
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, k, v, seen, K ** -0.5), rtol=2e-5, atol=2e-5)


def test_bf16_products_stay_within_bf16_rounding():
    """bf16 operands (8 mantissa bits, relative rounding 2^-9) with float32 sums: values and gradients within
    about 1% of the float64 formula, and the output in the caller's dtype."""
    B, L, H, G, K = 2, 64, 6, 3, 16
    q, k, v = _inputs(B, L, L, H, G, K, seed=5)
    out = causal_attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.float32, bf16=True, block=16)
    ref = _numpy_attention(q, k, v, _visible(B, L, L), K ** -0.5)
    assert out.dtype == jnp.float32
    assert np.max(np.abs(np.asarray(out) - ref)) / np.max(np.abs(ref)) < 0.01
    g = jax.grad(lambda a: jnp.sum(causal_attend(a, k, v, jnp.float32, bf16=True, block=16) ** 2))(q)
    g_ref = jax.grad(lambda a: jnp.sum(_jnp_attention(a, k, v, _visible(B, L, L), K ** -0.5) ** 2))(q)
    assert float(jnp.max(jnp.abs(g - g_ref)) / jnp.max(jnp.abs(g_ref))) < 0.02


def test_bf16_key_and_value_gradients_do_not_lose_precision_with_more_blocks():
    """Every query block adds to the keys' and values' gradients; with bf16 products that sum still runs in
    float32, so splitting a sequence into 32 blocks leaves the gradients as close to the float32 formula as one
    block does (a sum rounded to bf16 at each block drifted 1.3x further)."""
    B, L, H, G, K = 2, 128, 4, 2, 16
    q, k, v = _inputs(B, L, L, H, G, K, seed=7)
    w = np.random.default_rng(3).normal(size=(B, L, H, K)).astype(np.float32)
    ref = jax.grad(lambda a, b: jnp.sum(_jnp_attention(q, a, b, _visible(B, L, L), K ** -0.5) * w), (0, 1))(k, v)

    def errors(block):
        got = jax.jit(jax.grad(lambda a, b: jnp.sum(causal_attend(jnp.asarray(q), a, b, jnp.float32, bf16=True,
                                                                  block=block) * w), (0, 1)))(k, v)
        assert all(g.dtype == jnp.float32 for g in got)
        return [float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) for g, r in zip(got, ref)]

    for many, one in zip(errors(4), errors(L)):
        assert many < 1.1 * one


def test_block_size_splits_long_sequences_and_keeps_short_ones_whole():
    assert attention_block(48) == 48 and attention_block(64) == 64  # one block: nothing worth skipping
    assert attention_block(256) == 64 and attention_block(1024) == 256  # four blocks
    assert attention_block(8192) == 512  # at most 512 rows a block
    assert attention_block(100) == 64  # two blocks, the last shorter


def test_visible_keys_counts_the_scores_the_blocks_compute():
    """Counted by building each block's (rows, keys) rectangle, against the formula's average."""
    for L in (48, 100, 256, 1000, 2048):
        c, cells = attention_block(L), 0
        for start in range(0, L, c):
            rows = np.arange(start, min(start + c, L))
            cells += rows.size * (rows[-1] + 1)
        assert visible_keys(L) * L == pytest.approx(cells, rel=1e-12)
    assert visible_keys(256) == 256 * 5 / 8  # four equal blocks: (n + 1) / 2n of the square
