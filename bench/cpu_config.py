"""Which CPU set-up trains fastest: host devices and XLA CPU flags, each in its own process, interleaved.

    .venv/bin/python bench/cpu_config.py                      # the configs below at nanoGPT's baby shape
    .venv/bin/python bench/cpu_config.py --shape 1M --seq-len 128 --batch-size 32
    .venv/bin/python bench/cpu_config.py --configs "1dev=1|;2dev=2|" --rounds 9

XLA reads its flags and jax its device count once, when the backend starts, so every config is a worker
process (this file with --worker) that builds the trainer's jitted step (slm.train.step.make_train_step,
AdamW, lr as an argument, state donated, the batch split over the host devices as the trainer does, a host
sync per step on multi-device CPU as the trainer does), compiles it and then waits. The driver then runs
--rounds rounds; in each round every worker in turn runs one window of --steps steps while the others sleep
on a pipe, so all configs see the same machine state. It prints each config's median step time over the
rounds, its spread (min-max) and its ratio to the first config's median; nothing is compared with a figure
from another sitting.

A config is NAME=DEVICES|XLA_FLAGS (flags space-separated, appended to XLA_FLAGS); a NAME containing "bf16"
computes in bfloat16 (the trainer's --use-mixed-precision: float32 master weights), as --bf16 does for all;
a NAME containing "bmm" runs the matrix products with bf16 operands (the trainer's --matmul-precision bfloat16).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = ("2dev=2|;1dev=1|;2dev+xnn=2|--xla_cpu_use_xnnpack=true;"
           "1dev+xnn=1|--xla_cpu_use_xnnpack=true;2dev-fusion-emitters=2|--xla_cpu_use_fusion_emitters=false")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=CONFIGS, help="';'-separated NAME=DEVICES|XLA_FLAGS")
    p.add_argument("--shape", default="baby", help="baby (4 x 128, 4 heads, vocab 65) or 1M (choose_shape(1M, 1024))")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--steps", type=int, default=40, help="steps per window")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--bf16", action="store_true", help="bfloat16 compute")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def worker(a: argparse.Namespace) -> None:
    """Build and compile the step, say 'ready', then run a window per line read and print its seconds."""
    from slm.train.devices import configure_cpu_devices

    configure_cpu_devices(int(os.environ["BENCH_DEVICES"]))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slm.model.sizing import ModelShape, choose_shape
    from slm.model.transformer import Transformer, init_params
    from slm.optim.optimizer import make_optimizer
    from slm.train.devices import data_mesh, needs_step_sync, shardings
    from slm.train.step import init_state, make_train_step

    shape = (ModelShape(n_layers=4, d_model=128, n_heads=4, d_ff=344, vocab_size=65) if a.shape == "baby"
             else choose_shape(1_000_000, 1024))
    bf16 = a.bf16 or os.environ.get("BENCH_BF16") == "1"
    matmul = "bfloat16" if os.environ.get("BENCH_MATMUL") == "bfloat16" else "float32"
    model = Transformer(shape, dtype=jnp.bfloat16 if bf16 else jnp.float32, matmul=matmul)
    tx = make_optimizer()
    mesh = data_mesh(a.batch_size)
    replicated, batch_sharded = shardings(mesh)
    state = jax.device_put(init_state(init_params(model, 0, a.seq_len), tx), replicated)
    step, sync = make_train_step(model, tx), needs_step_sync(mesh)
    ids = np.random.default_rng(0).integers(0, shape.vocab_size, (a.batch_size, a.seq_len + 1)).astype(np.int32)
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    lr = np.float32(1e-3)

    def window(n: int):
        nonlocal state
        for _ in range(n):
            state, m = step(state, jax.device_put(batch, batch_sharded), lr)
            if sync:
                m["loss"].block_until_ready()
        jax.block_until_ready(m["loss"])

    window(3)
    print(json.dumps({"ready": True, "devices": len(mesh.devices.flat)}), flush=True)
    for _ in sys.stdin:
        t = time.perf_counter()
        window(a.steps)
        print(json.dumps({"s": (time.perf_counter() - t) / a.steps}), flush=True)


def main() -> None:
    a = parse_args()
    if a.worker:
        return worker(a)
    configs = [c.split("=", 1) for c in a.configs.split(";") if c.strip()]
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--shape", a.shape, "--seq-len", str(a.seq_len),
            "--batch-size", str(a.batch_size), "--steps", str(a.steps)] + (["--bf16"] if a.bf16 else [])
    procs = {}
    for name, spec in configs:
        devices, flags = spec.split("|", 1)
        env = dict(os.environ, BENCH_DEVICES=devices, BENCH_BF16="1" if "bf16" in name else "0",
                   BENCH_MATMUL="bfloat16" if "bmm" in name else "float32", XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs[name] = p
        json.loads(p.stdout.readline())  # compiled: one at a time, so compiles do not overlap windows
    print(f"cpu_config: {time.strftime('%Y-%m-%d %H:%M')}, shape {a.shape}, seq {a.seq_len}, batch {a.batch_size}, "
          f"{'bf16' if a.bf16 else 'f32'}, {a.rounds} rounds x {a.steps} steps per config", flush=True)
    times = {name: [] for name in procs}
    for _ in range(a.rounds):
        for name, p in procs.items():
            p.stdin.write("go\n")
            p.stdin.flush()
            times[name].append(json.loads(p.stdout.readline())["s"])
    for p in procs.values():
        p.stdin.close()
        p.wait()
    base = statistics.median(next(iter(times.values())))
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:>24}: median {med * 1e3:7.2f} ms/step (min-max {min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}) "
              f"| {base / med:.2f}x the first's speed", flush=True)


if __name__ == "__main__":
    main()
