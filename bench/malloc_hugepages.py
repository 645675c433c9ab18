"""The trainer with and without huge-page-backed malloc (glibc.malloc.hugetlb=1), interleaved: step times, page faults.

    .venv/bin/python bench/malloc_hugepages.py                       # ~15 min on 2 cores
    .venv/bin/python bench/malloc_hugepages.py --rounds 2 --shapes lora

Why: XLA's CPU runtime allocates each step's temporary buffers with malloc and frees them after the step.
Blocks over glibc's mmap threshold (32 MB at most) are mmap'd and munmap'd every time, so every 4 KiB page of
them is faulted in and zeroed again on every step. `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` makes glibc ask for
transparent huge pages (madvise) for its memory, so a fault brings in 2 MiB instead of 4 KiB. The tunable is
read only at process start; `train_optimized.py` re-executes itself once with it set (slm/cli/malloc.py).
On a 2-core Xeon (2026-11-25) the LoRA race's steps under it alternated between ~1.8 s and 2.6-2.9 s: so each
run's steps are logged one by one, and their spread is printed beside the median.

Shapes: `race` (the quality race's 800K model, seq 64), `1M` (the default run), `10M` (batch 8), `lora` (the
LoRA race of bench/vs_peft.py: r16 on q_proj,v_proj of SmolLM2-135M's shape with vocab 8,192, a random base
made once by transformers, seq 256 x batch 4). Each round runs the trainer (`--max-steps`, the shape, the
tinyshakespeare file, no eval until the end, a log row per step) once with `GLIBC_TUNABLES=glibc.malloc.hugetlb=0`
(the user's explicit choice, which the trainer keeps: glibc's default behaviour) and once as it starts by
default, alternating which goes first. Per run: the step times after --skip (wall time between consecutive
log rows): median, p10 and p90; the process's minor page faults and system CPU time (getrusage of the child);
peak RSS. Printed: each run, then per shape the medians over rounds and the speed ratio per round.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DATA = os.path.join(ROOT, "..", "shared", "data")
sys.path.insert(0, HERE)
SHAPES = {
    "race": ["--target-params", "800000", "--seq-len", "64"],  # the quality race's setting (vocab 2048)
    "1M": ["--target-params", "1000000"],  # the default run: seq 128, batch 32
    "10M": ["--target-params", "10000000", "--batch-size", "8"],
    "lora": ["--lora-rank", "16", "--lora-alpha", "32", "--seq-len", "256", "--batch-size", "4"],  # + --init-from
}
MODES = {"glibc default": "glibc.malloc.hugetlb=0", "huge pages (trainer default)": None}


def run_once(flags: list[str], tunables: str | None, steps: int, skip: int, out: str) -> dict:
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    cmd = [sys.executable, os.path.join(ROOT, "train_optimized.py"), "--use-streaming", "--output-dir", out,
           "--dataset-id", os.path.join(DATA, "tinyshakespeare_train.txt"), "--eval-tokens", "1024",
           "--max-steps", str(steps), "--log-every", "1", "--eval-every", str(10 * steps),
           "--checkpoint-every", str(10 * steps), *flags]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"trainer failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        ends = [r["elapsed_s"] for r in map(json.loads, filter(str.strip, f)) if "loss" in r and r["step"] >= skip]
    step_s = sorted(b - a for a, b in zip(ends, ends[1:]))
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    return {"step_s": statistics.median(step_s), "p10_s": step_s[len(step_s) // 10],
            "p90_s": step_s[len(step_s) * 9 // 10], "minflt": after.ru_minflt - before.ru_minflt,
            "sys_s": after.ru_stime - before.ru_stime, "wall_s": wall, "peak_rss_mb": summary["peak_rss_mb"]}


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "no THP"


def shape_flags(shape: str, tmp: str) -> list[str]:
    if shape != "lora":
        return SHAPES[shape]
    from vs_peft import make_base  # bench/, beside this script

    base = os.path.join(tmp, "lora-base")
    if not os.path.isdir(base):
        make_base(base, 8192)
    return [*SHAPES[shape], "--init-from", base]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="race,1M,lora", help=f"among {', '.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=5, help="leave out the steps up to this one (compile, warm-up)")
    a = ap.parse_args()
    from slm.train.throughput import cpu_model

    print(f"malloc_hugepages: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, {cpu_model()}, {os.cpu_count()} cpus, "
          f"{thp_mode()} (transparent_hugepage/enabled), {a.rounds} rounds of {a.steps} steps", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in a.shapes.split(","):
            flags = shape_flags(shape, tmp)
            res: dict[str, list[dict]] = {m: [] for m in MODES}
            for r in range(a.rounds):
                for m in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                    out = os.path.join(tmp, f"{shape}-{r}-{len(m)}")
                    res[m].append(run_once(flags, MODES[m], a.steps, a.skip, out))
                    x = res[m][-1]
                    print(f"  [{shape} round {r}] {m}: step {x['step_s'] * 1e3:,.0f} ms (p10 {x['p10_s'] * 1e3:,.0f}, "
                          f"p90 {x['p90_s'] * 1e3:,.0f}), {x['minflt'] / a.steps:,.0f} minor faults/step, sys "
                          f"{x['sys_s']:.1f}s, wall {x['wall_s']:.1f}s, peak rss {x['peak_rss_mb']:.0f} MB", flush=True)
            summarise(shape, res, a.steps)


def summarise(shape: str, res: dict[str, list[dict]], steps: int) -> None:
    base, huge = (res[m] for m in MODES)
    ratios = [b["step_s"] / h["step_s"] for b, h in zip(base, huge)]
    med = {m: {k: statistics.median(x[k] for x in res[m]) for k in res[m][0]} for m in MODES}
    g, h = med["glibc default"], med["huge pages (trainer default)"]
    print(f"{shape}: median step {g['step_s'] * 1e3:,.0f} -> {h['step_s'] * 1e3:,.0f} ms (p90/p10 "
          f"{g['p90_s'] / g['p10_s']:.2f} -> {h['p90_s'] / h['p10_s']:.2f}), speed ratio per round "
          f"{', '.join(f'{x:.3f}' for x in ratios)} (median {statistics.median(ratios):.3f}); minor faults/step "
          f"{g['minflt'] / steps:,.0f} -> {h['minflt'] / steps:,.0f}; sys CPU {g['sys_s']:.1f} -> {h['sys_s']:.1f} s; "
          f"peak rss {g['peak_rss_mb']:.0f} -> {h['peak_rss_mb']:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
