"""The train step with AdamW, with optax's Muon (every device runs every Newton-Schulz iteration) and with the
trainer's Muon (the iterations shared out over the devices), interleaved on the same batch.

    .venv/bin/python bench/muon_step.py                                  # the quality race's setting
    .venv/bin/python bench/muon_step.py --target-params 10000000 --seq-len 128 --batch-size 32

The trainer's jitted step (slm.train.step.make_train_step) on the trainer's data-parallel mesh (one host device
per core, the batch split, the state replicated), float32, the shape `--target-params` picks with the default
vocabulary. Variants:

  adamw         --optimizer adamw
  muon-optax    optax.contrib.muon, so each device orthogonalises every matrix (--optimizer muon on one device)
  muon-shared   slm.optim.muon.grouped_muon, each device orthogonalises its share and one all-gather shares the
                results (--optimizer muon on several devices with --sharding dp, host CPU devices included)

Each: compile, 3 warm-up steps, then --rounds rounds of 20 steps per variant, interleaved; the median step time
per variant, its ratio to muon-optax's, and the loss after the rounds (muon-optax and muon-shared compute the
same numbers, so their losses agree to float rounding).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slm.train.devices import configure_cpu_devices

configure_cpu_devices()
import jax
import numpy as np

from slm.model.sizing import choose_shape, default_learning_rate, default_vocab_size
from slm.model.transformer import Transformer, init_params
from slm.optim.optimizer import make_optimizer
from slm.train.devices import data_mesh, shardings
from slm.train.step import init_state, make_train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-params", type=int, default=800_000)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    shape = choose_shape(a.target_params, default_vocab_size(a.target_params))
    mesh = data_mesh(a.batch_size)
    state_sh, batch_sh = shardings(mesh)
    model = Transformer(shape)
    ratio = 0.02 / default_learning_rate(a.target_params)
    txs = {"adamw": make_optimizer(), "muon-optax": make_optimizer(optimizer="muon", muon_lr_ratio=ratio),
           "muon-shared": make_optimizer(optimizer="muon", muon_lr_ratio=ratio, muon_mesh=mesh)}
    rng = np.random.default_rng(0)
    ids = rng.integers(0, shape.vocab_size, (a.batch_size, a.seq_len + 1), dtype=np.int32)
    batch = jax.device_put({"input_ids": ids[:, :-1], "targets": ids[:, 1:]}, batch_sh)
    states, steps = {}, {}
    for name, tx in txs.items():  # fresh params each: the step donates its state
        states[name] = jax.device_put(init_state(init_params(model, 0, a.seq_len), tx), state_sh)
        steps[name] = make_train_step(model, tx)
        for _ in range(3):
            states[name], m = steps[name](states[name], batch, np.float32(1e-3))
        jax.block_until_ready(m["loss"])
    print(f"muon_step: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, {shape.n_layers}x{shape.d_model} d_ff {shape.d_ff} "
          f"vocab {shape.vocab_size}, batch {a.batch_size} x seq {a.seq_len}, {mesh.size} devices, "
          f"{a.rounds} rounds of 20 steps", flush=True)
    times: dict[str, list[float]] = {k: [] for k in txs}
    loss = {}
    for _ in range(a.rounds):
        for name in txs:
            t = time.perf_counter()
            for _ in range(20):
                states[name], m = steps[name](states[name], batch, np.float32(1e-3))
                jax.block_until_ready(m["loss"])  # the trainer syncs each step on multi-device CPU
            times[name].append((time.perf_counter() - t) / 20)
            loss[name] = float(m["loss"])
    base = statistics.median(times["muon-optax"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:12s} median step {med * 1e3:7.2f} ms (rounds {min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}) | "
              f"speed vs muon-optax {base / med:.3f}x | loss after the rounds {loss[name]:.6f}", flush=True)


if __name__ == "__main__":
    main()
