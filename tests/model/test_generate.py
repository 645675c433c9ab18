"""slm.model.generate and slm.model.decode: KV-cache decoding equals the full forward; sampling filters."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slm.model.decode import CachedTransformer, decode, init_cache
from slm.model.generate import Decoder, filter_logits, generate_ids, sample_token
from slm.model.sizing import ModelShape
from slm.model.transformer import Transformer, init_params

TINY = ModelShape(vocab_size=64, n_layers=2, d_model=32, n_heads=2, d_ff=64)


@functools.cache
def _model(dtype=jnp.float32):
    """A random-init TINY model with its weights scaled up (kernels x10, embedding x3) so logits differ by
    more than rounding (greedy is not a near-tie) and the blocks, not the tied embedding, dominate them
    (at init scale greedy just repeats the last token)."""
    model = Transformer(TINY, dtype=dtype)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: np.asarray(x) * (10.0 if "kernel" in jax.tree_util.keystr(path) else 1.0),
        init_params(model, 0, 8))
    params = jax.device_put({**params, "embed": params["embed"] * 3.0})
    return model, params


@functools.cache
def _decoder(dtype=jnp.float32):
    return Decoder(_model(dtype)[0])


def test_cached_model_has_the_same_parameter_tree():
    ids = jnp.zeros((1, 8), jnp.int32)
    full = jax.eval_shape(Transformer(TINY).init, jax.random.PRNGKey(0), ids)
    cached = jax.eval_shape(CachedTransformer(TINY).init, jax.random.PRNGKey(0), ids,
                            init_cache(TINY, 1, 8), 0)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), full) == jax.tree.map(lambda x: (x.shape, x.dtype), cached)


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_cached_decoding_equals_full_forward(dtype, tol, fresh):
    """A right-padded prefill of 5 tokens (bucket 8), then one token at a time: every position's logits
    equal the full forward's, so the padding's cache slots are masked and then overwritten. `fresh`: the
    prefill attends by the blocked causal attention among its own tokens (the sampler's prefill), not
    against the whole cache."""
    model, params = _model(dtype)
    B, L, P, bucket = 2, 20, 5, 8
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, (B, L)).astype(np.int32)

    full_BxLxV = jax.jit(model.apply)({"params": params}, ids)
    dec = jax.jit(decode, static_argnums=(0, 6))
    padded = np.zeros((B, bucket), np.int32)
    padded[:, :P] = ids[:, :P]
    prefill_BxTxV, cache = dec(model, params, padded, init_cache(TINY, B, 24, dtype), 0, None, fresh)
    got = [prefill_BxTxV[:, :P]]
    for t in range(P, L):
        logits_Bx1xV, cache = dec(model, params, ids[:, t:t + 1], cache, t)
        got.append(logits_Bx1xV)
    got_BxLxV = jnp.concatenate(got, axis=1)
    assert float(jnp.abs(full_BxLxV).max()) > 1.0  # the comparison is not between near-zero logits
    np.testing.assert_allclose(np.asarray(got_BxLxV), np.asarray(full_BxLxV), atol=tol, rtol=0)

    # `last` picks one position's logits, as the prefill does
    last_Bx1xV, _ = dec(model, params, padded, init_cache(TINY, B, 24, dtype), 0, P - 1, fresh)
    np.testing.assert_allclose(np.asarray(last_Bx1xV[:, 0]), np.asarray(full_BxLxV[:, P - 1]), atol=tol, rtol=0)


def _brute_force_greedy(model, params, prompt, n_new):
    """The no-cache reference: rerun the full forward on a fixed right-padded window for every token."""
    L = len(prompt) + n_new
    forward = jax.jit(lambda p, ids: model.apply({"params": p}, ids))
    ids = np.zeros((1, L), np.int32)
    ids[0, :len(prompt)] = prompt
    for pos in range(len(prompt), L):
        ids[0, pos] = int(np.argmax(np.asarray(forward(params, ids))[0, pos - 1]))
    return ids[0, len(prompt):]


def test_greedy_generation_equals_brute_force_full_forward():
    model, params = _model()
    prompt, n_new = [3, 17, 42], 30
    want = _brute_force_greedy(model, params, prompt, n_new)
    assert len(set(want.tolist())) > 3  # not a degenerate constant sequence
    decoder = _decoder()
    got = np.stack(list(decoder.stream(params, prompt, n_new, temperature=0.0, batch=2)), axis=1)
    np.testing.assert_array_equal(got, np.stack([want, want]))
    # top-k = 1 is greedy whatever the temperature and seed
    for seed in (0, 1):
        top1 = np.stack(list(decoder.stream(params, prompt, n_new, temperature=1.5, top_k=1, seed=seed)), axis=1)
        np.testing.assert_array_equal(top1[0], want)


def test_sampling_seed_determinism_and_top_k_support():
    model, params = _model()
    prompt, n_new = [1, 2], 24
    kw = dict(temperature=1.0, top_k=5, decoder=_decoder())
    a = generate_ids(model, params, prompt, n_new, seed=7, **kw)
    b = generate_ids(model, params, prompt, n_new, seed=7, **kw)
    c = generate_ids(model, params, prompt, n_new, seed=8, **kw)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    assert len(set(a[0].tolist())) > 1
    # every sampled token is among the 5 most likely at its position under the full forward
    seq = np.asarray([prompt + a[0].tolist()], np.int32)
    logits_LxV = np.asarray(jax.jit(model.apply)({"params": params}, seq))[0]
    for i, token in enumerate(a[0]):
        row = logits_LxV[len(prompt) + i - 1]
        assert (row > row[token]).sum() < 5, (i, token)


def _row(probs_by_id):
    return np.log(np.asarray(probs_by_id, np.float32))


def test_filter_logits_on_hand_made_logits():
    # ids ranked by probability: 3 (0.5), 0 (0.2), 4 (0.15), 1 (0.1), 2 (0.05); row 2 is another order
    logits = jnp.asarray(np.stack([_row([0.2, 0.1, 0.05, 0.5, 0.15]), _row([0.05, 0.5, 0.2, 0.1, 0.15])]))

    filter_jit = jax.jit(filter_logits, static_argnums=1)

    def kept(top_k, top_p):
        out = np.asarray(filter_jit(logits, top_k, top_p))
        kept_rows = [set(np.flatnonzero(np.isfinite(r)).tolist()) for r in out]
        for r, o, k in zip(np.asarray(logits), out, kept_rows):  # kept logits are unchanged
            np.testing.assert_array_equal(o[list(k)], r[list(k)])
        return kept_rows

    assert kept(0, 1.0) == [{0, 1, 2, 3, 4}] * 2
    assert kept(2, 1.0) == [{3, 0}, {1, 2}]
    assert kept(4, 1.0) == [{3, 0, 4, 1}, {1, 2, 4, 3}]
    assert kept(0, 0.45) == [{3}, {1}]  # the top token alone reaches 0.45
    assert kept(0, 0.6) == [{3, 0}, {1, 2}]  # 0.5 < 0.6: the second is needed, 0.7 >= 0.6: no third
    assert kept(0, 0.75) == [{3, 0, 4}, {1, 2, 4}]
    assert kept(0, 1e-6) == [{3}, {1}]  # the most likely token always stays
    # top-p after top-k renormalises over the k: 0.5/0.7 = 0.71 >= 0.6 already
    assert kept(2, 0.6) == [{3}, {1}]
    assert kept(3, 0.6) == [{3, 0}, {1, 2}]  # 0.5/0.85 = 0.59 < 0.6
    # equal logits: top-k prefers the lower id
    ties = jnp.asarray([[1.0, 2.0, 2.0, 0.0]])
    assert np.flatnonzero(np.isfinite(np.asarray(filter_jit(ties, 1, 1.0)))).tolist() == [1]


def test_sample_token_temperature_shapes_the_distribution():
    n = 20_000
    logits = jnp.tile(jnp.log(jnp.asarray([[0.25, 0.75]])), (n, 1))
    key = jax.random.PRNGKey(0)
    for temperature, p1 in ((1.0, 0.75), (0.5, 0.9), (2.0, 3 ** 0.5 / (1 + 3 ** 0.5))):
        freq = float(np.asarray(sample_token(logits, key, temperature, 0, 1.0)).mean())
        assert abs(freq - p1) < 0.02, (temperature, freq, p1)
    assert np.asarray(sample_token(logits, key, 0.0, 0, 1.0)).tolist() == [1] * n  # greedy
    assert np.asarray(sample_token(logits, key, 1.0, 0, 0.5)).tolist() == [1] * n  # top-p keeps only id 1


def test_one_compile_for_every_token_and_sampling_setting():
    model, params = _model()
    decoder = Decoder(model)  # a fresh one, to count its compiles
    for temperature, top_p, seed in ((0.0, 1.0, 0), (0.7, 0.9, 1), (1.3, 1.0, 2)):
        list(decoder.stream(params, [5, 6, 7], 40, temperature=temperature, top_k=8, top_p=top_p, seed=seed))
    list(decoder.stream(params, [5, 6], 41, top_k=8))  # same cache length (64) and prompt bucket (8)
    assert len(decoder._compiled) == 1


@pytest.mark.parametrize("platform,expected", [("gpu", {"xla_gpu_autotune_level": 0}), ("cpu", {})])
def test_sampler_compiles_without_gpu_autotuning(monkeypatch, platform, expected):
    """On a GPU the sampler's programs compile with autotuning off: XLA:GPU's autotuner holds scratch copies of
    the operands on the card while it compiles, beside the run's state (measured 2.5x the plan on an H100).
    Here the options are recorded as the two programs are compiled (a CPU compile accepts the GPU option)."""
    seen = []
    original = jax.stages.Lowered.compile

    def recording(self, compiler_options=None, **kwargs):
        seen.append(compiler_options)
        return original(self, compiler_options=compiler_options, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    model, params = _model()
    Decoder(model.clone(platform=platform)).compiled(params, 1, 3, 5)
    assert seen == [expected, expected]
