"""The trainer at a fixed wall clock with different flags, back to back in one sitting: held-out loss per variant.

    .venv/bin/python bench/wallclock_variants.py                   # TinyStories, 10 min each: before vs now
    .venv/bin/python bench/wallclock_variants.py --data shakespeare --max-time 93 --seeds 0,1 \
        --variants "now=;warmup30=--warmup-steps 30;batch16=--batch-size 16"

Each variant is `train_optimized.py --use-streaming --dataset-id TRAIN --eval-dataset-id VALID --max-time T
--seed S` plus its flags (--data tinystories: tinystories_train.txt / tinystories_valid.txt, the trainer's
default size; --data shakespeare: the nanoGPT race's tinyshakespeare_train.txt / _val.txt, --target-params
800000). Runs go back to back (a --max-time run owns the machine: they cannot be interleaved), seeds outermost,
each after waiting for a quiet machine (as bench/vs_nanogpt.py does); the other programs' share of the cores
during each run is printed. The held-out figure is the trainer's final eval of the whole valid file
(summary.json: `eval_loss` in nats per token, `eval_bpb`); variants that keep the tokenizer (a BPE trained on
the same stream with the same seed and vocabulary) compare in either, others (--vocab-size) only in bits/byte:
the table gives both ratios to the first variant.

Named variants: "before" is the trainer as it was before issue 17 changed it (commit 5068422: AdamW, cosine,
warmup not capped in --max-time runs), run from a `git archive` of that commit in a scratch folder with its
defaults; "now" is this checkout with its defaults. Issue 17's TinyStories goal: "now" at least 3% below
"before" after 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
DATA = os.path.join(ROOT, "..", "shared", "data")

from vs_nanogpt import Others, load_line, wait_quiet  # noqa: E402

NAMED = {"before": "", "now": ""}
BEFORE = "5068422"  # the last commit before issue 17's changes to the trainer
DATASETS = {"tinystories": ("tinystories_train.txt", "tinystories_valid.txt", []),
            "shakespeare": ("tinyshakespeare_train.txt", "tinyshakespeare_val.txt", ["--target-params", "800000"])}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="tinystories", choices=sorted(DATASETS))
    p.add_argument("--max-time", type=float, default=600.0)
    p.add_argument("--variants", default="before;now",
                   help="';'-separated NAME or NAME=FLAGS (named: before, now); the first is the baseline")
    p.add_argument("--seeds", default="0", help="comma list")
    p.add_argument("--quiet-below", type=float, default=0.5, help="cores other programs may use (0: do not wait)")
    p.add_argument("--max-wait", type=float, default=1800.0)
    return p.parse_args()


def variants(spec: str) -> dict[str, list[str]]:
    out = {}
    for v in filter(None, (x.strip() for x in spec.split(";"))):
        name, _, flags = v.partition("=")
        out[name] = (flags if "=" in v else NAMED[name]).split()
    return out


def before_tree(tmp: str) -> str:
    """A scratch copy of the trainer at BEFORE (its own slm/ is found first: the script's folder leads sys.path)."""
    tree = os.path.join(tmp, "before-tree")
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", BEFORE], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def run_variant(a: argparse.Namespace, name: str, flags: list[str], seed: int, out: str, tree: str = ROOT) -> dict:
    train, valid, extra = DATASETS[a.data]
    cmd = [sys.executable, os.path.join(tree, "train_optimized.py"), "--use-streaming",
           "--dataset-id", os.path.join(DATA, train), "--eval-dataset-id", os.path.join(DATA, valid), *extra,
           "--max-time", f"{a.max_time:g}", "--seed", str(seed), "--eval-every", "1000000", "--output-dir", out, *flags]
    wait_quiet(a)
    others = Others()
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    load = others.done()
    if r.returncode:
        sys.exit(f"{name}: exit {r.returncode}\n{r.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    print(f"[{name} seed {seed}] {' '.join(flags) or '(defaults)'}: {s['steps']} steps, {s['tokens']:,} tokens, "
          f"eval loss {s['eval_loss']:.4f} ({s['eval_bpb']:.4f} bits/byte), process {time.time() - t:.0f}s; "
          f"{load_line(load)}", flush=True)
    return s


def main() -> None:
    a = parse_args()
    vs, seeds = variants(a.variants), [int(x) for x in a.seeds.split(",")]
    with open("/proc/loadavg") as f:
        load0 = " ".join(f.read().split()[:3])
    print(f"wallclock_variants: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, {a.data}, --max-time {a.max_time:g}, "
          f"seeds {seeds}, {os.cpu_count()} cpus, load average {load0}", flush=True)
    res = {n: [] for n in vs}
    with tempfile.TemporaryDirectory(prefix="wallclock-") as tmp:
        old = before_tree(tmp) if "before" in vs else ROOT
        for seed in seeds:
            for n, flags in vs.items():
                res[n].append(run_variant(a, n, flags, seed, os.path.join(tmp, f"{n}-{seed}"),
                                          old if n == "before" else ROOT))
    base = next(iter(res))
    print(f"\n| variant | flags | steps (mean) | held-out loss, mean (min-max over seeds {seeds}) | bits/byte, mean "
          f"(min-max) | vs {base}, same seed: loss ratio mean (min-max) | bits/byte ratio mean (min-max) |"
          f"\n|---|---|---|---|---|---|---|")
    for n, rs in res.items():
        loss, bpb = [r["eval_loss"] for r in rs], [r["eval_bpb"] for r in rs]
        print(f"| {n} | `{' '.join(vs[n]) or '(defaults)'}` | {statistics.mean(r['steps'] for r in rs):.0f} "
              f"| {spread(loss)} | {spread(bpb)} | {spread([r['eval_loss'] / b['eval_loss'] for r, b in zip(rs, res[base])])} "
              f"| {spread([r['eval_bpb'] / b['eval_bpb'] for r, b in zip(rs, res[base])])} |")


def spread(xs: list[float]) -> str:
    """mean (min-max)"""
    return f"{statistics.mean(xs):.4f} ({min(xs):.4f}-{max(xs):.4f})"


if __name__ == "__main__":
    main()
