"""Kill -9 a training run at random moments, resume it each time, and compare with an uninterrupted run.

    .venv/bin/python bench/kill_and_resume.py                 # 60 steps, 3 kills, checkpoint every 5 steps
    .venv/bin/python bench/kill_and_resume.py --kills 5 --seed 1

Reference: the trainer CLI runs --max-steps N in one process. Interrupted: the same command is killed with
SIGKILL (no chance to save) after a random number of logged steps, then `--resume RUN_DIR` continues it,
again and again until it reaches N. Both runs log every step. Printed: each kill's step and the checkpoint
the resume restarted from; then the chained sha256 of every batch consumed (`data_digest`) and the
per-step losses, compared between the two runs. Steps after the last checkpoint are recomputed on resume
and must equal the reference too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng, tmp = random.Random(a.seed), tempfile.mkdtemp(prefix="killres_")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    flags = ["--use-streaming", "--dataset-id", DATA, "--target-params", "150000", "--seq-len", "64", "--batch-size",
             "8", "--shuffle-buffer-size", "200", "--max-examples", "400", "--eval-tokens", "2048", "--log-every", "1",
             "--checkpoint-every", "5", "--max-steps", str(a.steps)]
    cli = [sys.executable, os.path.join(ROOT, "train_optimized.py")]
    ref, run = os.path.join(tmp, "reference"), os.path.join(tmp, "interrupted")
    subprocess.run(cli + flags + ["--output-dir", ref], env=env, cwd=tmp, check=True, capture_output=True)

    def logged(path: str) -> int:
        m = os.path.join(path, "metrics.jsonl")
        return sum(1 for line in open(m) if '"loss"' in line) if os.path.exists(m) else 0

    cmd = cli + flags + ["--output-dir", run]
    for k in range(a.kills):
        target = logged(run) + rng.randint(3, max(4, a.steps // (a.kills + 1)))
        p = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while logged(run) < target and p.poll() is None:
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait()
        saved = sorted(int(d) for d in os.listdir(os.path.join(run, "checkpoints")) if d.isdigit())
        print(f"kill {k + 1}: SIGKILL after {logged(run)} logged steps; newest complete checkpoint: step {saved[-1]}")
        cmd = cli + ["--resume", run]
    subprocess.run(cmd, env=env, cwd=tmp, check=True, capture_output=True)

    def losses(path: str) -> dict[int, float]:
        out = {}
        for line in open(os.path.join(path, "metrics.jsonl")):  # a resumed step's latest row wins
            r = json.loads(line)
            if "loss" in r:
                out[r["step"]] = r["loss"]
        return out

    sa, sb = (json.load(open(os.path.join(p, "summary.json"))) for p in (ref, run))
    la, lb = losses(ref), losses(run)
    worst = max(abs(la[s] - lb[s]) for s in la)
    print("| run | steps | data digest (sha256 of every batch, chained) | eval loss |")
    print("|---|---|---|---|")
    for name, s in (("uninterrupted", sa), (f"killed {a.kills}x and resumed", sb)):
        print(f"| {name} | {s['steps']} | `{s['data_digest'][:16]}…` | {s['eval_loss']:.6f} |")
    print(f"digests equal: {sa['data_digest'] == sb['data_digest']}; per-step losses: {len(la)} steps, "
          f"max |diff| {worst:.2e}; eval loss diff {abs(sa['eval_loss'] - sb['eval_loss']):.2e}")


if __name__ == "__main__":
    main()
