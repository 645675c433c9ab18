"""The LoRA memory arithmetic against XLA's own figure for the real train step, at abstract shapes.

    .venv/bin/python bench/lora_memory_xla.py [--models smollm2-135m,...] [--quick] [--base-dtype nf4]

For each config.json in ../shared/models/ (LoRA r16 on q_proj,v_proj, a bf16 (or --base-dtype) base, batch 1, remat, one
CPU device): slm.train.builder builds the trainer's LoRA StepSpec and compile_step compiles the jitted step
at jax.ShapeDtypeStruct shapes (nothing is allocated, so Mistral-7B compiles on a 24 GB machine) and
reads XLA's memory analysis (arguments + outputs + temporaries - donated). The estimate is
estimate_memory_usage(..., model=config, lora_rank=16, platform="cpu")'s device_total_mb. Rows: float32
compute at seq 256, bf16 compute at seq 256, and (the small models, unless --quick) float32 at seq 512.
Prints a markdown table with the ratio; the goal is within +-10%.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slm.memory.estimate import estimate_memory_usage
from slm.memory.finetune import model_shape

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b,tinyllama-1.1b,mistral-7b-v0.1")
    p.add_argument("--quick", action="store_true", help="seq 256 only")
    p.add_argument("--base-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16", "nf4", "full"),
                   help="the LoRA base's dtype, or full: full fine-tuning (Muon, float32 weights)")
    p.add_argument("--devices", type=int, default=1, help="host devices (one sequence each): the batch is this")
    p.add_argument("--sharding", default="dp", choices=("dp", "fsdp"))
    a = p.parse_args()
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
