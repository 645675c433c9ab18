"""Tokens/s of every --auto-fit candidate, timed: the ground truth the fitter's speed model is checked against.

    .venv/bin/python bench/fit_speed.py --target-params 20000000 --seq-len 256 --batch-size 64
    .venv/bin/python bench/fit_speed.py --target-params 50000000 --seq-len 256 --batch-size 32 --budget 3GB
    .venv/bin/python bench/fit_speed.py ... --micro 1,2,4 --remat 0 --eight 0,1 --json out.jsonl
    .venv/bin/python bench/fit_speed.py ... --budget 2GB --frontier    # the fitter's choice against the fastest

For one model and effective batch, each setting (micro-batch, host devices, remat, 8-bit state) is built by the
trainer's own builder (slm.train.builder: the default optimizer, matmul precision and loss chunk), compiled,
and run on random tokens: one warm-up micro-step, then the median of `--repeats` micro-steps. A micro-step's
time times the accumulation is an optimizer step (the update, once per step, is left out: at accumulation 1
it is in every micro-step). With --budget, only the settings slm.memory.estimate predicts to fit are timed,
and the fitter's speed model's figure is printed beside each measured one with the fitter's choice marked.
"""

from __future__ import annotations

import argparse
import json
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

from slm.memory.estimate import fit_candidates, parse_size  # noqa: E402
from slm.memory.host import release_free_heap  # noqa: E402
from slm.model.matmul import default_matmul_precision  # noqa: E402
from slm.model.sizing import choose_shape, count_params, default_loss_chunk, default_vocab_size  # noqa: E402
from slm.train.builder import StepSpec, build, compile_step, init_state  # noqa: E402
from slm.train.devices import data_mesh, global_batch  # noqa: E402


def time_setting(shape, seq: int, micro: int, devices: int, acc: int, remat: bool, eight: bool,
                 repeats: int, mixed: bool = False) -> dict:
    """Median micro-step seconds of one setting, and the tokens/s that makes."""
    spec = StepSpec(shape, seq, micro, acc, mixed_precision=mixed, remat=remat, use_8bit=eight, optimizer="muon",
                    matmul=default_matmul_precision())
    built = build(spec, data_mesh(micro, max_devices=devices))
    t0 = time.perf_counter()
    compiled, compile_s, xla_mb = compile_step(built)
    state = init_state(built)
    rng = np.random.default_rng(0)
    times = []
    for i in range(repeats + 1):
        ids = rng.integers(0, shape.vocab_size, (micro, seq), dtype=np.int32)
        batch = global_batch({"input_ids": ids, "targets": ids}, built.batch_sharding)
        t = time.perf_counter()
        state, metrics = compiled(state, batch, np.float32(1e-4))
        metrics["loss"].block_until_ready()
        if i:
            times.append(time.perf_counter() - t)
    del state, compiled
    release_free_heap()
    med = statistics.median(times)
    return {"micro": micro, "devices": devices, "acc": acc, "remat": remat, "eight": eight, "mixed": mixed,
            "micro_step_s": med, "tokens_per_s": micro * seq / med, "xla_mb": xla_mb,
            "compile_s": compile_s, "wall_s": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-params", type=int, required=True)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64, help="the effective batch (sequences per optimizer step)")
    p.add_argument("--budget", help="time only what the estimate fits in this budget (e.g. 3GB)")
    p.add_argument("--micro", help="micro-batches to time (default: every divisor of the batch)")
    p.add_argument("--devices", default="1,2")
    p.add_argument("--remat", default="0,1")
    p.add_argument("--eight", default="0,1")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="append each result as a JSON line here")
    p.add_argument("--short", action="store_true", help="with --budget: the run ends before its first save")
    p.add_argument("--frontier", action="store_true", help="with --budget: per micro-batch and device count, time "
                   "only the fitting variant with the fewest of remat and 8-bit on (each only slows a step)")
    a = p.parse_args()
    shape = choose_shape(a.target_params, default_vocab_size(a.target_params))
    eff = a.batch_size
    micros = [int(m) for m in a.micro.split(",")] if a.micro else [d for d in range(1, eff + 1) if eff % d == 0]
    ints = lambda s: [bool(int(x)) for x in s.split(",")]  # noqa: E731
    settings = [(m, d, r, e) for m in micros for d in map(int, a.devices.split(",")) if m % d == 0
                for r in ints(a.remat) for e in ints(a.eight) if d <= len(jax.devices())]
    model, chosen = {}, None
    if a.budget:
        found = fit_candidates(shape, a.seq_len, eff, 1, parse_size(a.budget), max_devices=len(jax.devices()),
                               platform="cpu", data_mb=10.0, optimizer="muon", saves_beside_steps=not a.short,
                               loss_chunk=default_loss_chunk(shape.vocab_size, "cpu", default_matmul_precision()))
        model = {}
        for c in found:  # per setting the fastest-predicted variant that fits (its save mode, loss chunk)
            if not c["use_mixed_precision"]:
                model.setdefault((c["batch_size"], c["devices"], c["gradient_checkpointing"], c["use_8bit_optimizer"]), c)
        settings = [s for s in settings if s in model]
        if a.frontier:  # per (micro-batch, devices) only the variant with the fewest slow levers on
            best = {}
            for m, d, r, e in sorted(settings, key=lambda s: (s[2], s[3])):  # remat off, 8-bit off first
                best.setdefault((m, d), (m, d, r, e))
            settings = sorted(best.values())
        chosen = next((c for c in found), None)
        if chosen and chosen["use_mixed_precision"]:  # timed too: bf16 activations, whatever the model says
            settings.append((chosen["batch_size"], chosen["devices"], chosen["gradient_checkpointing"],
                             chosen["use_8bit_optimizer"], True))
        print(f"[fit] {len(found)} settings fit {a.budget}; the fitter chooses {chosen}")
    print(f"{count_params(shape):,} params, seq {a.seq_len}, effective batch {eff}, {len(settings)} settings")
    for m, d, r, e, *x in settings:
        res = time_setting(shape, a.seq_len, m, d, eff // m, r, e, a.repeats, bool(x and x[0]))
        pred = chosen if x else model.get((m, d, r, e))
        res.update(params=a.target_params, seq=a.seq_len, batch=eff, host=jax.devices()[0].device_kind,
                   budget=a.budget, model_speed=pred["speed"] if pred else None,
                   chosen=bool(a.budget) and chosen is not None and (m, d, r, e, bool(x)) == (
                       chosen["batch_size"], chosen["devices"], chosen["gradient_checkpointing"],
                       chosen["use_8bit_optimizer"], chosen["use_mixed_precision"]))
        extra = f" | model speed {pred['speed']:.3f}, peak {pred['predicted_peak_mb']:,.0f} MB" if pred else ""
        print(f"micro {m:>3} x acc {eff // m:>3} on {d} dev remat {int(r)} 8bit {int(e)}{' bf16' if x else ''}: "
              f"{res['tokens_per_s']:8,.0f} tok/s ({res['micro_step_s'] * 1e3:,.0f} ms/micro-step, "
              f"XLA {res['xla_mb']:,.0f} MB/dev, compile {res['compile_s']:.0f}s){extra}"
              f"{'  <- the fitter chose this' if res['chosen'] else ''}", flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
