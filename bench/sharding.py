"""DP vs FSDP on an 8-device host mesh: per-device state bytes, XLA's per-device step memory, step time, losses.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python bench/sharding.py

Every figure is a ratio against DP measured in the same run. The 8 "devices" share this machine's
cores, so step time here shows the cost of FSDP's extra collectives, not a speed-up.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from slm.model.sizing import choose_shape, count_params  # noqa: E402
from slm.model.transformer import Transformer, init_params  # noqa: E402
from slm.optim.optimizer import make_optimizer  # noqa: E402
from slm.train.builder import compiled_memory  # noqa: E402
from slm.train.devices import data_mesh, device_bytes, shardings, state_shardings  # noqa: E402
from slm.train.step import init_state, make_train_step  # noqa: E402

SEQ, BATCH, STEPS = 128, 32, 8


def run(shape, mode: str, use_8bit: bool) -> dict:
    model, tx = Transformer(shape), make_optimizer(use_8bit=use_8bit)
    mesh = data_mesh(BATCH, strict=True)
    _, batch_sharding = shardings(mesh)
    abstract = jax.eval_shape(lambda: init_state(init_params(model, 0, SEQ), tx))
    sh = state_shardings(abstract, mesh, mode)
    state = jax.jit(lambda: init_state(init_params(model, 0, SEQ), tx), out_shardings=sh)()
    step = make_train_step(model, tx, sh, batch_sharding)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, shape.vocab_size, (STEPS + 1, BATCH, SEQ + 1)).astype(np.int32)
    batches = [jax.device_put({"input_ids": b[:, :-1], "targets": b[:, 1:]}, batch_sharding) for b in ids]
    mem = compiled_memory(step, state, batches[0], np.float32(1e-3))["peak"]
    state, m = step(state, batches[0], np.float32(1e-3))  # compile
    m["loss"].block_until_ready()
    losses, t0 = [], time.perf_counter()
    for b in batches[1:]:
        state, m = step(state, b, np.float32(1e-3))
        m["loss"].block_until_ready()  # one step in flight on multi-device CPU (devices.py)
        losses.append(float(m["loss"]))
    return {"state": device_bytes(state), "compiled": mem, "step_s": (time.perf_counter() - t0) / STEPS,
            "losses": losses}


def main() -> None:
    print(f"{len(jax.devices())} devices, seq {SEQ}, global batch {BATCH}, {STEPS} timed steps")
    print("| params | optimizer | DP state/device | FSDP state/device | ratio | XLA step memory/device FSDP/DP "
          "| step time FSDP/DP | max loss diff |")
    print("|---|---|---|---|---|---|---|---|")
    for target in (1_000_000, 10_000_000):
        shape = choose_shape(target, 4096)
        for use_8bit in (False, True):
            dp, fsdp = run(shape, "dp", use_8bit), run(shape, "fsdp", use_8bit)
            diff = max(abs(a - b) for a, b in zip(dp["losses"], fsdp["losses"]))
            print(f"| {count_params(shape) / 1e6:.2f}M | {'8-bit' if use_8bit else 'fp32'} AdamW "
                  f"| {dp['state'] / 2**20:.2f} MB | {fsdp['state'] / 2**20:.2f} MB | {fsdp['state'] / dp['state']:.3f} "
                  f"| {fsdp['compiled'] / dp['compiled']:.3f} ({fsdp['compiled'] / 2**20:.1f} / {dp['compiled'] / 2**20:.1f} MB) "
                  f"| {fsdp['step_s'] / dp['step_s']:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
