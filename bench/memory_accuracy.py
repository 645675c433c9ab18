"""Predicted vs measured memory over a sweep of runs: the estimate against XLA and against peak RSS.

    .venv/bin/python bench/memory_accuracy.py            # 14 configurations, ~15 min on 2 cores
    .venv/bin/python bench/memory_accuracy.py --rows 0,12  # some of them (row numbers as in CONFIGS)

Each configuration runs the trainer CLI in its own process for a few steps (tinyshakespeare, streaming,
an eval and a checkpoint after every step, so steps run after a save as in any run longer than one
checkpoint interval; an empty compile cache per run, so every program is compiled) and reads its summary.json:
- device: slm/memory/estimate.py's per-device total (`estimated_device_mb`, pure arithmetic) against XLA's
  memory analysis of the compiled step (`compiled_device_mb`: arguments + outputs + temporaries - donated);
- host: the pre-flight's predicted whole-run peak RSS (`estimated_peak_rss_mb` = RSS measured after the
  compile + data + devices x XLA's figure + step slack + checkpoint staging) and the pure formula's
  (`formula_peak_rss_mb`, what --auto-fit ranks by) against the process's measured peak RSS (`peak_rss_mb`,
  sampled + the kernel's high-water mark).
Goal: every row within +-10% (pre-flight). On a GPU the device column would compare against memory_stats() peaks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt")

#  target params, seq, batch, accumulation, extra flags
CONFIGS = [
    (100_000, 64, 16, 1, []),
    (300_000, 128, 32, 1, []),
    (1_000_000, 128, 32, 1, []),
    (1_000_000, 128, 32, 4, []),
    (1_000_000, 256, 32, 1, ["--gradient-checkpointing"]),
    (1_000_000, 128, 32, 1, ["--use-mixed-precision"]),
    (1_000_000, 128, 32, 1, ["--use-8bit-optimizer"]),
    (3_000_000, 64, 64, 1, []),
    (3_000_000, 512, 8, 1, []),
    (3_000_000, 256, 16, 2, ["--use-mixed-precision", "--gradient-checkpointing"]),
    (10_000_000, 128, 16, 1, []),
    (10_000_000, 128, 16, 1, ["--use-8bit-optimizer", "--use-mixed-precision"]),
    (20_000_000, 128, 8, 2, ["--use-8bit-optimizer"]),
    (20_000_000, 512, 4, 1, ["--gradient-checkpointing"]),
]


def main() -> None:
    p = argparse.ArgumentParser(description="predicted vs measured memory")
    p.add_argument("--rows", default=None, help="comma-separated row numbers of CONFIGS (default: all)")
    rows = p.parse_args().rows
    chosen = set(map(int, rows.split(","))) if rows else set(range(len(CONFIGS)))
    tmp = tempfile.mkdtemp(prefix="memacc_")
    print("| params | seq | batch×acc | flags | est. device MB | XLA device MB | err | formula peak RSS MB | err "
          "| pre-flight peak RSS MB | measured peak RSS MB | err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = []
    for i, (target, seq, batch, acc, flags) in enumerate(CONFIGS):
        if i not in chosen:
            continue
        out = os.path.join(tmp, f"run{i}")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_COMPILATION_CACHE_DIR": os.path.join(tmp, f"xla{i}")}
        cmd = [sys.executable, os.path.join(ROOT, "train_optimized.py"), "--use-streaming", "--dataset-id", DATA,
               "--target-params", str(target), "--seq-len", str(seq), "--batch-size", str(batch),
               "--gradient-accumulation-steps", str(acc), "--max-steps", "3", "--eval-tokens", "4096",
               "--eval-every", "1", "--checkpoint-every", "1",
               "--output-dir", out, *flags]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if r.returncode:
            print(f"| {target:,} | {seq} | {batch}×{acc} | {' '.join(flags)} | failed: {r.stderr.strip().splitlines()[-1]} |")
            continue
        s = json.load(open(os.path.join(out, "summary.json")))
        e_dev = s["estimated_device_mb"] / s["compiled_device_mb"] - 1
        e_rss = s["estimated_peak_rss_mb"] / s["peak_rss_mb"] - 1
        e_formula = s["formula_peak_rss_mb"] / s["peak_rss_mb"] - 1
        worst += [(abs(e_dev), "device", i), (abs(e_rss), "rss", i)]
        print(f"| {s['params']:,} | {seq} | {batch}×{acc} | {' '.join(f.lstrip('-') for f in flags) or '-'} "
              f"| {s['estimated_device_mb']:,.1f} | {s['compiled_device_mb']:,.1f} | {e_dev:+.1%} "
              f"| {s['formula_peak_rss_mb']:,.0f} | {e_formula:+.1%} "
              f"| {s['estimated_peak_rss_mb']:,.0f} | {s['peak_rss_mb']:,.0f} | {e_rss:+.1%} |", flush=True)
    outside = [w for w in worst if w[0] > 0.10]
    print(f"worst error {max(worst)[0]:.1%} ({max(worst)[1]}, row {max(worst)[2]}); rows outside +-10%: "
          f"{', '.join(f'{k} row {i} ({e:.1%})' for e, k, i in outside) or 'none'}")


if __name__ == "__main__":
    main()
