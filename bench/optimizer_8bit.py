"""8-bit vs float32 AdamW: the jitted train step's state bytes, compiled memory and step time; --loss: held-out loss.

    .venv/bin/python bench/optimizer_8bit.py                     # 1M and 10M targets, seq 128, batch 32
    .venv/bin/python bench/optimizer_8bit.py --targets 10000000 --reps 5
    .venv/bin/python bench/optimizer_8bit.py --loss              # 0.8M params, 400 steps, seeds 0 1 2
    .venv/bin/python bench/optimizer_8bit.py --loss --steps 200 --seeds 0,1

Default (step) mode. For each target size (model_sizing.choose_shape, default vocab) and each optimizer
(train_step.make_optimizer with use_8bit off/on, accumulation 1, the same clip / weight decay / non-finite
guard as the trainer):
- optimizer-state bytes (sum of the arrays' nbytes) and bytes per parameter, and the 8-bit/fp32 ratio;
- the fraction of parameters whose moments are 8-bit;
- the compiled step's XLA memory analysis: arguments + outputs + temporaries - aliased (donated) bytes;
- step time: best of --reps windows of >= --window s each, the two optimizers alternating so both
  see the same machine state; overhead = 8-bit / fp32 - 1 (goal <= 10% at 10M).
About 1.5 min at the defaults on 2 cores.

--loss mode: held-out loss with float32 vs 8-bit AdamW state on tinyshakespeare, with seeds and a negative
control. Runs the trainer (train_optimized.train, all defaults but --target-params, --steps, --seeds) once per
seed with float32 moments and once with --use-8bit-optimizer, plus once with the 8-bit state on *linear* code
maps (the paper's failing map, patched in for this process only) as a negative control. A fixed --max-steps
keeps the runs comparable (a --max-time budget would give the slower optimizer fewer steps).
Pass criterion (issue 3): |mean 8-bit - mean fp32| <= max(1% of fp32, 2 x the fp32 seed-to-seed spread),
where spread = max - min of the fp32 seeds. The linear control should fail it. Seven trainer runs at the
defaults: ~10-15 min on 2 cores (estimated; 20-step runs take ~17 s each).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loss", action="store_true", help="measure held-out loss over seeds instead of the step")
    step = p.add_argument_group("step mode (default)")
    step.add_argument("--targets", default="1000000,10000000", help="comma list of --target-params values")
    step.add_argument("--seq-len", type=int, default=128)
    step.add_argument("--batch-size", type=int, default=32)
    step.add_argument("--window", type=float, default=4.0, help="seconds per timing window")
    step.add_argument("--reps", type=int, default=3, help="timing windows per optimizer (best kept)")
    step.add_argument("--cpu-devices", type=int, default=None, help="host devices (default: as the trainer)")
    loss = p.add_argument_group("--loss mode")
    loss.add_argument("--target-params", type=int, default=800_000)
    loss.add_argument("--steps", type=int, default=400)
    loss.add_argument("--seeds", default="0,1,2")
    loss.add_argument("--arms", default="fp32,8bit,linear",
                      help="comma list of: fp32, 8bit, linear (negative control), stable-embedding (8-bit, embedding state fp32)")
    return p.parse_args(argv)


def step_bench(args: argparse.Namespace) -> None:
    """State bytes, 8-bit coverage, compiled peak and ms/step of fp32 vs 8-bit AdamW per target size."""
    from slm.train.devices import configure_cpu_devices, data_mesh, needs_step_sync, shardings

    configure_cpu_devices(args.cpu_devices)  # before jax's backend starts
    import jax
    import numpy as np

    from slm.model.sizing import choose_shape, count_params, default_vocab_size, describe
    from slm.model.transformer import Transformer, init_params
    from slm.optim.adam8bit import quantized_fraction, state_bytes
    from slm.optim.optimizer import make_optimizer
    from slm.train.builder import compiled_memory
    from slm.train.step import init_state, make_train_step

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


def loss_bench(args: argparse.Namespace) -> None:
    """Held-out loss of the trainer with fp32 / 8-bit state over seeds, the controls, and the pass bound."""
    import jax

    import slm.optim.adam8bit as adam8bit
    import slm.optim.optimizer as optimizer
    from train_optimized import Config, train

    seeds = [int(s) for s in args.seeds.split(",")]
    tmp = tempfile.mkdtemp(prefix="opt8_")

    def run(tag: str, seed: int, eight: bool) -> float:
        c = Config(use_streaming=True, dataset_id=os.path.join(DATA, "tinyshakespeare_train.txt"),
                   eval_dataset_id=os.path.join(DATA, "tinyshakespeare_val.txt"), target_params=args.target_params,
                   max_steps=args.steps, seed=seed, use_8bit_optimizer=eight, eval_every=10**9, log_every=50,
                   output_dir=os.path.join(tmp, f"{tag}-{seed}"))
        s = train(c, log=lambda *_: None)
        print(f"| {tag} | {seed} | {s['eval_loss']:.4f} | {s['eval_bpb']:.4f} | {s['optimizer_state_bytes']:,} "
              f"| {s['tokens_per_sec']:,.0f} | {s['stop_reason']} |", flush=True)
        return s["eval_loss"]

    print(f"tinyshakespeare, --target-params {args.target_params:,}, --max-steps {args.steps}, other flags default")
    print("| optimizer | seed | eval loss | eval bpb | state bytes | tok/s | stop |")
    print("|---|---|---|---|---|---|---|")
    arms = args.arms.split(",")
    fp32 = [run("fp32", s, False) for s in seeds]
    results = {}
    if "8bit" in arms:
        results["8-bit"] = [run("8-bit", s, True) for s in seeds]
    if "stable-embedding" in arms:  # the reference keeps the embedding's state in fp32: does this model need it?
        plain = optimizer.scale_by_adam_8bit  # the trainer's optimizer chain takes it from there
        optimizer.scale_by_adam_8bit = functools.partial(plain, keep_fp32=lambda path, p: "embed" in jax.tree_util.keystr(path))
        try:
            results["8-bit, fp32 embedding state"] = [run("8-bit, fp32 embedding state", s, True) for s in seeds]
        finally:
            optimizer.scale_by_adam_8bit = plain
    if "linear" in arms:
        signed_dynamic = adam8bit.dynamic_map
        adam8bit.dynamic_map = lambda signed, zero_free=False: adam8bit.linear_map(signed)  # negative control
        try:
            results["8-bit linear map"] = [run("8-bit linear map", seeds[0], True)]
        finally:
            adam8bit.dynamic_map = signed_dynamic
    print_verdicts(fp32, results)


def print_verdicts(fp32: list[float], results: dict[str, list[float]]) -> None:
    """Each arm's mean loss against fp32's, and PASS/FAIL against max(1% of fp32, 2 x the fp32 seed spread)."""
    spread = max(fp32) - min(fp32)
    mean = statistics.mean
    bound = max(0.01 * mean(fp32), 2 * spread)
    for tag, xs in results.items():
        gap = mean(xs) - mean(fp32)
        print(f"{tag}: mean {mean(xs):.4f} vs fp32 {mean(fp32):.4f} (spread {spread:.4f}): gap {gap:+.4f}, "
              f"bound {bound:.4f} -> {'PASS' if abs(gap) <= bound else 'FAIL'}")


def main() -> None:
    args = parse_args()
    if args.loss:
        loss_bench(args)
    else:
        step_bench(args)


if __name__ == "__main__":
    main()
