"""--matmul-precision bfloat16: slm.model.matmul's products and the model and train step built on them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slm.model.matmul import bf16_dot_general, bf16_linear, bf16_linear_rows
from slm.model.sizing import ModelShape
from slm.model.transformer import Transformer, init_params, token_nll

bf16, f32 = jnp.bfloat16, jnp.float32


def _rounded(a):
    """a rounded to bf16 and back: the operand every bf16 product sees."""
    return jnp.asarray(a).astype(bf16).astype(f32)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((3, 5, 16), np.float32)), jnp.asarray(rng.standard_normal((16, 24), np.float32)),
            jnp.asarray(rng.standard_normal((3, 5, 24), np.float32)))


def test_the_three_products_round_their_operands_to_bf16_and_sum_in_f32():
    x, w, g = _data()
    y, vjp = jax.vjp(bf16_linear, x, w)
    dx, dw = vjp(g)
    hi = jax.lax.Precision.HIGHEST
    np.testing.assert_allclose(y, jnp.einsum("bld,df->blf", _rounded(x), _rounded(w), precision=hi), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, jnp.einsum("blf,df->bld", _rounded(g), _rounded(w), precision=hi), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, jnp.einsum("bld,blf->df", _rounded(x), _rounded(g), precision=hi), rtol=1e-5, atol=1e-5)
    # and they differ from the float32 products by bf16's rounding, not more
    assert 0 < float(jnp.max(jnp.abs(y - x @ w))) < 0.1


def test_gradients_keep_the_dtypes_of_their_operands():
    x, w, g = _data()
    _, vjp = jax.vjp(bf16_linear, x.astype(bf16), w)
    dx, dw = vjp(g.astype(bf16))
    assert (dx.dtype, dw.dtype) == (bf16, f32)
    assert bf16_linear(x, w, f32).dtype == f32 and bf16_linear(x.astype(bf16), w).dtype == bf16


def test_rows_form_is_the_product_with_the_transposed_matrix():
    x, w, g = _data(1)
    w_rows = w.T  # (F, D), as a tied head's embedding
    y1, vjp1 = jax.vjp(bf16_linear_rows, x, w_rows)
    y2, vjp2 = jax.vjp(bf16_linear, x, w)
    np.testing.assert_allclose(y1, y2, rtol=1e-6)
    (dx1, dw1), (dx2, dw2) = vjp1(g), vjp2(g)
    np.testing.assert_allclose(dx1, dx2, rtol=1e-6)
    np.testing.assert_allclose(dw1, dw2.T, rtol=1e-6)


def test_dense_adapter_refuses_other_contractions():
    x, w, _ = _data()
    with pytest.raises(ValueError, match="only Dense"):
        bf16_dot_general(x, jnp.ones((5, 4)), (((1,), (0,)), ((), ())))
    assert bf16_dot_general(x, w, (((2,), (0,)), ((), ()))).shape == (3, 5, 24)


# Shapes whose compiled train step must run (XLA:CPU aborted a bf16 x bf16 -> f32 product YNNPACK did not take,
# "Unsupported element type for DotThunk": the tied head's gradient in a first version), with its loss near float32's.
SHAPES = {
    "race": ModelShape(vocab_size=65, n_layers=2, d_model=128, n_heads=4, d_ff=344),
    "untied-gqa-bias": ModelShape(vocab_size=300, n_layers=2, d_model=64, n_heads=4, d_ff=160, n_kv_heads=2,
                                  qkv_bias=True, tie_embeddings=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("mixed,remat", [(False, False), (True, True)])
def test_loss_and_gradients_follow_float32_closely(name, mixed, remat):
    shape = SHAPES[name]
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, shape.vocab_size, (4, 33)).astype(np.int32))
    x, y = ids[:, :-1], ids[:, 1:]
    base = Transformer(shape)
    params = init_params(base, 0, 32)
    fast = Transformer(shape, dtype=bf16 if mixed else f32, remat=remat, matmul="bfloat16")

    def loss(model):
        return jax.jit(jax.value_and_grad(lambda p: token_nll(model, p, x, y).mean()))(params)

    (l32, g32), (l16, g16) = loss(base), loss(fast)
    assert np.isfinite(float(l16)) and abs(float(l16) - float(l32)) < 2e-3
    cos = [float(jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))
           for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(g16))]
    assert min(cos) > 0.99
