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
    for cls, expected in ((LazyMultiSteps, 2), (optax.MultiSteps, 8)):
        calls.clear()
        tx = cls(counting(), every_k_schedule=4)
        state, step = tx.init(params), jax.jit(tx.update)
        for _ in range(8):
            _, state = step(params, state, params)
        jax.effects_barrier()
        assert len(calls) == expected, cls
