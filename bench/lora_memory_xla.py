"""The LoRA memory arithmetic against XLA's own figure for the real train step, at abstract shapes.

    .venv/bin/python bench/lora_memory_xla.py [--models smollm2-135m,...] [--quick] [--base-dtype nf4]

For each config.json in ../shared/models/ (LoRA r16 on q_proj,v_proj, a bf16 (or --base-dtype) base, batch 1, remat, one
CPU device): slm.train.builder builds the trainer's LoRA StepSpec and compile_step compiles the jitted step
at jax.ShapeDtypeStruct shapes (nothing is allocated, so Mistral-7B compiles on a 24 GB machine) and
reads XLA's memory analysis (arguments + outputs + temporaries - donated). The estimate is
estimate_memory_usage(..., model=config, lora_rank=16, platform="cpu")'s device_total_mb. Rows: float32
compute at seq 256, bf16 compute at seq 256, and (the small models, unless --quick) float32 at seq 512.
Prints a markdown table with the ratio; the goal is within +-10%.

    .venv/bin/python bench/lora_memory_xla.py --fit scratch   # refit slm.memory.estimate's COEFFICIENTS (160 compiles)
    .venv/bin/python bench/lora_memory_xla.py --fit lora [--attention-only]   # LORA_COEFFICIENTS (64 compiles)

`--fit`: slm.memory's activation coefficients (a, b, c, e, t) fitted to XLA:CPU's peak of the trainer's own step
(build + compile_step at abstract shapes; AdamW from scratch: 5 shapes x 4 batch/seq up to seq 2,048, x remat x
mixed precision x 1/2 host devices; LoRA r16 on q_proj,v_proj over a bf16 base: 4 config.json shapes at 2
layers x seq 256/512 x batch 1/2). What they explain is that peak less every other term of
slm.memory.estimate.device_breakdown at the same setting; the columns are tokens x layers x D, x F, x H x
visible_keys(seq) (blocked causal attention, slm.model.attention), tokens x logit columns, and one attention
block's scores (a transient). Relative least squares, non-negative; prints each key's coefficients and worst
error; rows where the optimizer update is the estimate's peak are left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
from plan_for_xla import FIT_SHAPES, FIT_TOKENS, relative_nnls  # bench/, beside this script

from slm.memory.estimate import MB, device_breakdown, estimate_memory_usage
from slm.memory.finetune import Finetune, backward_bytes, model_shape
from slm.model.sizing import ModelShape, attention_block, logit_columns, visible_keys

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "models")
SMALL = ("smollm2-135m", "qwen2.5-0.5b")


def xla_mb(config: str, seq: int, batch: int, mixed: bool, targets: tuple[str, ...],
           base_dtype: str = "bfloat16", devices: int = 1, sharding: str = "dp") -> tuple[float, float]:
    """(XLA's peak MB per device, compile seconds) of the trainer's LoRA step for this config; base_dtype
    "full": full fine-tuning with the trainer's default optimizer for it (Muon)."""
    from slm.model.lora import LoraSpec
    from slm.train.builder import StepSpec, build, compile_step
    from slm.train.devices import data_mesh

    if base_dtype == "full":
        spec = StepSpec(model_shape(config), seq, batch, 1, mixed, True, sharding=sharding, optimizer="muon")
    else:
        spec = StepSpec(model_shape(config), seq, batch, 1, mixed, True, sharding=sharding,
                        lora=LoraSpec(16, 32.0, 0.0, targets), base_dtype=base_dtype)
    built = build(spec, data_mesh(batch, max_devices=devices))
    _, secs, peak = compile_step(built)
    return peak, secs


LORA_MODELS = ("smollm2-135m", "qwen2.5-0.5b", "tinyllama-1.1b", "mistral-7b-v0.1")
LORA_TOKENS = ((1, 256), (2, 256), (1, 512), (2, 512))


def row(shape: ModelShape, batch: int, seq: int, devices: int, remat: bool, mixed: bool, lora: bool):
    """(X row, y) of one compiled step, or None when the update phase is the estimate's peak."""
    from slm.model.lora import LoraSpec
    from slm.train.builder import StepSpec, build, compile_step
    from slm.train.devices import data_mesh

    spec = StepSpec(shape, seq, batch, 1, mixed, remat, optimizer="adamw",
                    lora=LoraSpec(16, 32.0, 0.0, ("q_proj", "v_proj")) if lora else None,
                    base_dtype="bfloat16" if lora else "float32")
    _, _, xla_mb = compile_step(build(spec, data_mesh(batch, max_devices=devices)))
    ft = Finetune(16, ("q_proj", "v_proj"), "bfloat16") if lora else None
    est = device_breakdown(shape, seq, batch // devices, mixed_precision=mixed, gradient_checkpointing=remat,
                           devices=devices, finetune=ft, optimizer="adamw")
    if est["update"] > est["activations"] + est["logits"]:
        return None
    T, L, D, H = batch // devices * seq, shape.n_layers, shape.d_model, shape.n_heads
    cols = logit_columns(shape.vocab_size, None, "cpu")
    # the terms with no coefficient: chunked loss, q/k norms, Gemma's block
    fixed = sum(backward_bytes(shape, T, seq, (0.0,) * 5, compute_bytes=2 if mixed else 4))
    rest = est["total"] - est["activations"] - est["logits"]
    block = batch // devices * H * attention_block(seq) * seq  # one block's scores, not kept: a transient
    return [T * L * D, T * L * shape.d_ff, T * L * H * visible_keys(seq), T * cols, block], xla_mb * MB - rest - fixed


def rows_of(kind: str, remat: bool, mixed: bool, devices: int):
    if kind == "scratch":
        for L, D, H, F, V in FIT_SHAPES:
            for B, S in FIT_TOKENS:
                yield ModelShape(vocab_size=V, n_layers=L, d_model=D, n_heads=H, d_ff=F), B * devices, S
    else:
        for name in LORA_MODELS:
            full = model_shape(os.path.join(MODELS, name))
            for B, S in LORA_TOKENS:
                yield dataclasses.replace(full, n_layers=2), B, S


def current(kind: str, remat: bool, mixed: bool, devices: int) -> tuple[float, ...]:
    from dataclasses import astuple

    from slm.memory.estimate import COEFFICIENTS
    from slm.memory.finetune import LORA_COEFFICIENTS

    if kind == "lora":
        return LORA_COEFFICIENTS[(remat, mixed)]
    return astuple(COEFFICIENTS[(remat, mixed, devices > 1)])


def fit(a: argparse.Namespace) -> None:
    from slm.train.devices import start_backend

    start_backend()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}: {a.fit}", flush=True)
    for devices in ((1, 2) if a.fit == "scratch" else (1,)):
        for remat in (False, True):
            for mixed in (False, True):
                if a.only and a.only != f"{remat},{mixed},{devices}":
                    continue
                got, labels = [], []  # the rows kept, each with its label
                for shape, B, S in rows_of(a.fit, remat, mixed, devices):
                    g = row(shape, B, S, devices, remat, mixed, a.fit == "lora")
                    if g is not None:
                        got.append(g)
                        labels.append(f"L{shape.n_layers} D{shape.d_model} H{shape.n_heads} V{shape.vocab_size} B{B} S{S}")
                X, y = np.array([g[0] for g in got], float), np.array([g[1] for g in got], float)
                if a.attention_only:  # today's a, b, e kept: only the attention's two columns refitted
                    keep = np.array(current(a.fit, remat, mixed, devices)[:4])[[0, 1, 3]]
                    known = X[:, [0, 1, 3]] @ keep
                    ct = relative_nnls(X[:, [2, 4]], y - known)
                    coef = np.array([keep[0], keep[1], ct[0], keep[2], ct[1]])
                else:
                    coef = relative_nnls(X, y)
                err = X @ coef / y - 1
                if a.verbose:
                    for label, e in zip(labels, err):  # only the kept rows: each label stays with its row
                        print(f"   {label}: {e * 100:+.1f}%")
                print(f"(remat {remat}, mixed {mixed}, devices {devices}): ({', '.join(f'{c:.2f}' for c in coef)}) "
                      f"worst {np.abs(err).max() * 100:.1f}% over {len(y)} rows", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b,tinyllama-1.1b,mistral-7b-v0.1")
    p.add_argument("--quick", action="store_true", help="seq 256 only")
    p.add_argument("--base-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16", "nf4", "full"),
                   help="the LoRA base's dtype, or full: full fine-tuning (Muon, float32 weights)")
    p.add_argument("--devices", type=int, default=1, help="host devices (one sequence each): the batch is this")
    p.add_argument("--sharding", default="dp", choices=("dp", "fsdp"))
    p.add_argument("--fit", choices=("scratch", "lora"), help="refit the activation coefficients instead")
    p.add_argument("--attention-only", action="store_true",
                   help="with --fit: keep today's a, b, e; refit only the attention's c and the block transient")
    p.add_argument("--only", help="with --fit: one key, e.g. False,True,1 (remat, mixed, devices)")
    p.add_argument("--verbose", action="store_true", help="with --fit: each row's error")
    a = p.parse_args()
    if a.fit:  # two host devices for the partitioned rows, before jax starts
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
        return fit(a)
    if a.devices > 1:  # before jax starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}")
    targets = ("q_proj", "v_proj")
    print("| model | params | seq | batch | compute | estimate MB | XLA MB | estimate / XLA | compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.models.split(","):
        config = os.path.join(MODELS, name, "config.json")
        runs = [(256, False), (256, True)] + ([(512, False)] if name in SMALL and not a.quick else [])
        for seq, mixed in runs:
            lora = {} if a.base_dtype == "full" else {"lora_rank": 16, "lora_targets": targets, "base_dtype": a.base_dtype}
            est = estimate_memory_usage(0, seq, a.devices, model=config, gradient_checkpointing=True,
                                        mixed_precision=mixed, devices=a.devices, sharding=a.sharding,
                                        optimizer="muon" if a.base_dtype == "full" else None, **lora)
            t = time.time()
            xla, secs = xla_mb(config, seq, a.devices, mixed, targets, a.base_dtype, a.devices, a.sharding)
            ratio = est["device_total_mb"] / xla
            print(f"| {name} | {est['model_params'] / 1e6:,.0f}M | {seq} | {a.devices} | {'bf16' if mixed else 'float32'} | "
                  f"{est['device_total_mb']:,.0f} | {xla:,.0f} | {ratio:.3f} ({(ratio - 1) * 100:+.1f}%) | "
                  f"{secs or time.time() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
