"""Gradient accumulation: slm.optim.optimizer.LazyMultiSteps against optax.MultiSteps, which it replaces."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from slm.optim.optimizer import LazyMultiSteps, make_optimizer


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("use_8bit", [False, True])
def test_lazy_multisteps_equals_optax_multisteps_bit_for_bit(optimizer, use_8bit):
    """Same params and the same state (structure and values) after 7 micro-steps of 3 per update: the inner
    update runs only on the emitting micro-step, and that changes nothing computed."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32), "b": jnp.zeros(8)}
    lazy = make_optimizer(accumulation=3, optimizer=optimizer, use_8bit=use_8bit)
    assert isinstance(lazy, LazyMultiSteps)
    ref = optax.MultiSteps(lazy.inner_opt, every_k_schedule=3)
    (pl, sl), (pr, sr) = (params, lazy.init(params)), (params, ref.init(params))
    for i in range(7):
        grads = jax.tree.map(lambda x: jnp.sin(x * (i + 1)) + 0.1 * i, pl)
        ul, sl = jax.jit(lazy.update)(grads, sl, pl)
        ur, sr = jax.jit(ref.update)(grads, sr, pr)
        pl = jax.tree.map(lambda p, u: p - 1e-2 * u, pl, ul)
        pr = jax.tree.map(lambda p, u: p - 1e-2 * u, pr, ur)
        if i % 3 != 2:  # between updates nothing moves
            assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(ul))
    assert jax.tree.structure(sl) == jax.tree.structure(sr)
    for a, b in zip(jax.tree.leaves((pl, sl)), jax.tree.leaves((pr, sr))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(sl.gradient_step) == 2 and not np.array_equal(np.asarray(pl["w"]), np.asarray(params["w"]))


def test_the_inner_optimizer_runs_once_per_update_not_per_micro_step():
    """The point of the class: a micro-step that does not emit skips the inner optimizer (optax's MultiSteps
    runs it every micro-step and keeps the result with a `where`). Counted by a callback inside it."""
    calls = []

    def counting() -> optax.GradientTransformation:
        def update(updates, state, params=None):
            jax.debug.callback(lambda: calls.append(1))
            return updates, state
        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    params = {"w": jnp.ones((4, 4))}
    lazy_step = lambda tx: lambda g, s, p: tx.step_params(g, s, p, lambda p, u: p)  # noqa: E731 (the train step's)
    for cls, make, expected in ((LazyMultiSteps, lambda tx: tx.update, 2), (LazyMultiSteps, lazy_step, 2),
                                (optax.MultiSteps, lambda tx: tx.update, 8)):
        calls.clear()
        tx = cls(counting(), every_k_schedule=4)
        state, step = tx.init(params), jax.jit(make(tx))
        for _ in range(8):
            _, state = step(params, state, params)
        jax.effects_barrier()
        assert len(calls) == expected, cls


def _apply(params, updates):
    return jax.tree.map(lambda p, u: p - 1e-2 * u, params, updates)


@pytest.mark.parametrize("optimizer,use_8bit,skip_by", [("adamw", False, "cond"), ("adamw", True, "cond"),
                                                        ("adamw", True, "where"), ("muon", False, "where")])
def test_step_params_equals_optax_multisteps_then_apply_bit_for_bit(optimizer, use_8bit, skip_by):
    """The train step's path (the update applied inside a loop of 0 or 1 trips) against optax.MultiSteps and the
    same apply after it: the same state bit for bit and the same params to the last bit XLA's fusing of
    `p - lr * u` may move, after 7 micro-steps of 3 per update (the moments were computed from the params)."""
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32), "b": jnp.zeros(8)}
    lazy = make_optimizer(accumulation=3, optimizer=optimizer, use_8bit=use_8bit, skip_by=skip_by)
    ref = optax.MultiSteps(lazy.inner_opt, every_k_schedule=3)
    (pl, sl), (pr, sr) = (params, lazy.init(params)), (params, ref.init(params))

    @jax.jit
    def ref_step(grads, state, params):  # both compiled whole: the apply fused alike
        updates, state = ref.update(grads, state, params)
        return _apply(params, updates), state

    for i in range(7):
        grads = jax.tree.map(lambda x: jnp.cos(x * (i + 2)) - 0.1 * i, pl)
        pl, sl = jax.jit(lazy.step_params, static_argnums=3)(grads, sl, pl, _apply)
        pr, sr = ref_step(grads, sr, pr)
    assert jax.tree.structure(sl) == jax.tree.structure(sr)
    for a, b in zip(jax.tree.leaves(sl), jax.tree.leaves(sr)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(pl), jax.tree.leaves(pr)):  # XLA may round p - lr * u apart: 1 ulp an update
        np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(b), maxulp=2)
    assert int(sl.gradient_step) == 2 and not np.array_equal(np.asarray(pl["w"]), np.asarray(params["w"]))


@pytest.mark.parametrize("skip_by", ["cond", "where"])
def test_a_nan_micro_step_skips_its_update_and_the_next_accumulation_starts_clean(skip_by):
    """A window of micro-steps with a NaN gradient changes neither params nor Adam's state, and its accumulator
    is zeroed at the window's end (optax's `(1 - emit) * acc` would keep the NaN, skipping every later step):
    windows [A, NaN, B] leave the params that [A, B] do, bit for bit."""
    params = {"w": jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(4, 8)}
    tx = make_optimizer(accumulation=2, use_8bit=True, skip_by=skip_by)
    step = jax.jit(tx.step_params, static_argnums=3)
    a = [jax.tree.map(lambda x: jnp.sin(x * k), params) for k in (1, 2)]
    b = [jax.tree.map(lambda x: jnp.cos(x * k), params) for k in (3, 4)]
    nan = [a[0], jax.tree.map(lambda x: x.at[0, 0].set(jnp.nan), a[1])]
    results = []
    for windows in ([a, nan, b], [a, b]):
        p, s = params, tx.init(params)
        for g in (g for w in windows for g in w):
            p, s = step(g, s, p, _apply)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(s.acc_grads))
        results.append(p)
    np.testing.assert_array_equal(np.asarray(results[0]["w"]), np.asarray(results[1]["w"]))
    assert not np.array_equal(np.asarray(results[0]["w"]), np.asarray(params["w"]))
