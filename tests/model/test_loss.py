"""--loss-chunk: the loss over vocabulary chunks (slm.model.loss) is the full logits' loss, value and gradients,
and holds a chunk's logits instead of all of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slm.model.loss import chunked_token_nll, head_logits
from slm.model.sizing import ModelShape, default_loss_chunk, logit_columns
from slm.model.transformer import Transformer, init_params, token_nll


def full_nll(x_BxLxD, head_VxD, targets_BxL, dtype=jnp.float32):
    logits = jnp.einsum("bld,vd->blv", x_BxLxD.astype(dtype), head_VxD.astype(dtype), preferred_element_type=jnp.float32)
    target = jnp.take_along_axis(logits, jnp.maximum(targets_BxL, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(targets_BxL >= 0, jax.nn.logsumexp(logits, axis=-1) - target, 0.0)


def problem(B=2, L=7, D=16, V=37, seed=0):
    kx, kh, kt, kw = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(kx, (B, L, D))
    head = 0.5 * jax.random.normal(kh, (V, D))
    targets = jax.random.randint(kt, (B, L), -1, V)  # -1: not scored (instruction data's prompt tokens)
    return x, head, targets, jax.random.normal(kw, (B, L))


@pytest.mark.parametrize("chunk", [1, 5, 8, 36, 37, 64])  # 5 and 8 do not divide 37: the last chunk overlaps
def test_chunked_loss_and_gradients_equal_the_full_logits(chunk):
    x, head, targets, w = problem()
    ours = lambda x, h: jnp.sum(chunked_token_nll(x, h, targets, chunk) * w)  # noqa: E731
    ref = lambda x, h: jnp.sum(full_nll(x, h, targets) * w)  # noqa: E731
    np.testing.assert_allclose(chunked_token_nll(x, head, targets, chunk), full_nll(x, head, targets), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(chunked_token_nll(x, head, targets, chunk))[np.asarray(targets) < 0] == 0)
    for g, r in zip(jax.grad(ours, (0, 1))(x, head), jax.grad(ref, (0, 1))(x, head)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_bf16_operands_match_the_full_logits_in_bf16():
    x, head, targets, w = problem(V=300, D=32)
    ours = jax.grad(lambda x: jnp.sum(chunked_token_nll(x, head, targets, 64, jnp.bfloat16) * w))(x)
    ref = jax.grad(lambda x: jnp.sum(full_nll(x, head, targets, jnp.bfloat16) * w))(x)
    np.testing.assert_allclose(chunked_token_nll(x, head, targets, 64, jnp.bfloat16),
                               full_nll(x, head, targets, jnp.bfloat16), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(ours, ref, rtol=2e-2, atol=1e-2)  # the reference's dx is rounded to bf16


@pytest.mark.parametrize("head_dtype", [jnp.bfloat16, jnp.float16])
def test_a_16_bit_head_read_a_chunk_at_a_time_gives_its_own_values(head_dtype):
    """A LoRA base's head in bf16 / fp16, read a chunk at a time (slm.model.loss.rows_in_loop): same loss and dx as
    the whole logits of the same 16-bit head."""
    x, head, targets, w = problem(V=300, D=32)
    h16 = head.astype(head_dtype)
    ours = jax.grad(lambda x: jnp.sum(chunked_token_nll(x, h16, targets, 64) * w))(x)
    ref = jax.grad(lambda x: jnp.sum(full_nll(x, h16.astype(jnp.float32), targets) * w))(x)
    np.testing.assert_allclose(chunked_token_nll(x, h16, targets, 64), full_nll(x, h16.astype(jnp.float32), targets),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def test_a_chunk_below_one_is_refused():
    x, head, targets, _ = problem()
    with pytest.raises(ValueError, match="chunk 0 must be at least 1"):
        chunked_token_nll(x, head, targets, 0)


def temp_bytes(f, *args) -> int:
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("head_dtype", [jnp.float32, jnp.bfloat16])
def test_the_backward_pass_holds_a_chunk_of_logits_not_all(head_dtype):
    B, L, D, V = 1, 256, 64, 32768  # the full logits: 32 MB in float32, their softmax and gradient as much again
    x = jax.ShapeDtypeStruct((B, L, D), jnp.float32)
    head = jax.ShapeDtypeStruct((V, D), head_dtype)
    targets = jax.ShapeDtypeStruct((B, L), jnp.int32)
    full = temp_bytes(jax.grad(lambda x, h, t: full_nll(x, h, t).sum(), (0, 1)), x, head, targets)
    ours = temp_bytes(jax.grad(lambda x, h, t: chunked_token_nll(x, h, t, 1024).sum(), (0, 1)), x, head, targets)
    assert full > B * L * V * 4
    assert ours < full / 4, (ours / 2**20, full / 2**20)


def test_a_16_bit_head_is_never_copied_whole():
    """A frozen bf16 head (a LoRA base's) read in chunks inside the loss's loops: XLA:CPU's float32 cast of a 16-bit
    slice must not be hoisted out of the loop as a copy of the whole head (nor a 16-bit one)."""
    B, L, D, V = 1, 64, 128, 65536  # the head: 16 MB in bf16, 32 MB as float32; a chunk's logits 0.25 MB
    x, head = jax.ShapeDtypeStruct((B, L, D), jnp.float32), jax.ShapeDtypeStruct((V, D), jnp.bfloat16)
    targets = jax.ShapeDtypeStruct((B, L), jnp.int32)
    ours = temp_bytes(jax.value_and_grad(lambda x, h, t: chunked_token_nll(x, h, t, 1024).sum()), x, head, targets)
    assert ours < V * D * 2 / 4, ours / 2**20


@pytest.mark.parametrize("chunk", [7, 64, 300, 512])  # 7 does not divide 300: the last chunk overlaps
def test_head_logits_by_chunks_are_the_whole_products(chunk):
    x, head, _, _ = problem(V=300, D=32)
    h16 = head.astype(jnp.bfloat16)
    want = jnp.einsum("bld,vd->blv", x, h16.astype(jnp.float32), preferred_element_type=jnp.float32)
    np.testing.assert_allclose(jax.jit(head_logits, static_argnums=2)(x, h16, chunk), want, rtol=1e-6, atol=1e-6)


def test_a_frozen_head_gets_no_gradient_computed():
    """LoRA's head is the frozen base's: the backward pass then carries no (V, D) accumulator."""
    B, L, D, V = 1, 256, 64, 32768
    x, head = jax.ShapeDtypeStruct((B, L, D), jnp.float32), jax.ShapeDtypeStruct((V, D), jnp.float32)
    targets = jax.ShapeDtypeStruct((B, L), jnp.int32)
    f = lambda x, h, t: chunked_token_nll(x, h, t, 1024).sum()  # noqa: E731
    both, x_only = temp_bytes(jax.grad(f, (0, 1)), x, head, targets), temp_bytes(jax.grad(f, 0), x, head, targets)
    assert x_only < both and x_only < V * D * 4, (x_only / 2**20, both / 2**20)


@pytest.mark.slow
@pytest.mark.parametrize("matmul,dtype,tied", [("float32", jnp.float32, False), ("float32", jnp.float32, True),
                                               ("bfloat16", jnp.float32, True), ("float32", jnp.bfloat16, True)])
def test_the_model_loss_is_the_same_with_chunks(matmul, dtype, tied):
    """Tied: the head is the embedding, whose gradient adds the loss's rows to the lookup's."""
    shape = ModelShape(n_layers=2, d_model=32, n_heads=2, d_ff=64, vocab_size=300, tie_embeddings=tied)
    whole, chunked = (Transformer(shape, dtype=dtype, matmul=matmul, loss_chunk=c) for c in (0, 64))
    params = init_params(whole, 0, 16)
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 17), 0, 300)
    x, y = ids[:, :-1], ids[:, 1:]
    tol = 1e-5 if (matmul, dtype) == ("float32", jnp.float32) else 1e-2
    np.testing.assert_allclose(token_nll(chunked, params, x, y), token_nll(whole, params, x, y), rtol=tol, atol=tol)
    g0, g1 = (jax.grad(lambda p, m=m: token_nll(m, p, x, y).mean())(params) for m in (whole, chunked))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=10 * tol, atol=tol)


def test_default_chunk_and_the_columns_held():
    assert default_loss_chunk(2048, "cpu", "bfloat16") == 512 and default_loss_chunk(512, "cpu", "bfloat16") == 0
    assert default_loss_chunk(8192, "cpu", "float32") == 0 and default_loss_chunk(32_000, "cpu", "float32") == 512
    assert default_loss_chunk(8192, "gpu") == 0 and default_loss_chunk(151_936, "gpu") == 8192
    assert logit_columns(151_936, None) == 512 and logit_columns(151_936, 0) == 151_936
    assert logit_columns(4096, None) == 4096 and logit_columns(32_000, None, "gpu") == 8192
    assert logit_columns(1024, 4096) == 1024 and logit_columns(32_000, 2048) == 2048
