import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slm.model.sizing import ModelShape, choose_shape, count_params, default_vocab_size
import slm.model.transformer as transformer
from slm.model.transformer import Transformer, drop, gated_product, hashed_bits, init_params, keep_mask, token_nll

SMALL = ModelShape(vocab_size=97, n_layers=2, d_model=64, n_heads=2, d_ff=160)


def _batch(shape: ModelShape, B=2, L=16, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, shape.vocab_size, (B, L + 1)).astype(np.int32)
    return jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:])


@pytest.mark.parametrize("target", [100_000, 1_000_000, 10_000_000, 100_000_000])
def test_param_count_equals_initialised_model(target):
    shape = choose_shape(target, default_vocab_size(target))
    model = Transformer(shape)
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(abstract)) == count_params(shape)


def test_initial_loss_is_near_uniform():
    model = Transformer(SMALL)
    params = init_params(model, 0, 16)
    x, y = _batch(SMALL)
    loss = float(token_nll(model, params, x, y).mean())
    assert abs(loss - math.log(SMALL.vocab_size)) < 0.05


def test_causal_no_information_from_later_tokens():
    model = Transformer(SMALL)
    params = init_params(model, 0, 16)
    x, _ = _batch(SMALL)
    base = model.apply({"params": params}, x)
    for t in (0, 5, 15):
        changed = x.at[:, t:].set((x[:, t:] + 7) % SMALL.vocab_size)
        out = model.apply({"params": params}, changed)
        np.testing.assert_array_equal(np.asarray(out[:, :t]), np.asarray(base[:, :t]))
        assert not np.allclose(np.asarray(out[:, t]), np.asarray(base[:, t]))


def test_causal_no_gradient_from_later_positions():
    """d loss(positions < t) / d (block-0 input at positions >= t) is exactly zero, and nonzero before t."""
    model = Transformer(SMALL)
    params = init_params(model, 0, 16)
    x, y = _batch(SMALL)
    t = 9

    def early_loss(delta_BxLxD):
        def add_delta(next_fun, args, kwargs, context):
            if context.module.name == "block_0" and context.method_name == "__call__":
                args = (args[0] + delta_BxLxD.astype(args[0].dtype),) + args[1:]
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(add_delta):
            return token_nll(model, params, x, y)[:, :t].sum()

    g = np.asarray(jax.grad(early_loss)(jnp.zeros((2, 16, SMALL.d_model))))
    assert np.all(g[:, t:] == 0)
    assert np.all(np.abs(g[:, :t]).sum(-1) > 0)


def test_remat_gives_same_loss_and_gradients():
    x, y = _batch(SMALL)
    plain, remat = Transformer(SMALL), Transformer(SMALL, remat=True)
    params = init_params(plain, 0, 16)

    def loss(m):
        return lambda p: token_nll(m, p, x, y).mean()

    l1, g1 = jax.value_and_grad(loss(plain))(params)
    l2, g2 = jax.value_and_grad(loss(remat))(params)
    assert float(l1) == pytest.approx(float(l2), abs=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


def test_mixed_precision_keeps_fp32_params_and_logits_and_close_loss():
    x, y = _batch(SMALL)
    f32, bf16 = Transformer(SMALL), Transformer(SMALL, dtype=jnp.bfloat16)
    params = init_params(f32, 0, 16)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(init_params(bf16, 0, 16)))
    assert bf16.apply({"params": params}, x).dtype == jnp.float32
    l32 = float(token_nll(f32, params, x, y).mean())
    l16 = float(token_nll(bf16, params, x, y).mean())
    assert l16 == pytest.approx(l32, abs=2e-2)
    g = jax.grad(lambda p: token_nll(bf16, p, x, y).mean())(params)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(g))


