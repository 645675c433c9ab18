"""--loss-chunk: the train step's memory (XLA's analysis) and speed with the loss over vocabulary chunks
(slm.model.loss) against the full (B, L, V) logits, in one sitting.

    .venv/bin/python bench/loss_chunk.py                                  # 10M and 30M params, seq 128, batch 32
    .venv/bin/python bench/loss_chunk.py --memory-only --hf-config ../shared/models/qwen2.5-0.5b/config.json \
        --seq-len 1024 --batch-size 2 --chunks 0,4096,16384                # a big vocabulary: compile only

The trainer's own step (slm.train.builder: StepSpec -> build -> compile_step, AdamW, one host device per core,
the batch split). For each model and chunk: the compiled step's peak bytes per device (arguments + outputs +
temporaries - aliased: nothing is allocated to read it), then (unless --memory-only) --rounds rounds in which
every variant runs --steps steps on one fixed batch, interleaved; each variant's median step time, and its
ratio to the full logits' (chunk 0) median, plus the first loss (the variants must agree to rounding).
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
import numpy as np  # noqa: E402

from slm.memory.host import MB  # noqa: E402
from slm.model.hf_config import shape_from_hf_config  # noqa: E402
from slm.model.lora import LoraSpec  # noqa: E402
from slm.model.matmul import default_matmul_precision  # noqa: E402
from slm.model.sizing import choose_shape, count_params, default_vocab_size  # noqa: E402
from slm.train.builder import StepSpec, build, compile_step, init_state, training_mesh  # noqa: E402


def variants(shape, args) -> list[dict]:
    out = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        lora = LoraSpec(args.lora_rank, 16.0, 0.0, ("q_proj", "v_proj")) if args.lora_rank else None
        spec = StepSpec(shape, args.seq_len, args.batch_size, mixed_precision=args.mixed_precision, lora=lora,
                        base_dtype="bfloat16" if lora else "float32", matmul=args.matmul_precision, loss_chunk=chunk)
        built = build(spec, training_mesh(args.batch_size, False))
        step, secs, peak_mb = compile_step(built)
        out.append({"chunk": chunk, "built": built, "step": step, "compile_s": secs, "peak_mb": peak_mb})
    return out


def timed(vs: list[dict], shape, args) -> None:
    ids = np.random.default_rng(0).integers(0, shape.vocab_size, (args.batch_size, args.seq_len + 1)).astype(np.int32)
    lr = np.float32(1e-4)
    for v in vs:
        split = v["built"].batch_sharding
        v["batch"] = {"input_ids": jax.device_put(ids[:, :-1], split), "targets": jax.device_put(ids[:, 1:], split)}
        v["state"] = init_state(v["built"])
        v["state"], m = v["step"](v["state"], v["batch"], lr)
        v["loss"], v["times"] = float(m["loss"]), []
    for _ in range(args.rounds):
        for v in vs:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                v["state"], m = v["step"](v["state"], v["batch"], lr)
                m["loss"].block_until_ready()
            v["times"].append((time.perf_counter() - t0) / args.steps)


def report(name: str, shape, vs: list[dict], args) -> None:
    base = vs[0]
    print(f"{name}: {count_params(shape) / 1e6:.2f}M params ({shape.n_layers}x{shape.d_model} V{shape.vocab_size}), "
          f"seq {args.seq_len}, batch {args.batch_size}, matmul {args.matmul_precision}"
          f"{', bf16 compute' if args.mixed_precision else ''}{f', LoRA rank {args.lora_rank}' if args.lora_rank else ''}")
    for v in vs:
        line = (f"  chunk {v['chunk']:>6}: XLA peak {v['peak_mb']:9,.1f} MB/device ({v['peak_mb'] - base['peak_mb']:+9,.1f})"
                f", compile {v['compile_s']:5.1f} s")
        if v.get("times"):
            med = statistics.median(v["times"])
            ratio = statistics.median(base["times"]) / med
            line += (f", step {med * 1e3:8.1f} ms (min-max {min(v['times']) * 1e3:.1f}-{max(v['times']) * 1e3:.1f}), "
                     f"{ratio:.3f}x chunk 0's speed, first loss {v['loss']:.5f}")
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1e7,3e7", help="--target-params values (ignored with --hf-config)")
    ap.add_argument("--vocab-size", type=int, default=None, help="with --sizes: this vocabulary (default: the trainer's)")
    ap.add_argument("--hf-config", default=None, help="a Hugging Face config.json: its shape, random init")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--chunks", default="0,1024,2048", help="the first is the baseline (0: the full logits)")
    ap.add_argument("--matmul-precision", default=default_matmul_precision(), choices=("float32", "bfloat16"))
    ap.add_argument("--mixed-precision", action="store_true")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA on q/v over a bf16 frozen base (0: full training)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--memory-only", action="store_true")
    args = ap.parse_args()
    if args.lora_rank and not args.memory_only:
        ap.error("--lora-rank needs --memory-only (the timed rounds build no frozen base)")
    print(f"loss_chunk: {time.strftime('%Y-%m-%d %H:%M')}, jax {jax.__version__}, {jax.device_count()} devices")
    if args.hf_config:
        with open(args.hf_config) as f:
            models = [(args.hf_config, shape_from_hf_config(json.load(f), args.hf_config))]
    else:
        models = [(f"{float(s):.0e}", choose_shape(int(float(s)), args.vocab_size or default_vocab_size(int(float(s)))))
                  for s in args.sizes.split(",")]
    for name, shape in models:
        vs = variants(shape, args)
        if not args.memory_only:
            timed(vs, shape, args)
        report(name, shape, vs, args)
        del vs


if __name__ == "__main__":
    main()
