"""Per-step host overhead of the train loop: Python-driven steps vs the same steps inside one jit.

A tiny model makes compute negligible, so (time per Python-driven step) - (time per step inside a
jitted lax.scan) is what the loop itself costs: dispatch, argument handling, donation, lr_at().
Run: .venv/bin/python bench/step_overhead.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from slm.model.sizing import ModelShape, count_params
from slm.model.transformer import Transformer, init_params
from slm.optim.optimizer import make_optimizer
from slm.optim.schedule import lr_at
from slm.train.step import init_state, make_train_step


def best_of(fn, reps=5):
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(n=300):
    shape = ModelShape(vocab_size=256, n_layers=1, d_model=32, n_heads=1, d_ff=64)
    model = Transformer(shape)
    tx = make_optimizer(accumulation=1)
    step = make_train_step(model, tx)
    ids = np.random.default_rng(0).integers(0, 256, (1, 9)).astype(np.int32)
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    state = init_state(init_params(model, 0, 8), tx)

    def python_loop():
        nonlocal state
        for i in range(n):
            lr = lr_at(i / n, i, 1e-3, 10)
            state, m = step(state, batch, np.float32(lr))
        m["loss"].block_until_ready()

    python_loop()  # compile

    body_fn = step.__wrapped__  # the same Python step function, un-jitted

    def scan_steps(state, batch):
        def body(s, _):
            s, m = body_fn(s, batch, jnp.float32(1e-3))
            return s, m["loss"]

        return jax.lax.scan(body, state, None, length=n)

    scan = jax.jit(scan_steps)
    jbatch = jax.tree.map(jnp.asarray, batch)
    s0 = init_state(init_params(model, 0, 8), tx)
    jax.block_until_ready(scan(s0, jbatch))

    t_py = best_of(python_loop) / n
    t_scan = best_of(lambda: jax.block_until_ready(scan(s0, jbatch))) / n
    t_lr = best_of(lambda: [lr_at(i / n, i, 1e-3, 10) for i in range(n)]) / n
    print(f"model: {count_params(shape):,} params, batch 1x8 (compute is negligible)")
    print("| measure | µs/step |")
    print("|---|---|")
    print(f"| Python-driven jitted step (trainer loop) | {t_py * 1e6:.0f} |")
    print(f"| same step inside one jitted lax.scan | {t_scan * 1e6:.0f} |")
    print(f"| host overhead per step (difference) | {(t_py - t_scan) * 1e6:.0f} |")
    print(f"| of which lr_at() | {t_lr * 1e6:.1f} |")
    print(f"At the baby shape (~60 ms/step) the overhead is {(t_py - t_scan) / 0.060:.2%} of a step.")


if __name__ == "__main__":
    main()
