"""Causal attention, forward + backward, alone: the blocked attention the model runs (slm.model.attention)
against the whole-square einsum attention it replaced (slm.model.transformer.attend, still the decoder's).

    .venv/bin/python bench/attention.py                         # the shapes below, the default block
    .venv/bin/python bench/attention.py --blocks 64,128,256     # each block size too
    .venv/bin/python bench/attention.py --bf16                  # bf16 operands, float32 sums

Each row: one jitted value-and-gradient of sum(attention(q, k, v) * w) over random float32 inputs, median of
--repeats calls after a warm-up, both versions alternated in one process; the ratio is einsum / blocked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from slm.model.attention import causal_attend  # noqa: E402
from slm.model.sizing import attention_block  # noqa: E402
from slm.model.transformer import attend  # noqa: E402
from plan_for_xla import host  # noqa: E402  (bench/, beside this script)

SHAPES = {  # name: (batch, seq, query heads, kv heads, head dim)
    "the main job (1M), seq 128 x 16 a device": (16, 128, 4, 4, 32),
    "nanoGPT's baby shape, seq 64 x 6 a device": (6, 64, 4, 4, 32),
    "LoRA race (SmolLM2-135M), seq 256 x 4": (4, 256, 9, 3, 64),
    "from scratch 10M, seq 256 x 8": (8, 256, 6, 6, 64),
    "from scratch 10M, seq 1,024 x 4": (4, 1024, 6, 6, 64),
    "Qwen3-0.6B, seq 512 x 2": (2, 512, 16, 8, 128),
    "seq 2,048 x 2": (2, 2048, 6, 6, 64),
}


def timed(f, args, repeats: int) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", help="comma-separated block sizes (default: slm.model.sizing.attention_block)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--only", default="", help="the shapes whose name contains this text (e.g. 'main job')")
    a = p.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {host()}, {len(jax.devices())} jax device(s), bf16 operands: {a.bf16}")
    print("| shape | block | einsum ms | blocked ms | einsum / blocked |\n|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, (B, L, H, G, K) in ((n, x) for n, x in SHAPES.items() if a.only in n):
        q, w = (jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32) for _ in range(2))
        k, v = (jnp.asarray(rng.normal(size=(B, L, G, K)), jnp.float32) for _ in range(2))
        mask = jnp.tril(jnp.ones((L, L), bool))
        einsum = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v, mask, jnp.float32) * w),
                                            argnums=(0, 1, 2)))
        for block in ([int(b) for b in a.blocks.split(",")] if a.blocks else [attention_block(L)]):
            blocked = jax.jit(jax.value_and_grad(
                lambda q, k, v: jnp.sum(causal_attend(q, k, v, jnp.float32, bf16=a.bf16, block=block) * w),
                argnums=(0, 1, 2)))
            t_e, t_b = timed(einsum, (q, k, v), a.repeats), timed(blocked, (q, k, v), a.repeats)
            t_e, t_b = min(t_e, timed(einsum, (q, k, v), a.repeats)), min(t_b, timed(blocked, (q, k, v), a.repeats))
            print(f"| {name} | {block} | {t_e * 1e3:,.1f} | {t_b * 1e3:,.1f} | {t_e / t_b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
