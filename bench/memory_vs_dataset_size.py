"""Peak RSS of the trainer as the dataset grows: streaming stays flat, the full-load path grows.

    .venv/bin/python bench/memory_vs_dataset_size.py                     # sizes 1,4,16; 30 steps per run
    .venv/bin/python bench/memory_vs_dataset_size.py --sizes 1,2 --steps 10 --keep

The 1x corpus is tinystories_train.txt + tinystories_train_extra_lowercase.txt + tinyshakespeare.txt from
../shared/data (4.7 MB). For a multiplier k a temporary directory gets k copies of each of these files
(c00_*.txt ... c{k-1}_*.txt), so total bytes scale by k; both paths read the same directory. A byte-level BPE
(tokenizer_utils.train_bpe, vocab 512 = the default for 200K params) is trained once on the 1x corpus and
passed as --tokenizer, so no run trains its own. Each size is trained twice as a subprocess, so each peak
RSS belongs to its own process:

    train_optimized.py [--use-streaming] --dataset-id DIR --tokenizer tok.json --max-steps 30
        --target-params 200000 --seq-len 128 --batch-size 16 --eval-tokens 4096 --eval-every 1000000 ...

The figure is summary.json's peak_rss_mb (ru_maxrss of the trainer); /usr/bin/time's max RSS, when that
program exists, is printed per run as a cross-check. Everything is reported as a ratio to the 1x run of the
same path measured in this invocation. Goal: streaming largest/1x < 1.05; full-load grows with the data.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from slm.data.readers import read_file  # noqa: E402
from slm.data.tokenizer import train_bpe  # noqa: E402
from slm.model.sizing import default_vocab_size  # noqa: E402

DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
FILES = ["tinystories_train.txt", "tinystories_train_extra_lowercase.txt", "tinyshakespeare.txt"]
TARGET_PARAMS = 200_000
GOAL = 1.05
TIME = "/usr/bin/time"


def build_corpus(tmp: str, k: int) -> tuple[str, int]:
    """A directory holding k copies of each corpus file; returns (path, total bytes)."""
    d = os.path.join(tmp, f"data_{k}x")
    os.makedirs(d)
    for i in range(k):
        for name in FILES:
            shutil.copyfile(os.path.join(DATA, name), os.path.join(d, f"c{i:02d}_{name}"))
    return d, sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def train_tokenizer(tmp: str) -> str:
    """Train the shared BPE once on the 1x corpus; returns the tokenizer.json path."""
    docs = (doc for name in FILES for doc in read_file(os.path.join(DATA, name)))
    path = os.path.join(tmp, "tokenizer.json")
    train_bpe(docs, default_vocab_size(TARGET_PARAMS)).save(path)
    return path


def run_trainer(tmp: str, data: str, tok: str, steps: int, streaming: bool, tag: str) -> tuple[float, float | None]:
    """Train once in a subprocess; returns (summary peak_rss_mb, /usr/bin/time max RSS MB or None)."""
    out = os.path.join(tmp, f"run_{tag}")
    cmd = [sys.executable, os.path.join(ROOT, "train_optimized.py"), "--dataset-id", data, "--tokenizer", tok,
           "--max-steps", str(steps), "--target-params", str(TARGET_PARAMS), "--seq-len", "128",
           "--batch-size", "16", "--eval-tokens", "4096", "--eval-every", "1000000", "--log-every", "50",
           "--output-dir", out] + (["--use-streaming"] if streaming else [])
    time_file = os.path.join(tmp, f"time_{tag}.txt")
    if os.path.exists(TIME):
        cmd = [TIME, "-f", "%M", "-o", time_file] + cmd
    log_path = os.path.join(tmp, f"log_{tag}.txt")
    t0 = time.time()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
    if rc != 0:
        with open(log_path) as f:
            sys.exit(f"run {tag} failed (exit {rc}):\n{f.read()[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        peak = json.load(f)["peak_rss_mb"]
    ext = None
    if os.path.exists(time_file):
        with open(time_file) as f:
            ext = int(f.read().split()[-1]) / 1024  # %M is KB
    ext_s = f"{ext:,.0f} MB" if ext is not None else "n/a"
    print(f"  {tag:>16}: peak rss {peak:,.0f} MB (/usr/bin/time {ext_s}), {time.time() - t0:.0f}s", flush=True)
    return peak, ext


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,16", help="comma-separated multipliers; the first is the baseline")
    ap.add_argument("--steps", type=int, default=30, help="--max-steps of each training run")
    ap.add_argument("--reps", type=int, default=3,
                    help="runs per size and path; the median peak is reported (RSS varies +-40 MB run to run here)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, runs, corpora)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = tempfile.mkdtemp(prefix="mem_vs_size_")
    t_start = time.time()
    rows: list[tuple[int, float, float, float]] = []  # (multiplier, MB, streaming, full-load)
    try:
        tok = train_tokenizer(tmp)
        print(f"[bench] tokenizer trained once: {tok}; temp dir {tmp}", flush=True)
        for k in sizes:
            data, n_bytes = build_corpus(tmp, k)
            print(f"[bench] {k}x: {n_bytes / 1e6:.1f} MB in {len(os.listdir(data))} files", flush=True)
            stream = statistics.median(run_trainer(tmp, data, tok, args.steps, True, f"{k}x_streaming_{r}")[0]
                                       for r in range(args.reps))
            full = statistics.median(run_trainer(tmp, data, tok, args.steps, False, f"{k}x_full_load_{r}")[0]
                                     for r in range(args.reps))
            rows.append((k, n_bytes / 1e6, stream, full))
            if not args.keep:
                shutil.rmtree(data)
    finally:
        if args.keep:
            print(f"[bench] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    base_k, _, base_s, base_f = rows[0]
    print("\n| corpus size (MB) | multiplier | streaming peak RSS MB | full-load peak RSS MB |"
          "\n|---:|---:|---:|---:|")
    for k, mb, s, f in rows:
        print(f"| {mb:,.1f} | {k}x | {s:,.0f} ({s / base_s:.3f}x) | {f:,.0f} ({f / base_f:.3f}x) |")
    k, _, s, f = rows[-1]
    s_ratio, f_ratio = s / base_s, f / base_f
    print(f"\nstreaming {k}x/{base_k}x peak RSS: {s_ratio:.3f} (goal < {GOAL}: {'PASS' if s_ratio < GOAL else 'FAIL'})")
    print(f"full-load {k}x/{base_k}x peak RSS: {f_ratio:.3f} (should grow: {'yes' if f_ratio > s_ratio else 'NO'})")
    print(f"full-load / streaming at {base_k}x: {base_f / base_s:.3f}; at {k}x: {f / s:.3f}")
    print(f"total {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
