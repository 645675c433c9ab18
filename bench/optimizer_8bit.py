"""8-bit vs float32 AdamW in the trainer's jitted train step: state bytes, compiled memory, step time.

    .venv/bin/python bench/optimizer_8bit.py                     # 1M and 10M targets, seq 128, batch 32
    .venv/bin/python bench/optimizer_8bit.py --targets 10000000 --reps 5

For each target size (model_sizing.choose_shape, default vocab) and each optimizer (train_step.make_optimizer
with use_8bit off/on, accumulation 1, the same clip / weight decay / non-finite guard as the trainer):
- optimizer-state bytes (sum of the arrays' nbytes) and bytes per parameter, and the 8-bit/fp32 ratio;
- the fraction of parameters whose moments are 8-bit;
- the compiled step's XLA memory analysis: arguments + outputs + temporaries - aliased (donated) bytes;
- step time: best of --reps windows of >= --window s each, the two optimizers alternating so both
  see the same machine state; overhead = 8-bit / fp32 - 1 (goal <= 10% at 10M).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--targets", default="1000000,10000000", help="comma list of --target-params values")
p.add_argument("--seq-len", type=int, default=128)
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--window", type=float, default=4.0, help="seconds per timing window")
p.add_argument("--reps", type=int, default=3, help="timing windows per optimizer (best kept)")
p.add_argument("--cpu-devices", type=int, default=None, help="host devices (default: as the trainer)")
args = p.parse_args()

from slm.train.devices import (  # noqa: E402
    configure_cpu_devices,
    data_mesh,
    needs_step_sync,
    shardings,
)

configure_cpu_devices(args.cpu_devices)
import jax  # noqa: E402
import numpy as np  # noqa: E402

from slm.model.sizing import choose_shape, count_params, default_vocab_size, describe  # noqa: E402
from slm.model.transformer import Transformer, init_params  # noqa: E402
from slm.optim.adam8bit import quantized_fraction, state_bytes  # noqa: E402
from slm.optim.optimizer import make_optimizer  # noqa: E402
from slm.train.builder import compiled_memory  # noqa: E402
from slm.train.step import init_state, make_train_step  # noqa: E402


def main() -> None:
    mesh = data_mesh(args.batch_size)
    replicated, batch_sharded = shardings(mesh)
    sync = needs_step_sync(mesh)
    rng = np.random.default_rng(0)
    print(f"{mesh.devices.size} {jax.devices()[0].platform} device(s), seq {args.seq_len}, batch {args.batch_size}")
    print("| params | optimizer | state bytes | bytes/param | 8-bit coverage | compiled peak MB | ms/step |")
    print("|---|---|---|---|---|---|---|")
    for target in [int(t) for t in args.targets.split(",")]:
        shape = choose_shape(target, default_vocab_size(target))
        n = count_params(shape)
        model = Transformer(shape)
        batch = {k: rng.integers(0, shape.vocab_size, (args.batch_size, args.seq_len), dtype=np.int32)
                 for k in ("input_ids", "targets")}
        batch = jax.device_put(batch, batch_sharded)
        lr = np.float32(1e-3)
        runs = {}
        for name, eight in (("adamw fp32", False), ("adamw 8-bit", True)):
            tx = make_optimizer(use_8bit=eight)
            state = jax.device_put(init_state(init_params(model, 0, args.seq_len), tx), replicated)
            step = make_train_step(model, tx)
            runs[name] = dict(step=step, state=state, bytes=state_bytes(state.opt_state),
                              cover=quantized_fraction(state.opt_state, state.params) if eight else 0.0,
                              peak=compiled_memory(step, state, batch, lr)["peak"], best=float("inf"))
            state, m = step(state, batch, lr)  # compile
            m["loss"].block_until_ready()
            runs[name]["state"] = state
        for _ in range(args.reps):
            for r in runs.values():
                state, steps, t0 = r["state"], 0, time.perf_counter()
                while time.perf_counter() - t0 < args.window:
                    state, m = r["step"](state, batch, lr)
                    if sync:
                        m["loss"].block_until_ready()
                    steps += 1
                m["loss"].block_until_ready()
                r["best"] = min(r["best"], (time.perf_counter() - t0) / steps)
                r["state"] = state
        for name, r in runs.items():
            print(f"| {n:,} | {name} | {r['bytes']:,} | {r['bytes'] / n:.2f} | {r['cover']:.1%} "
                  f"| {r['peak'] / 2**20:.1f} | {r['best'] * 1e3:.1f} |")
        a, b = runs["adamw fp32"], runs["adamw 8-bit"]
        print(f"|  | 8-bit / fp32 | {b['bytes'] / a['bytes']:.3f}× |  |  | {b['peak'] / a['peak']:.3f}× "
              f"| {b['best'] / a['best']:.3f}× |")
        print(f"  ({describe(shape, args.seq_len)})", file=sys.stderr)


if __name__ == "__main__":
    main()
