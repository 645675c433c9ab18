"""Peak host memory while loading a pretrained checkpoint with --init-from's loader (issue 15).

    .venv/bin/python bench/load_pretrained.py                 # a ~110M-parameter Llama saved in bfloat16
    .venv/bin/python bench/load_pretrained.py --dtype float32 --layers 8
    .venv/bin/python bench/load_pretrained.py --base-dtype bfloat16   # a LoRA base, held in bfloat16
    .venv/bin/python bench/load_pretrained.py --base-dtype nf4        # a QLoRA base: against the bf16 base's size

Saves a random LlamaForCausalLM with transformers (safetensors, --dtype) to a temp dir, then in a fresh
subprocess imports jax, records RSS, resets the kernel's peak-RSS counter (VmHWM), and loads it as the trainer does
(slm.train.builder.load_pretrained: each tensor read, hashed, converted to the held dtype and put on the device
as its layer is assembled; the train state built from them afterwards is not counted). Prints the peak RSS
growth during the load over the weights' bytes in the dtype they are held in. Goal: <= 1.3x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, sys, time
import jax
import numpy as np
from slm.memory.host import rss_mb


def peak_rss_mb():  # VmHWM, which clear_refs resets (getrusage's maximum is not reset)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
from slm.train.builder import load_pretrained
jax.numpy.zeros(1).block_until_ready()
base = rss_mb()
with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM): start-up peaks higher than it ends
    f.write("5")
t = time.perf_counter()
shape, params, digest, _ = load_pretrained(sys.argv[1], sys.argv[2])
jax.block_until_ready(params)
s = time.perf_counter() - t
n = sum(x.size for x in jax.tree.leaves(params))
held = sum(x.nbytes for x in jax.tree.leaves(params))
print(json.dumps({"params": int(n), "held_mb": held / 2**20, "seconds": s, "base_mb": base, "peak_mb": peak_rss_mb(), "after_mb": rss_mb()}))
"""


def save_model(out: str, layers: int, dtype: str) -> int:
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                      num_hidden_layers=layers, num_attention_heads=12, num_key_value_heads=4,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="the file's")
    ap.add_argument("--base-dtype", default="float32", choices=("bfloat16", "float16", "float32", "nf4"),
                    help="the dtype the weights are held in (float32: full fine-tuning; lower: a LoRA base; nf4: "
                         "QLoRA's, measured against the base's size in bfloat16, the issue's yardstick)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        n = save_model(tmp, args.layers, args.dtype)
        file_mb = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp)) / 2**20
        out = subprocess.run([sys.executable, "-c", CHILD, tmp, args.base_dtype], capture_output=True, text=True, cwd=ROOT,
                             check=True, env={**os.environ, "PYTHONPATH": ROOT})
    r = json.loads(out.stdout.strip().splitlines()[-1])
    weights_mb = (n if args.base_dtype == "nf4" else r["params"]) * (4 if args.base_dtype == "float32" else 2) / 2**20
    growth = r["peak_mb"] - r["base_mb"]
    print(f"model: {n / 1e6:.1f}M parameters, {file_mb:.0f} MB of {args.dtype} safetensors; "
          f"{weights_mb:.0f} MB as {args.base_dtype} (loaded {r['params'] / 1e6:.1f}M in {r['seconds']:.1f}s)")
    yardstick = "bfloat16 base" if args.base_dtype == "nf4" else f"{args.base_dtype} weights"
    print(f"held: {r['held_mb']:.0f} MB on the device(s); peak RSS growth while loading: {growth:.0f} MB = "
          f"{growth / weights_mb:.2f}x the {yardstick} "
          f"(goal <= 1.30); RSS after: +{r['after_mb'] - r['base_mb']:.0f} MB")


if __name__ == "__main__":
    main()
