"""Reproduce XLA's CPU all-reduce deadlock with steps dispatched ahead, and show the one-step-in-flight fix.

Two host CPU devices run the data-parallel train step (batch sharded, state replicated, gradient
all-reduce) while a tokenizer thread keeps the cores busy, as the streaming loader does. Each mode runs
in a child process so a deadlock (XLA aborts after a 40 s rendezvous timeout) cannot take this script
down. Expected on a 2-core machine: "run-ahead" aborts within a few hundred steps; "one in flight"
completes every step. Takes a few minutes.

Run: .venv/bin/python bench/cpu_allreduce_hang.py [--steps 1500]
"""

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import os, sys, threading, time
import jax, numpy as np
from slm.train.devices import configure_cpu_devices, data_mesh, shardings
configure_cpu_devices(2)
from slm.model.transformer import Transformer, init_params
from slm.model.sizing import ModelShape
from slm.optim.optimizer import make_optimizer
from slm.train.step import init_state, make_train_step
from slm.data.tokenizer import train_bpe

shape = ModelShape(512, 4, 128, 4, 352)
model, tx = Transformer(shape), make_optimizer()
mesh = data_mesh(12)
rep, dat = shardings(mesh)
state = jax.device_put(init_state(init_params(model, 0, 64), tx), rep)
step = make_train_step(model, tx)
ids = np.random.default_rng(0).integers(0, 512, (12, 65)).astype(np.int32)
docs = open(os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt")).read().split("\n\n")
tok = train_bpe(iter(docs), 512)
stop = False

def burn():
    while not stop:
        tok.encode_batch(docs[:2000])

threading.Thread(target=burn, daemon=True).start()
t = time.time()
for i in range(STEPS):
    batch = jax.device_put({"input_ids": ids[:, :-1], "targets": ids[:, 1:]}, dat)
    state, m = step(state, batch, np.float32(1e-3))
    if SYNC:
        m["loss"].block_until_ready()
m["loss"].block_until_ready()
stop = True
print(f"completed {STEPS} steps in {time.time() - t:.0f}s", flush=True)
"""


def run(sync: bool, steps: int) -> str:
    code = f"ROOT = {ROOT!r}\nSTEPS = {steps}\nSYNC = {sync}\n" + CHILD
    t = time.time()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("completed")]
    if proc.returncode == 0 and lines:
        return lines[-1]
    stuck = "rendezvous" in proc.stderr
    return (f"exit code {proc.returncode} after {time.time() - t:.0f}s"
            + (": all-reduce rendezvous timed out (deadlock)" if stuck else f": {proc.stderr[-300:]}"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    args = p.parse_args()
    print("| mode | result |")
    print("|---|---|")
    print(f"| run-ahead (async dispatch, no per-step sync) | {run(False, args.steps)} |", flush=True)
    print(f"| one step in flight (the trainer's rule on multi-device CPU) | {run(True, args.steps)} |", flush=True)


if __name__ == "__main__":
    main()