def test_document_masking_keeps_packed_documents_apart():
    """With doc_start, a document packed after another gives exactly the logits it gives alone (positions
    restart at its separator, and it cannot attend to its neighbour); tokens before the row's first
    separator are a document of their own. Without it, the neighbour does change them."""
    sep = 0
    model = Transformer(SMALL, doc_start=sep)
    plain = Transformer(SMALL)
    params = init_params(plain, 0, 32)
    rng = np.random.default_rng(0)
    head, d1, d2 = (rng.integers(1, SMALL.vocab_size, n).tolist() for n in (5, 9, 11))
    row = jnp.asarray([head + [sep] + d1 + [sep] + d2], jnp.int32)
    packed = np.asarray(model.apply({"params": params}, row))[0]
    alone2 = np.asarray(plain.apply({"params": params}, jnp.asarray([[sep] + d2], jnp.int32)))[0]
    alone1 = np.asarray(plain.apply({"params": params}, jnp.asarray([[sep] + d1], jnp.int32)))[0]
    alone_head = np.asarray(plain.apply({"params": params}, jnp.asarray([head], jnp.int32)))[0]
    np.testing.assert_allclose(packed[len(head) + len(d1) + 1:], alone2, atol=1e-5)
    np.testing.assert_allclose(packed[len(head):len(head) + len(d1) + 1], alone1, atol=1e-5)
    np.testing.assert_allclose(packed[:len(head)], alone_head, atol=1e-5)
    unmasked = np.asarray(plain.apply({"params": params}, row))[0]
    assert np.abs(unmasked[len(head) + len(d1) + 1:] - alone2).max() > 1e-2  # the test can fail


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_gpu_fused_attention_computes_the_same_causal_attention(kv_heads):
    """On GPUs in bf16 the model calls jax.nn.dot_product_attention(is_causal=True) (cuDNN) instead of `attend`;
    its XLA implementation, here on CPU, must equal `attend` under the causal mask (scale, GQA head order)."""
    from slm.model.transformer import attend, fused_attention_fits

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 16, 4, 8), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((2, 16, kv_heads, 8), np.float32)) for _ in range(2))
    ours = attend(q, k, v, jnp.tril(jnp.ones((16, 16), dtype=bool)), jnp.float32)
    fused = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(ours, fused, rtol=1e-5, atol=1e-5)
    assert not fused_attention_fits(jnp.float32)
    assert fused_attention_fits(jnp.bfloat16) == (jax.default_backend() == "gpu")


def test_dropout_only_in_training_and_repeatable_per_rng():
    """--dropout: off without a dropout rng (eval, sampling: the plain model's loss), on with one, and the same
    mask for the same rng (a resumed run draws (seed, micro_step) again)."""
    x, y = _batch(SMALL)
    plain, dropped = Transformer(SMALL), Transformer(SMALL, dropout=0.3)
    params = init_params(plain, 0, 16)
    base = token_nll(plain, params, x, y)
    np.testing.assert_array_equal(token_nll(dropped, params, x, y), base)
    a, b = (token_nll(dropped, params, x, y, jax.random.PRNGKey(k)) for k in (1, 2))
    assert not np.allclose(a, base) and not np.allclose(a, b)
    np.testing.assert_array_equal(a, token_nll(dropped, params, x, y, jax.random.PRNGKey(1)))


def test_dropout_masks_keep_the_rate_and_the_mean_and_differ_per_key():
    """The hashed masks (slm.model.transformer.keep_mask): over 2^20 elements the kept fraction is 1 - rate
    to 4 binomial deviations, drop() keeps the mean (in bf16 too), a key repeats its mask, and two keys'
    masks (two sites of a step, or two steps) are uncorrelated."""
    n, rate = 2**20, 0.1
    cut = round(rate * 2**32)
    a, b = (np.asarray(keep_mask(jax.random.PRNGKey(k), (1024, 1024), cut)).ravel() for k in (1, 2))
    sd = math.sqrt(rate * (1 - rate) / n)
    assert abs(a.mean() - (1 - rate)) < 4 * sd and abs(b.mean() - (1 - rate)) < 4 * sd
    np.testing.assert_array_equal(a, np.asarray(keep_mask(jax.random.PRNGKey(1), (1024, 1024), cut)).ravel())
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.01
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.ones((1024, 1024), dtype)
        kept_mean = float(drop(x, jax.random.PRNGKey(1), rate).astype(jnp.float32).mean())
        assert abs(kept_mean - 1.0) < 4 * sd / (1 - rate) + (0.004 if dtype == jnp.bfloat16 else 0)
    np.testing.assert_array_equal(drop(x, jax.random.PRNGKey(1), 0.0), x)


def test_the_second_seed_keeps_two_masks_from_being_shifted_copies():
    """Seeds s1 and s1 + k * golden make the first round's words the same sequence shifted by k: with one seed
    the masks would be copies (checked below, so this test can fail), the second seed decorrelates them."""
    n, k = 2**16, 7
    s1, s2 = jnp.uint32(12345), jnp.uint32(999)
    shifted = jnp.uint32((12345 + k * 0x9E3779B1) % 2**32)
    a = np.asarray(hashed_bits(s1, s2, n))
    np.testing.assert_array_equal(a[k:], np.asarray(hashed_bits(shifted, s2, n))[:n - k])  # one seed: copies
    b = np.asarray(hashed_bits(shifted, jnp.uint32(4242), n))
    assert abs(np.corrcoef(a[k:] > 2**31, b[:n - k] > 2**31)[0, 1]) < 0.02


