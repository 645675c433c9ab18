"""Step time and tokens/s against model size (1M-100M) and sequence length, with the cost model's line: a plot.

    .venv/bin/python bench/scaling_speed.py                        # ~10 min on 2 cores; writes docs/speed_scaling.png
    .venv/bin/python bench/scaling_speed.py --sizes 1e6,1e7 --seqs 128,512 --out /tmp/s.png

The trainer's jitted AdamW step (slm.train.step.make_train_step; one host device per core, the batch split,
a sync per step as the trainer does; float32) on a fixed batch, for
  (a) --sizes at seq 128, 4,096 tokens a step (batch 32), shape and vocabulary as `--target-params N` picks;
  (b) --seqs at 10M parameters, 4,096 tokens a step (batch 4096 / seq).
Each point: compile, 2 warm-up steps, then the median of --rounds windows of at least --window seconds. Beside
each window a 2048^3 float32 matmul is timed, and MFU divides the point's model FLOP/s (tokens/s x
slm.model.sizing.flops_per_token: 6N + 12 L D S) by the median matmul FLOP/s of the same point, so machine
drift cancels out of the ratio.

The cost model's line: step time = tokens x flops_per_token / (matmul FLOP/s x m), with one m for the whole
plot, the median MFU over all points: the line shows how far the per-size and per-length costs follow the FLOP
count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slm.train.devices import configure_cpu_devices  # noqa: E402

configure_cpu_devices()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from slm.model.sizing import (  # noqa: E402
    choose_shape,
    count_params,
    default_loss_chunk,
    default_vocab_size,
    flops_per_token,
)
from slm.model.transformer import Transformer, init_params  # noqa: E402
from slm.optim.optimizer import make_optimizer  # noqa: E402
from slm.train.devices import data_mesh, shardings  # noqa: E402
from slm.train.step import init_state, make_train_step  # noqa: E402

TOKENS = 4096


def matmul_flops(n: int = 2048) -> float:
    f = jax.jit(lambda a, b: a @ b)
    a = jnp.ones((n, n), jnp.float32)
    f(a, a).block_until_ready()
    t = time.perf_counter()
    f(a, a).block_until_ready()
    return 2 * n**3 / (time.perf_counter() - t)


def point(n_params: int, seq_len: int, rounds: int, window: float, matmul: str = "float32",
          loss_chunk: int | None = None) -> dict:
    shape = choose_shape(n_params, default_vocab_size(n_params))
    chunk = default_loss_chunk(shape.vocab_size, "cpu", matmul) if loss_chunk is None else loss_chunk
    batch_size = TOKENS // seq_len
    mesh = data_mesh(batch_size)
    rep, split = shardings(mesh)
    model, tx = Transformer(shape, matmul=matmul, loss_chunk=chunk), make_optimizer()
    state = jax.device_put(init_state(init_params(model, 0, seq_len), tx), rep)
    step = make_train_step(model, tx)
    ids = np.random.default_rng(0).integers(0, shape.vocab_size, (batch_size, seq_len + 1)).astype(np.int32)
    batch = {"input_ids": jax.device_put(ids[:, :-1], split), "targets": jax.device_put(ids[:, 1:], split)}
    lr = np.float32(1e-4)
    for _ in range(3):  # compile, warm up
        state, m = step(state, batch, lr)
        m["loss"].block_until_ready()
    times, peaks = [], []
    for _ in range(rounds):
        n, t0 = 0, time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < window:
            state, m = step(state, batch, lr)
            m["loss"].block_until_ready()
            n += 1
        times.append((time.perf_counter() - t0) / n)
        peaks.append(matmul_flops())
    step_s, peak = statistics.median(times), statistics.median(peaks)
    fpt = flops_per_token(shape, seq_len)
    out = {"params": count_params(shape), "seq": seq_len, "step_s": step_s, "tok_s": TOKENS / step_s,
           "flops_per_token": fpt, "model_flops": TOKENS * fpt / step_s, "peak": peak,
           "mfu": TOKENS * fpt / step_s / peak, "shape": f"{shape.n_layers}x{shape.d_model} V{shape.vocab_size} C{chunk}"}
    print(f"  {out['params'] / 1e6:7.2f}M ({out['shape']}) seq {seq_len:5d}: step {step_s * 1e3:8.1f} ms "
          f"(min-max {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}), {out['tok_s']:8,.0f} tok/s, "
          f"{out['model_flops'] / 1e9:6.1f} GFLOP/s, MFU {out['mfu']:.1%} of {peak / 1e9:.0f}", flush=True)
    return out


def plot(by_size: list[dict], by_seq: list[dict], m: float, path: str, what: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, pts, key, label in ((a, by_size, "params", "parameters (seq 128)"), (b, by_seq, "seq", "sequence length (10M params)")):
        x = [p[key] for p in pts]
        ax.plot(x, [p["tok_s"] for p in pts], "o-", label="measured tokens/s")
        ax.plot(x, [p["peak"] * m / p["flops_per_token"] for p in pts], "--", label=f"cost model (MFU {m:.0%})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("tokens/s (4,096 tokens/step)")
        for p in pts:
            ax.annotate(f"{p['step_s'] * 1e3:.0f} ms", (p[key], p["tok_s"]), textcoords="offset points", xytext=(4, 6),
                        fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"train step, {what}, 2 host devices; {time.strftime('%Y-%m-%d')}, bench/scaling_speed.py "
                 "(labels: median step time; MFU of the float32 matmul peak)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1e6,3e6,1e7,3e7,1e8")
    p.add_argument("--seqs", default="64,128,256,512,1024")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=float, default=2.0, help="seconds per window (at least one step)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                                                  "speed_scaling.png"))
    p.add_argument("--matmul-precision", default="float32", choices=("float32", "bfloat16"),
                   help="the model's --matmul-precision (MFU still divides by the float32 matmul's FLOP/s)")
    p.add_argument("--loss-chunk", type=int, default=None, help="the model's --loss-chunk (default: the trainer's)")
    a = p.parse_args()
    print(f"scaling_speed: {time.strftime('%Y-%m-%d %H:%M')}, jax {jax.__version__}, {len(jax.devices())} devices, "
          f"{TOKENS} tokens/step, float32 AdamW, {a.matmul_precision} matmuls, loss chunk "
          f"{'default' if a.loss_chunk is None else a.loss_chunk}", flush=True)
    by_size = [point(int(float(n)), 128, a.rounds, a.window, a.matmul_precision, a.loss_chunk) for n in a.sizes.split(",")]
    by_seq = [point(10_000_000, int(s), a.rounds, a.window, a.matmul_precision, a.loss_chunk) for s in a.seqs.split(",")]
    m = statistics.median(x["mfu"] for x in by_size + by_seq)
    print(f"cost model: MFU {m:.1%} (median of all points); wrote {a.out}")
    what = f"{a.matmul_precision} products, loss chunk {'default' if a.loss_chunk is None else a.loss_chunk}"
    plot(by_size, by_seq, m, a.out, what)


if __name__ == "__main__":
    main()
