"""Train-step speed on CPU: model FLOP/s at the nanoGPT "baby" shape and the default 1M shape, and
streaming-loader overhead, as medians of windows measured in one sitting.

    .venv/bin/python bench/train_speed.py                # both shapes, fixed batch + real loader
    .venv/bin/python bench/train_speed.py --no-loader    # fixed-batch step speed only
    .venv/bin/python bench/train_speed.py --cpu-devices 1  # one host device only

(a) Fixed in-memory batch: the jitted AdamW train step (slm.optim.optimizer.make_optimizer /
    slm.train.step.make_train_step, lr as a np.float32 argument, donated state) -> ms/step, tokens/s, model
    FLOP/s = 6 * N * tokens/s (N = slm.model.sizing.count_params) and MFU against a 2048^3 float32 matmul
    measured in the same sitting.
(b) The same step fed by the real StreamingDataLoader (tinyshakespeare_train.txt, byte-level BPE trained
    with slm.data.tokenizer.train_bpe, prefetch=2, default shuffle buffer), epochs chained as the trainer does,
    against the fixed batch: tokens/s ratio (goal >= 0.97) and the fraction of wall time spent waiting in
    next(loader).

Like against like, in one sitting: each of --reps rounds runs a fixed-batch window, a loader window (each
>= --window seconds) and a matmul measurement back to back, so all three see the same machine state; every
figure is the median over the rounds (the spread, min-max over the rounds, is printed beside the step
time), the loader ratio is the median of each round's paired ratio, and MFU divides the median model FLOP/s
by the median matmul FLOP/s. Nothing is compared with a figure stored from another sitting: the race
against nanoGPT is bench/vs_nanogpt.py, which runs both programs interleaved.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the slm package, from a checkout without `pip install -e .`

DATA = os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare_train.txt")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=3.0, help="seconds per measurement window")
    p.add_argument("--reps", type=int, default=5, help="rounds of windows (the median is reported)")
    p.add_argument("--no-loader", action="store_true", help="skip the real-loader comparison")
    p.add_argument("--cpu-devices", type=int, default=None, help="host devices (default: as the trainer, one per core)")
    p.add_argument("--shapes", default="baby,1M", help="comma list of: baby, 1M")
    p.add_argument("--data", default=DATA, help="text file for the loader")
    p.add_argument("--bf16", action="store_true", help="bfloat16 compute (mixed precision)")
    return p.parse_args()


args = parse_args()

import jax

from slm.train.devices import (
    configure_cpu_devices,
    data_mesh,
    needs_step_sync,
    shardings,
)

configure_cpu_devices(args.cpu_devices)
import jax.numpy as jnp
import numpy as np

from slm.model.sizing import ModelShape, choose_shape, count_params, flops_per_token
from slm.model.transformer import Transformer, init_params
from slm.optim.optimizer import make_optimizer
from slm.train.step import init_state, make_train_step


def build(shape: ModelShape, seq_len: int, dtype, mesh):
    """State replicated over the mesh and a step that feeds it as the trainer does."""
    model = Transformer(shape, dtype=dtype)
    params = init_params(model, 0, seq_len)
    assert sum(x.size for x in jax.tree.leaves(params)) == count_params(shape), "param count mismatch"
    tx = make_optimizer()
    replicated, batch_sharded = shardings(mesh)
    train_step, sync = make_train_step(model, tx), needs_step_sync(mesh)

    def step(state, batch, lr):
        state, m = train_step(state, jax.device_put(batch, batch_sharded), lr)
        if sync:
            m["loss"].block_until_ready()
        return state, m

    return jax.device_put(init_state(params, tx), replicated), step


def run_window(state, step, batches, n: int, lr):
    """n steps; returns (state, seconds, seconds waiting for batches)."""
    wait = 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        batch = next(batches)
        wait += time.perf_counter() - t
        state, m = step(state, batch, lr)
    jax.block_until_ready(m["loss"])
    return state, time.perf_counter() - t0, wait


def forever(x):
    while True:
        yield x


def loader_stream(loader):
    epoch = 0
    while True:
        yield from loader.iter_epoch(epoch)
        epoch += 1


def matmul_flops(n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of the median of `reps` jitted float32 n x n matmuls (measured afresh each call)."""
    f = jax.jit(lambda a, b: a @ b)
    a = jnp.ones((n, n), jnp.float32)
    f(a, a).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def bench_shape(label, shape, seq_len, batch_size, tokenizer, max_devices=None):
    dtype = jnp.bfloat16 if args.bf16 else jnp.float32
    mesh = data_mesh(batch_size, max_devices)
    state, step = build(shape, seq_len, dtype, mesh)
    n_params = count_params(shape)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, shape.vocab_size, (batch_size, seq_len + 1)).astype(np.int32)
    fixed = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    lr = np.float32(1e-3)
    t = time.perf_counter()
    state, m = step(state, fixed, lr)
    jax.block_until_ready(m["loss"])
    compile_s = time.perf_counter() - t
    state, dt, _ = run_window(state, step, forever(fixed), 10, lr)  # warm up, estimate the step time
    n = max(20, math.ceil(args.window / (dt / 10)))

    stream = None
    if tokenizer is not None:
        from slm.data.stream import StreamingDataLoader

        loader = StreamingDataLoader(args.data, tokenizer, seq_len=seq_len, batch_size=batch_size, prefetch=2)
        stream = loader_stream(loader)
        state, _, _ = run_window(state, step, stream, 10, lr)  # start the pipeline
    fixed_s, loader_s, waits, ratios, peaks = [], [], [], [], []
    for _ in range(args.reps):  # one round: fixed window, loader window, matmul, back to back
        state, dt, _ = run_window(state, step, forever(fixed), n, lr)
        fixed_s.append(dt)
        if stream is not None:
            state, dt, wait = run_window(state, step, stream, n, lr)
            loader_s.append(dt)
            waits.append(wait / dt)
            ratios.append(fixed_s[-1] / dt)
        peaks.append(matmul_flops())
    tokens = n * batch_size * seq_len
    med = statistics.median(fixed_s)
    tps = tokens / med
    row = {
        "label": label, "devices": int(mesh.devices.size), "params": n_params, "shape": shape, "seq": seq_len,
        "batch": batch_size, "steps": n, "compile_s": compile_s, "ms_step": 1e3 * med / n,
        "ms_min": 1e3 * min(fixed_s) / n, "ms_max": 1e3 * max(fixed_s) / n, "tok_s": tps,
        "gflops": 6 * n_params * tps / 1e9, "gflops_attn": flops_per_token(shape, seq_len) * tps / 1e9,
        "peak": statistics.median(peaks),
    }
    row["mfu"] = row["gflops"] * 1e9 / row["peak"]
    if stream is not None:
        row["loader_tok_s"] = tokens / statistics.median(loader_s)
        row["loader_ratio"] = statistics.median(ratios)
        row["wait"] = statistics.median(waits)
    return row


