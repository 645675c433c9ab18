"""Predicted vs measured whole-run peak RSS over the sizes a 2-24 GB machine trains (issue 30's sweep).

    .venv/bin/python bench/memory_accuracy.py --jobs 2          # 24 runs, ~30 min on 2 cores
    .venv/bin/python bench/memory_accuracy.py --rows 0,12       # some of them (row numbers as in CONFIGS)
    .venv/bin/python bench/memory_accuracy.py --report out.jsonl # the table of a finished sweep

Each row runs the trainer CLI in its own process (tinystories, streaming, the default optimizer, an empty XLA
compile cache so every program compiles, `--max-steps 2`) and reads its summary.json. The rows cover 1M/10M/
50M/100M params x seq 256/512/1024 x float32/8-bit state x remat on/off x 1/2 host devices, each size with
runs shorter than --checkpoint-every (the only save is the last) and longer (`--checkpoint-every 1`: the second
step runs beside the first save). Columns: XLA's compiled step per device, the pre-flight's prediction
(`estimated_peak_rss_mb`: the deterministic runtime term + data + devices x XLA's figure + step slack +
checkpoint staging), the RSS measured right after the compile (shown, not used), the measured peak
(`peak_rss_mb`: sampled + the kernel's high-water mark) and the prediction's error. Goal: every row within
+-10%. Raw summaries go to --out (JSONL) for refitting the constants.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data", "tinystories_train.txt")

#  target params, seq, devices, 8-bit, remat, longer than --checkpoint-every
SIZES = (1_000_000, 10_000_000, 50_000_000, 100_000_000)
SHAPES = [(256, 1, False, False, False), (256, 2, True, True, True), (512, 2, False, True, False),
          (512, 1, True, False, True), (1024, 2, False, False, True), (1024, 1, True, True, False)]
CONFIGS = [(p, *row) for p in SIZES for row in SHAPES]


def command(i: int, out: str) -> list[str]:
    target, seq, devices, eight, remat, long = CONFIGS[i]
    batch = devices * (2 if target <= 10_000_000 else 1)
    return [sys.executable, os.path.join(ROOT, "train_optimized.py"), "--use-streaming", "--dataset-id", DATA,
            "--target-params", str(target), "--seq-len", str(seq), "--batch-size", str(batch),
            "--gradient-accumulation-steps", "2", "--max-steps", "2", "--eval-tokens", "4096",
            "--cpu-devices", str(devices), "--output-dir", out, "--log-every", "1",
            *(["--checkpoint-every", "1"] if long else []), *(["--use-8bit-optimizer"] if eight else []),
            *(["--gradient-checkpointing"] if remat else [])]


def run_row(i: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"run{i}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_COMPILATION_CACHE_DIR": os.path.join(tmp, f"xla{i}")}
    r = subprocess.run(command(i, out), capture_output=True, text=True, env=env, cwd=tmp)
    target, seq, devices, eight, remat, long = CONFIGS[i]
    row = {"row": i, "target": target, "seq": seq, "devices": devices, "eight": eight, "remat": remat, "long": long}
    if r.returncode:
        return {**row, "error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    with open(os.path.join(out, "summary.json")) as f:
        return {**row, **json.load(f)}


def table(rows: list[dict]) -> None:
    print("| params | seq | devices | state | remat | run vs --checkpoint-every | XLA MB/device | measured after "
          "compile MB | predicted peak MB | measured peak MB | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errs = []
    for s in sorted(rows, key=lambda r: r["row"]):
        head = (f"| {s['target'] / 1e6:g}M | {s['seq']} | {s['devices']} | {'8-bit' if s['eight'] else 'float32'} "
                f"| {'on' if s['remat'] else 'off'} | {'longer' if s['long'] else 'shorter'} ")
        if "error" in s:
            print(head + f"| failed: {s['error'][:120]} |")
            continue
        err = s["estimated_peak_rss_mb"] / s["peak_rss_mb"] - 1
        errs.append(err)
        print(head + f"| {s['compiled_device_mb']:,.0f} | {s['base_rss_mb']:,.0f} | {s['estimated_peak_rss_mb']:,.0f} "
              f"| {s['peak_rss_mb']:,.0f} | {err:+.1%} |")
    if errs:
        print(f"{len(errs)} rows: error {min(errs):+.1%} .. {max(errs):+.1%}; outside +-10%: "
              f"{sum(abs(e) > 0.10 for e in errs)}")


def main() -> None:
    p = argparse.ArgumentParser(description="predicted vs measured memory")
    p.add_argument("--rows", default=None, help="comma-separated row numbers of CONFIGS (default: all)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (peak RSS is per process; speed is not measured)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "memory_accuracy.jsonl"))
    p.add_argument("--report", help="print the table of this JSONL file and stop")
    a = p.parse_args()
    if a.report:
        with open(a.report) as f:
            return table([json.loads(line) for line in f])
    chosen = [int(r) for r in a.rows.split(",")] if a.rows else list(range(len(CONFIGS)))
    chosen.sort(key=lambda i: -CONFIGS[i][0] * CONFIGS[i][1])  # the longest first, so the jobs end together
    tmp = tempfile.mkdtemp(prefix="memacc_")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    rows = []
    with ThreadPoolExecutor(a.jobs) as pool:
        for row in pool.map(lambda i: run_row(i, tmp), chosen):
            rows.append(row)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"row {row['row']} done: " + (row.get("error") or f"{row['estimated_peak_rss_mb']:,.0f} predicted, "
                                                 f"{row['peak_rss_mb']:,.0f} measured"), flush=True)
    table(rows)


if __name__ == "__main__":
    main()
