"""The trainer with and without huge-page-backed malloc (glibc.malloc.hugetlb=1), interleaved: step time, page faults.

    .venv/bin/python bench/malloc_hugepages.py                       # ~8 min on 2 cores
    .venv/bin/python bench/malloc_hugepages.py --rounds 2 --shapes race

Why: XLA's CPU runtime allocates each step's temporary buffers with malloc and frees them after the step.
Blocks over glibc's mmap threshold (32 MB at most) are mmap'd and munmap'd every time, so every 4 KiB page of
them is faulted in and zeroed again on every step. `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` makes glibc ask for
transparent huge pages (madvise) for its memory, so a fault brings in 2 MiB instead of 4 KiB. The tunable is
read only at process start; `train_optimized.py` re-executes itself once with it set (slm/cli/malloc.py).

Each round runs the trainer (`--max-steps`, the given shape, the tinyshakespeare file, no eval until the end)
once with `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` (the user's explicit choice, which the trainer keeps: glibc's
default behaviour) and once as it starts by default, alternating which goes first. Per run: the median of the
trainer's own 10-step tokens/s rows after the first --skip steps, the process's minor page faults and system
CPU time (getrusage of the child), and peak RSS. Printed: medians over rounds and the speed ratio per round.
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
SHAPES = {
    "race": ["--target-params", "800000", "--seq-len", "64"],  # the quality race's setting (vocab 2048)
    "1M": ["--target-params", "1000000"],  # the default run: seq 128, batch 32
    "10M": ["--target-params", "10000000", "--batch-size", "8"],
}
MODES = {"glibc default": "glibc.malloc.hugetlb=0", "huge pages (trainer default)": None}


def run_once(flags: list[str], tunables: str | None, steps: int, skip: int, out: str) -> dict:
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    cmd = [sys.executable, os.path.join(ROOT, "train_optimized.py"), "--use-streaming", "--output-dir", out,
           "--dataset-id", os.path.join(DATA, "tinyshakespeare_train.txt"),
           "--eval-dataset-id", os.path.join(DATA, "tinyshakespeare_val.txt"),
           "--max-steps", str(steps), "--eval-every", str(10 * steps), "--checkpoint-every", str(10 * steps), *flags]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"trainer failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rates = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r and r["step"] > skip]
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    return {"tok_s": statistics.median(rates), "minflt": after.ru_minflt - before.ru_minflt,
            "sys_s": after.ru_stime - before.ru_stime, "wall_s": wall, "peak_rss_mb": summary["peak_rss_mb"]}


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "no THP"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="race,1M,10M", help=f"among {', '.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--skip", type=int, default=10, help="leave out the log rows up to this step (compile, warm-up)")
    a = ap.parse_args()
    print(f"malloc_hugepages: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, {os.cpu_count()} cpus, {thp_mode()} "
          f"(transparent_hugepage/enabled), {a.rounds} rounds of {a.steps} steps", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in a.shapes.split(","):
            res: dict[str, list[dict]] = {m: [] for m in MODES}
            for r in range(a.rounds):
                order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
                for m in order:
                    res[m].append(run_once(SHAPES[shape], MODES[m], a.steps, a.skip, os.path.join(tmp, f"{shape}-{r}-{len(m)}")))
                    x = res[m][-1]
                    print(f"  [{shape} round {r}] {m}: {x['tok_s']:,.0f} tok/s, {x['minflt'] / a.steps:,.0f} minor faults/step, "
                          f"sys {x['sys_s']:.1f}s, wall {x['wall_s']:.1f}s, peak rss {x['peak_rss_mb']:.0f} MB", flush=True)
            base, huge = (res[m] for m in MODES)
            ratios = [h["tok_s"] / b["tok_s"] for b, h in zip(base, huge)]
            med = {m: {k: statistics.median(x[k] for x in res[m]) for k in res[m][0]} for m in MODES}
            print(f"{shape}: tokens/s {med['glibc default']['tok_s']:,.0f} -> {med['huge pages (trainer default)']['tok_s']:,.0f} "
                  f"(median over rounds), ratio per round {', '.join(f'{x:.3f}' for x in ratios)} (median "
                  f"{statistics.median(ratios):.3f}); minor faults/step {med['glibc default']['minflt'] / a.steps:,.0f} -> "
                  f"{med['huge pages (trainer default)']['minflt'] / a.steps:,.0f}; sys CPU {med['glibc default']['sys_s']:.1f} -> "
                  f"{med['huge pages (trainer default)']['sys_s']:.1f} s; peak rss {med['glibc default']['peak_rss_mb']:.0f} -> "
                  f"{med['huge pages (trainer default)']['peak_rss_mb']:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