def main() -> None:
    print(f"jax {jax.__version__} on {len(jax.devices())} {jax.devices()[0].platform} device(s), "
          f"{os.cpu_count()} cpus; dtype {'bf16' if args.bf16 else 'fp32'}; {time.strftime('%Y-%m-%d %H:%M')}; "
          f"medians of {args.reps} rounds")
    print(f"load before: {load()}")
    configs = {
        "baby": (lambda v: ModelShape(v, 4, 128, 4, 352), 512, 64, 12),
        "1M": (lambda v: choose_shape(1_000_000, v), 1024, 128, 32),
    }
    rows = []
    for label in args.shapes.split(","):
        make_shape, vocab, seq_len, batch_size = configs[label]
        tokenizer = None
        if not args.no_loader:
            from slm.data.readers import read_file
            from slm.data.tokenizer import train_bpe

            tokenizer = train_bpe(read_file(args.data), vocab)
            vocab = tokenizer.get_vocab_size()
        shape = make_shape(vocab)
        for max_devices in sorted({1, len(jax.devices())}):
            row = bench_shape(label, shape, seq_len, batch_size, tokenizer, max_devices)
            rows.append(row)
            print(f"  {label} on {row['devices']} device(s): {row['ms_step']:.2f} ms/step (rounds "
                  f"{row['ms_min']:.2f}-{row['ms_max']:.2f}), {row['gflops']:.1f} GFLOP/s "
                  f"(compile {row['compile_s']:.1f}s, {row['steps']} steps/window)", flush=True)
    print(f"load after: {load()}")

    print()
    print("| shape | devices | params | seq x batch | ms/step (median; min-max) | tokens/s | GFLOP/s (6N) "
          "| GFLOP/s (6N+attn) | matmul GFLOP/s | MFU | loader tok/s | loader/fixed | data wait |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["shape"]
        loader = (f"{r['loader_tok_s']:,.0f} | {r['loader_ratio']:.3f} | {r['wait']:.1%}"
                  if "loader_ratio" in r else "- | - | -")
        print(f"| {r['label']} ({s.n_layers}x{s.d_model}, {s.n_heads}h, ff {s.d_ff}, V {s.vocab_size}) "
              f"| {r['devices']} | {r['params']:,} | {r['seq']}x{r['batch']} | {r['ms_step']:.2f} "
              f"({r['ms_min']:.2f}-{r['ms_max']:.2f}) | {r['tok_s']:,.0f} | {r['gflops']:.1f} | {r['gflops_attn']:.1f} "
              f"| {r['peak'] / 1e9:.1f} | {r['mfu']:.1%} | {loader} |")


def load() -> str:
    with open("/proc/loadavg") as f:
        return "load average " + ", ".join(f.read().split()[:3])


if __name__ == "__main__":
    main()