def test_dropout_adds_no_memory_to_the_compiled_backward_pass():
    """XLA recomputes the hashed masks in the backward pass instead of keeping them (flax's nn.Dropout kept
    ~7.7 bytes an element, a bool mask would keep 1): the compiled gradient with dropout needs at most a quarter
    byte an element more than without (measured: 0.004)."""
    shape = ModelShape(vocab_size=512, n_layers=2, d_model=128, n_heads=4, d_ff=344)
    x, y = _batch(shape, B=16, L=64)
    params = init_params(Transformer(shape), 0, 64)

    def peak(model, rng):
        grad = jax.jit(jax.grad(lambda p: token_nll(model, p, x, y, rng).mean()))
        m = grad.lower(params).compile().memory_analysis()
        return m.temp_size_in_bytes + m.output_size_in_bytes

    masks = 5 * 16 * 64 * 128  # elements: the embedding's and two per layer; a kept bool mask is 1 byte each
    assert peak(Transformer(shape, dropout=0.1), jax.random.PRNGKey(0)) <= peak(Transformer(shape), None) + masks // 4


def test_remat_recomputes_the_same_dropout_masks():
    x, y = _batch(SMALL)
    plain, remat = Transformer(SMALL, dropout=0.3), Transformer(SMALL, dropout=0.3, remat=True)
    params = init_params(plain, 0, 16)
    rng = jax.random.PRNGKey(3)
    loss = lambda m: lambda p: token_nll(m, p, x, y, rng).mean()  # noqa: E731
    (l0, g0), (l1, g1) = jax.value_and_grad(loss(plain))(params), jax.value_and_grad(loss(remat))(params)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_a_bf16_residual_keeps_the_forward_and_takes_the_gradient_at_the_rounded_product(act):
    """With bf16 products the MLP's backward keeps its gate/up product in bf16: the forward is bit-equal, the
    gradient is plain jax's at the bf16-rounded product (written out here), within bf16's rounding of float32's."""
    shape = ModelShape(vocab_size=97, n_layers=1, d_model=64, n_heads=2, d_ff=96, mlp_act=act)
    gu = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 192)) * 3
    dh = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 96))
    f = jax.nn.silu if act == "silu" else (lambda g: jax.nn.gelu(g, approximate=True))
    plain = lambda x: f(x[..., :96]) * x[..., 96:]  # noqa: E731
    h, vjp = jax.vjp(lambda x: gated_product(shape, x, bf16_residual=True), gu)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(plain(gu)))
    rounded = gu.astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_allclose(vjp(dh)[0], jax.vjp(plain, rounded)[1](dh)[0], rtol=1e-6, atol=1e-6)
    exact = jax.vjp(plain, gu)[1](dh)[0]
    assert 0 < float(jnp.abs(vjp(dh)[0] - exact).max() / jnp.abs(exact).max()) < 2**-7


def test_the_backward_keeps_the_gate_up_product_alone_in_bf16():
    """What the backward holds of the MLP's activation: the (B, L, 2F) product in bf16 (2 bytes an element); plain
    jax keeps the float32 product and silu's pieces (more than 8 bytes an element), and so does the float32 path."""
    shape = ModelShape(vocab_size=97, n_layers=1, d_model=64, n_heads=2, d_ff=96)
    gu = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 192))

    def kept(bf16_residual):
        _, vjp = jax.vjp(lambda x: gated_product(shape, x, bf16_residual), gu)
        return sum(leaf.nbytes for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "nbytes"))

    assert kept(True) == gu.size * 2
    assert kept(False) > gu.size * 8


def test_bf16_products_hold_less_for_the_backward_of_a_compiled_step(monkeypatch):
    """The trainer's CPU default (bf16 products, float32 activations): the compiled gradient of a small model
    holds at least 3 bytes less an element of each layer's gate/up product than with the activation as plain jax
    keeps it (what is kept shrinks from 8 bytes to 2; XLA:CPU's buffers reuse some of it: measured 3.5)."""
    shape = ModelShape(vocab_size=256, n_layers=4, d_model=128, n_heads=4, d_ff=512)
    x, y = _batch(shape, B=8, L=64)
    model = Transformer(shape, matmul="bfloat16")
    params = init_params(model, 0, 64)

    def temp():
        grad = jax.jit(jax.grad(lambda p: token_nll(model, p, x, y).mean()))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    today = temp()
    new = transformer.gated_product
    monkeypatch.setattr(transformer, "gated_product", lambda s, g, b=False: new(s, g, False))
    assert temp() - today >= 4 * 8 * 64 * 2 * 512 * 3  # layers x tokens x 2F x 3 bytes
