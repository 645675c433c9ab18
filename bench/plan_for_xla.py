"""The device memory arithmetic against XLA's own figure for a GPU or TPU target, compiled on this CPU (--plan-for).

    .venv/bin/python bench/plan_for_xla.py sweep --target h100-80gb [--rows scratch,lora,qlora,full] [--models ...]
    .venv/bin/python bench/plan_for_xla.py sampler        # seed 002's QLoRA sampler on an A10G: before / after
    .venv/bin/python bench/plan_for_xla.py seed002        # seed 002's settings on an A10G 24 GB, and a 1B on v5e-8

`sweep`: each row is the trainer's train step for the target (slm.train.plan_for.compile_programs, the program
--plan-for compiles), against estimate_memory_usage(..., platform=the target's)'s device figure less its
runtime term (the CUDA context, which XLA's buffers do not hold). From scratch at 1M/10M/100M/350M/1B x seq
512/2048 (8 sequences a device, bf16 compute, the default optimizer), and LoRA r16 on q_proj,v_proj with a
bf16 base, QLoRA (nf4 base) and full fine-tunes (Muon) of every config.json in ../shared/models (1 sequence of
512 a device, remat, bf16 compute). On a several-device target, runs whose state does not fit one device are
FSDP. Prints a markdown table; the goal is within +-10% on every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slm.train.devices import import_jax_quietly  # noqa: E402

import_jax_quietly()

from slm.memory.targets import load_target  # noqa: E402
from slm.train.config import Config  # noqa: E402

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "models")
SCRATCH = (1_000_000, 10_000_000, 100_000_000, 350_000_000, 1_000_000_000)


def host() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def rows(kinds: list[str], models: list[str]) -> list[tuple[str, dict]]:
    out = []
    if "scratch" in kinds:
        out += [(f"{n // 1_000_000:,}M from scratch, seq {s}", dict(target_params=n, seq_len=s, batch_size=8))
                for n in SCRATCH for s in (512, 2048)]
    ft = dict(seq_len=512, batch_size=1, gradient_checkpointing=True)
    for m in models:
        folder = os.path.join(MODELS, m)
        if "lora" in kinds:
            out.append((f"{m} LoRA r16 q,v bf16 base", dict(init_from=folder, lora_rank=16, base_dtype="bfloat16", **ft)))
        if "qlora" in kinds:
            out.append((f"{m} QLoRA r16 q,v nf4 base", dict(init_from=folder, lora_rank=16, base_dtype="nf4", **ft)))
        if "full" in kinds:
            out.append((f"{m} full fine-tune", dict(init_from=folder, **ft)))
    return out


def estimate_device_mb(c: Config, shape, target) -> float:
    """--plan-for's planned figure less its runtime term (the CUDA context, which XLA's buffers do not hold)."""
    from slm.memory.finetune import GPU_RUNTIME_MB
    from slm.train.plan_for import planned_mb

    return planned_mb(c, shape, target) - (GPU_RUNTIME_MB if target.platform != "cpu" else 0.0)


def sweep(a: argparse.Namespace) -> None:
    from slm.train.aot import compile_only, target_devices
    from slm.train.devices import start_backend
    from slm.model.sizing import count_params
    from slm.train.plan_for import compile_programs, plan_shape, resolved_for

    start_backend()
    target = load_target(a.target)
    devices = target_devices(target)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {host()}, target {target.name} ({target.count} x "
          f"{target.facts['device']})\n")
    print("| run | params | sharding | estimate MB | XLA MB | estimate / XLA | compile s |")
    print("|---|---|---|---|---|---|---|")
    worst = (0.0, "")
    for name, kw in rows(a.rows.split(","), a.models.split(",")):
        c = Config(use_streaming=True, plan_for=target.name, use_mixed_precision=True, **kw)
        c = dataclasses.replace(c, batch_size=c.batch_size * target.count)
        shape = plan_shape(c)
        c = resolved_for(c, shape, target.platform)
        est = estimate_device_mb(c, shape, target)
        if target.count > 1 and est > 0.8 * target.usable_mb()[0]:
            c = dataclasses.replace(c, sharding="fsdp")
            est = estimate_device_mb(c, shape, target)
        t0 = time.time()
        with compile_only():
            _, xla, note, _ = compile_programs(c, shape, devices, target, train_only=True)[0]
        if xla is None or xla != xla or xla == float("inf"):
            print(f"| {name} | {count_params(shape) / 1e6:,.0f}M | {c.sharding} | {est:,.0f} | - ({note}) | - | "
                  f"{time.time() - t0:.0f} |", flush=True)
            continue
        ratio = est / xla
        worst = max(worst, (abs(ratio - 1), name))
        print(f"| {name} | {count_params(shape) / 1e6:,.0f}M | {c.sharding} | {est:,.0f} | {xla:,.0f} | {ratio:.3f} "
              f"({(ratio - 1) * 100:+.1f}%) | {time.time() - t0:.0f} |", flush=True)
    print(f"\nworst row: {worst[1]} ({worst[0] * 100:.1f}% off)")


def sampler(a: argparse.Namespace) -> None:
    """Seed 002's QLoRA run on an A10G: the sampler's peak as it was (the whole NF4 base dequantised to float32
    and the adapters folded in outside jit, then a plain float32-kernel decoder) against now (the decoder applies
    the codes and the adapters as held), and the eval step's (unchanged: it always applied the codes)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, SingleDeviceSharding

    from slm.model.generate import Decoder
    from slm.model.nf4 import dequantize_params
    from slm.model.transformer import Transformer
    from slm.train.aot import compile_only, target_devices
    from slm.train.builder import StepSpec, build
    from slm.train.devices import start_backend
    from slm.train.builder import compiled_peak as program_peak
    from slm.train.plan_for import MB, compile_programs, device_bytes, plan_shape, resolved_for

    start_backend()
    target = load_target("a10g-24gb")
    devices = target_devices(target)
    c = Config(use_streaming=True, plan_for=target.name, init_from=os.path.join(MODELS, "mistral-7b-v0.1"),
               lora_rank=16, base_dtype="nf4", seq_len=256, batch_size=1, gradient_accumulation_steps=16,
               gradient_checkpointing=True, use_mixed_precision=True)
    shape = plan_shape(c)
    c = resolved_for(c, shape, "gpu")
    one = SingleDeviceSharding(devices[0])
    with compile_only():
        now = {r[0]: r[1] for r in compile_programs(c, shape, devices, target)}
        built = build(dataclasses.replace(StepSpec.from_config(c, shape), platform="gpu"),
                      Mesh(np.array(devices), ("data",)))
        resident = device_bytes(built.abstract) + device_bytes(built.base_abstract)
        # before: every block kernel dequantised to float32 (fold then added the adapters into them), the other
        # leaves (embeddings, norms) shared with the resident base
        dense = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                             jax.eval_shape(lambda b: dequantize_params(b, shape), built.base_abstract))
        shared = device_bytes({k: v for k, v in built.base_abstract.items() if not k.startswith("block_")})
        prefill, step = Decoder(Transformer(shape, dtype=built.model.dtype, platform="gpu")).compiled(
            dense, 1, 1, c.seq_len - 1, 40)
        before = {name: (program_peak(x) + resident - shared) / MB
                  for name, x in (("sample prefill", prefill), ("sample decode step", step))}
    usable = target.usable_mb()[0]
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {host()}: Mistral-7B QLoRA (seed 002's final settings, nf4 base) on "
          f"{target.name}; a program may use {usable:,.0f} MB, a verdict keeps 10% free\n")
    print("| program | before: float32 copy of the base, MB | now, MB | fits, before / now |")
    print("|---|---|---|---|")
    for name in ("eval step", "sample prefill", "sample decode step"):
        b = before.get(name, now[name])
        print(f"| {name} | {b:,.0f} | {now[name]:,.0f} | {b <= 0.9 * usable} / {now[name] <= 0.9 * usable} |")


