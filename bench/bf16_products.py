"""One linear layer's matrix products on this CPU: float32 against bf16 operands, in each form XLA can emit.

    .venv/bin/python bench/bf16_products.py                  # the race's per-device shape: 384 tokens, 128 -> 688
    .venv/bin/python bench/bf16_products.py --tokens 2048 --d-in 128 --d-out 1024

One host device (XLA's threads may use every core for one product: the ratios between rows are the figures,
not the absolute rates). For each operand dtype and result dtype it times, median of 7 rounds:
  fwd     y = x . W        (x's last axis with W's first: the form XLA:CPU hands to YNNPACK)
  dx      g . W^T          (W's second axis)
  dw-2d   x^T . g          (2-D, the token axis first in both: YNNPACK refuses it, XLA falls back)
  dw-3d   the same with (batch, length) token axes, as slm.model.matmul emits it (XLA's dot decomposer makes it
          a row-major product YNNPACK takes)
and prints GFLOP/s and each bf16 row's ratio to float32's. Why slm/model/matmul.py picks its forms: see
docs/performance.md ("bf16 matrix products").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slm.train.devices import configure_cpu_devices  # noqa: E402

configure_cpu_devices(1)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from slm.model.matmul import cpu_has_bf16_dot  # noqa: E402


def median_s(f, *args, reps: int = 200, rounds: int = 7) -> float:
    f = jax.jit(f)
    f(*args).block_until_ready()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            out = f(*args)
        out.block_until_ready()
        times.append((time.perf_counter() - t) / reps)
    return statistics.median(times)


def forms(n: int, d: int, f: int, dtype, result) -> dict[str, float]:
    """GFLOP/s of each product form with `dtype` operands and a `result` dtype."""
    b = 6 if n % 6 == 0 else 1
    x, g, w = jnp.ones((n, d), dtype), jnp.ones((n, f), dtype), jnp.ones((d, f), dtype)
    x3, g3 = x.reshape(b, n // b, d), g.reshape(b, n // b, f)

    def dot(a, c, dims):
        return lax.dot_general(a, c, (dims, ((), ())), preferred_element_type=result)

    cases = {"fwd": (lambda a, c: dot(a, c, ((1,), (0,))), x, w),
             "dx": (lambda a, c: dot(a, c, ((1,), (1,))), g, w),
             "dw-2d": (lambda a, c: dot(a, c, ((0,), (0,))), x, g),
             "dw-3d": (lambda a, c: dot(a, c, ((0, 1), (0, 1))), x3, g3)}
    return {k: 2 * n * d * f / median_s(fn, *args) / 1e9 for k, (fn, *args) in cases.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=384, help="rows of x (tokens per device)")
    p.add_argument("--d-in", type=int, default=128)
    p.add_argument("--d-out", type=int, default=688)
    a = p.parse_args()
    print(f"bf16_products: {time.strftime('%Y-%m-%d %H:%M')}, jax {jax.__version__}, 1 host device, "
          f"x ({a.tokens}, {a.d_in}) . W ({a.d_in}, {a.d_out}); CPU with native bf16 products: {cpu_has_bf16_dot()}",
          flush=True)
    base = forms(a.tokens, a.d_in, a.d_out, jnp.float32, jnp.float32)
    rows = {"float32 -> float32": base,
            "bf16 -> float32": forms(a.tokens, a.d_in, a.d_out, jnp.bfloat16, jnp.float32),
            "bf16 -> bf16": forms(a.tokens, a.d_in, a.d_out, jnp.bfloat16, jnp.bfloat16)}
    print(f"  {'operands -> result':>20}: " + " | ".join(f"{k:>17}" for k in base))
    for name, r in rows.items():
        print(f"  {name:>20}: " + " | ".join(f"{r[k]:5.0f} GF/s ({r[k] / base[k]:.2f}x)" for k in base), flush=True)


if __name__ == "__main__":
    main()
