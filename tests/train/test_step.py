"""slm.train.step with slm.optim.optimizer: accumulation, the AdamW update, the eval step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import fresh_state

from slm.model.sizing import ModelShape
from slm.model.transformer import Transformer, init_params
from slm.optim.optimizer import make_optimizer
from slm.train.step import make_eval_step, make_flush_step, make_train_step

SHAPE = ModelShape(vocab_size=64, n_layers=2, d_model=32, n_heads=1, d_ff=96)
L = 12


def _batches(n, B, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, SHAPE.vocab_size, (n, B, L + 1)).astype(np.int32)
    return [{"input_ids": jnp.asarray(b[:, :-1]), "targets": jnp.asarray(b[:, 1:])} for b in ids]


def _run(batches, accumulation, lr=1e-2, **opt):
    model = Transformer(SHAPE)
    tx = make_optimizer(accumulation=accumulation, **opt)
    state = fresh_state(model, tx, L)
    step = make_train_step(model, tx)
    for b in batches:
        state, _ = step(state, b, np.float32(lr))
    return state


def test_multisteps_k_micro_batches_equal_one_big_batch():
    micro = _batches(8, 2)  # 2 optimizer steps of 4 micro-batches
    big = [
        {k: jnp.concatenate([m[k] for m in micro[i : i + 4]]) for k in micro[0]}
        for i in (0, 4)
    ]
    # eps=1e-4: with Adam's tiny default eps, gradients that are ~0 up to float rounding give m/sqrt(v)
    # of +-1 either way, so summation order (4 means vs 1 mean) would show up as noise, not as a bug.
    acc = _run(micro, accumulation=4, eps=1e-4)
    one = _run(big, accumulation=1, eps=1e-4)
    moved = _run([], accumulation=1)
    for a, b, c in zip(jax.tree.leaves(acc.params), jax.tree.leaves(one.params), jax.tree.leaves(moved.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
    assert any(not np.allclose(a, c) for a, c in zip(jax.tree.leaves(acc.params), jax.tree.leaves(moved.params)))


def test_flush_applies_a_partial_accumulation_as_a_step_on_its_mean():
    """4 micro-batches then 2 (the data ran out) + flush == one batch of 4, then one batch of those 2."""
    micro = _batches(6, 2, seed=3)
    model = Transformer(SHAPE)
    tx = make_optimizer(accumulation=4, eps=1e-4)
    state, step = fresh_state(model, tx, L), make_train_step(model, tx)
    for b in micro:
        state, _ = step(state, b, np.float32(1e-2))
    state = make_flush_step(tx)(state, np.float32(1e-2))
    big = [{k: jnp.concatenate([m[k] for m in part]) for k in micro[0]} for part in (micro[:4], micro[4:])]
    one = _run(big, accumulation=1, eps=1e-4)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(one.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
    assert int(state.opt_state.mini_step) == 0 and int(state.opt_state.gradient_step) == 2
    assert all(not np.asarray(g).any() for g in jax.tree.leaves(state.opt_state.acc_grads))  # reset for the next


def test_no_update_between_accumulation_boundaries():
    model = Transformer(SHAPE)
    tx = make_optimizer(accumulation=3)
    state = fresh_state(model, tx, L)
    before = jax.tree.map(np.asarray, state.params)
    step = make_train_step(model, tx)
    for b in _batches(2, 2):
        state, _ = step(state, b, np.float32(1e-2))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_update_matches_optax_adamw():
    """Same gradients in, same parameters out: our clip-free composition + lr is optax.adamw (matrix-only decay)."""
    model = Transformer(SHAPE)
    params = init_params(model, 0, L)
    rng = np.random.default_rng(0)
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype) * 1e-2, params) for _ in range(4)]

    ours_tx = make_optimizer(weight_decay=0.1, grad_clip=0.0, accumulation=1)
    ours, ours_state = params, ours_tx.init(params)
    ref_tx = optax.adamw(3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                         mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    ref, ref_state = params, ref_tx.init(params)
    for g in grads:
        u, ours_state = ours_tx.update(g, ours_state, ours)
        ours = jax.tree.map(lambda p, u: p - 3e-3 * u, ours, u)
        u, ref_state = ref_tx.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, u)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7, rtol=1e-6)
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(params)))
    assert moved > 1e-3


def test_loss_falls_when_overfitting_one_batch():
    model = Transformer(SHAPE)
    tx = make_optimizer(accumulation=1)
    state = fresh_state(model, tx, L)
    step = make_train_step(model, tx)
    b = _batches(1, 4)[0]
    losses = []
    for _ in range(30):
        state, m = step(state, b, np.float32(1e-2))
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.5 * losses[0]


def test_eval_step_masks_padding():
    model = Transformer(SHAPE)
    params = init_params(model, 0, L)
    b = _batches(1, 2)[0]
    mask = np.ones((2, L), np.float32)
    mask[1, 5:] = 0
    total, count = make_eval_step(model)(params, b["input_ids"], b["targets"], mask)
    assert float(count) == L + 5
    from slm.model.transformer import token_nll

    nll = np.asarray(token_nll(model, params, b["input_ids"], b["targets"]))
    assert float(total) == pytest.approx(nll[0].sum() + nll[1, :5].sum(), rel=1e-5)


def test_dropout_masks_follow_the_step_so_a_replayed_step_repeats():
    """--dropout draws from (seed, micro_step): the same state and batch give the same update (resume), a
    different step count another mask, and eval is unaffected."""
    model = Transformer(SHAPE, dropout=0.2)
    tx = make_optimizer(accumulation=1)
    b = _batches(1, 4)[0]
    step = make_train_step(model, tx)
    start = fresh_state(model, tx, L)
    copy = jax.tree.map(jnp.copy, start)
    s1, m1 = step(start, b, np.float32(1e-2))
    s2, m2 = step(copy, b, np.float32(1e-2))
    assert float(m1["loss"]) == float(m2["loss"])
    for x, y in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_array_equal(x, y)
    s1_copy, s1_again = jax.tree.map(jnp.copy, s1), jax.tree.map(jnp.copy, s1)
    _, m3 = step(s1, b, np.float32(0.0))  # dropout at micro_step 1 too: not the plain model's loss
    _, m4 = make_train_step(Transformer(SHAPE), tx)(s1_copy, b, np.float32(0.0))
    assert float(m3["loss"]) != float(m4["loss"])
    other = s1_again.replace(micro_step=s1_again.micro_step + 1)  # same weights, the next step's mask
    _, m5 = step(other, b, np.float32(0.0))
    assert float(m5["loss"]) != float(m3["loss"])