FIT_SHAPES = ((2, 128, 4, 344, 2048), (4, 128, 2, 344, 8192), (2, 256, 8, 688, 2048), (4, 256, 4, 688, 4096),
              (3, 192, 6, 512, 4096))  # layers, width, heads, MLP width, vocab
FIT_TOKENS = ((8, 256), (4, 1024), (16, 512), (2, 2048))  # micro-batch, seq


def relative_nnls(X, y):
    """Non-negative coefficients minimising the relative errors' squares: least squares on X / y against 1,
    dropping the most negative coefficient until none is (an active-set loop; a handful of columns)."""
    import numpy as np

    A, keep = X / y[:, None], list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        coef[keep] = np.linalg.lstsq(A[:, keep], np.ones(len(y)), rcond=None)[0]
        if coef.min() >= 0:
            return coef
        keep.remove(int(np.argmin(coef)))


def fit(a: argparse.Namespace) -> None:
    """The activation coefficients (a, b, c, e, k) of slm.memory.estimate for one target's compiler: XLA's peak
    of the from-scratch train step (AdamW, one device) less the state's 16N bytes, fitted by relative least
    squares over 5 shapes x 4 token counts, for each (remat, mixed precision); k is a constant (workspaces)."""
    import numpy as np
    from jax.sharding import Mesh

    from slm.memory.finetune import CHUNKED_BYTES_PER_D
    from slm.model.sizing import ModelShape, count_params, logit_columns
    from slm.train.aot import compile_only, target_devices
    from slm.train.builder import StepSpec, build, compile_step
    from slm.train.devices import start_backend
    from slm.train.builder import compiled_peak as program_peak

    start_backend()
    target = load_target(a.target)
    mesh = Mesh(np.array(target_devices(target)[:1]), ("data",))
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {host()}, target {target.name}")
    for remat in (False, True):
        for mixed in (False, True):
            if a.only and a.only != f"{remat},{mixed}":
                continue
            X, y = [], []
            for L, D, H, F, V in FIT_SHAPES:
                shape = ModelShape(vocab_size=V, n_layers=L, d_model=D, n_heads=H, d_ff=F)
                for B, S in FIT_TOKENS:
                    spec = StepSpec(shape, S, B, 1, mixed, remat, optimizer="adamw", platform=target.platform)
                    with compile_only():
                        peak = program_peak(compile_step(build(spec, mesh))[0])
                    T, cols = B * S, logit_columns(V, None, target.platform)
                    X.append([T * L * D, T * L * F, T * L * H * S, T * (cols + (CHUNKED_BYTES_PER_D * D / cols
                                                                                 if cols < V else 0)), 1.0])
                    y.append(peak - 16 * count_params(shape))
                    if a.verbose:
                        print(f"  L{L} D{D} H{H} F{F} V{V} B{B} S{S}: XLA {peak / 2**20:,.1f} MB, beyond the state "
                              f"{y[-1] / 2**20:,.1f} MB", flush=True)
            X, y = np.array(X, float), np.array(y, float)
            coef = relative_nnls(X, y)
            err = X @ coef / y - 1
            print(f"(remat {remat}, mixed {mixed}): ActivationCoefficients({', '.join(f'{c:.2f}' for c in coef[:4])}, "
                  f"{coef[4] / 2**20:.1f} * MB) "
                  f"worst {np.abs(err).max() * 100:.1f}% over {len(y)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sweep")
    s.add_argument("--target", default="h100-80gb")
    s.add_argument("--rows", default="scratch,lora,qlora,full")
    s.add_argument("--models", default=",".join(sorted(m for m in os.listdir(MODELS) if os.path.isdir(
        os.path.join(MODELS, m)))) if os.path.isdir(MODELS) else "")
    sub.add_parser("sampler")
    f = sub.add_parser("fit")
    f.add_argument("--target", default="h100-80gb")
    f.add_argument("--verbose", action="store_true")
    f.add_argument("--only", default="", help="e.g. False,True: one (remat, mixed) pair")
    a = p.parse_args()
    {"sweep": sweep, "sampler": sampler, "fit": fit}[a.what](a)


if __name__ == "__main__":
    main()
