"""Kill -9 a training run at random moments, resume it each time, and compare with an uninterrupted run.

    .venv/bin/python bench/kill_and_resume.py                 # 60 steps, 3 kills, checkpoint every 5 steps
    .venv/bin/python bench/kill_and_resume.py --kills 5 --seed 1
    .venv/bin/python bench/kill_and_resume.py --manifest-cost 10000000,100000000   # the checksum's cost

Reference: the trainer CLI runs --max-steps N in one process. Interrupted: the same command is killed with
SIGKILL (no chance to save) after a random number of logged steps, then `--resume RUN_DIR` continues it,
again and again until it reaches N. Both runs log every step. Before the last resume, one state file of
the newest checkpoint is cut in half (a damaged-checkpoint round, as a full disk or a bad copy leaves it):
that resume must set it aside and continue from the checkpoint before. Printed: each kill's step and the
checkpoint the resume restarted from, the damaged round's line; then the chained sha256 of every batch
consumed (`data_digest`) and the per-step losses, compared between the two runs. Steps after the last
checkpoint are recomputed on resume and must equal the reference too.

--manifest-cost: for each parameter target, the trainer's step-0 state (Muon, float32), its arrays filled
with noise as a trained state's are (zeros would compress to nothing), saved by the trainer's Checkpointer
(synchronously). Printed: the checkpoint's size, the save, writing its manifest (sizes + CRC-32 of every
file, read back from the page cache as right after a save), and checking it as --resume does, with the
page cache warm and with the files evicted from it (posix_fadvise DONTNEED).
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
    ap.add_argument("--manifest-cost", metavar="TARGETS", help="comma list of parameter targets: time the checksum")
    a = ap.parse_args()
    if a.manifest_cost:
        return manifest_cost([int(float(t)) for t in a.manifest_cost.split(",")])
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
        # past the next --checkpoint-every 5: a kill before the first save would leave nothing to resume
        target = logged(run) + rng.randint(6, max(7, a.steps // (a.kills + 1)))
        p = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while logged(run) < target and p.poll() is None:
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait()
        saved = sorted(int(d) for d in os.listdir(os.path.join(run, "checkpoints")) if d.isdigit())
        newest = f"step {saved[-1]}" if saved else "none yet"
        print(f"kill {k + 1}: SIGKILL after {logged(run)} logged steps; newest complete checkpoint: {newest}")
        cmd = cli + ["--resume", run]
    damaged = damage_newest(os.path.join(run, "checkpoints"))
    done = subprocess.run(cmd, env=env, cwd=tmp, check=True, capture_output=True, text=True)
    said = [line for line in done.stdout.splitlines() if line.startswith("[resume]")]
    print(f"damaged round: cut {damaged} in half; the resume said: " + " / ".join(said))

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


def damage_newest(ckpt_dir: str) -> str:
    """Cut the largest state file of the newest checkpoint in half; its path, relative to `ckpt_dir`."""
    newest = max(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(ckpt_dir, str(newest), "state")) for f in fs]
    path = max(files, key=os.path.getsize)
    os.truncate(path, os.path.getsize(path) // 2)
    return os.path.relpath(path, ckpt_dir)


def trained_like(state):
    """Every float array filled with noise: a step-0 state's zero moments would compress to nothing on disk."""
    import jax
    import jax.numpy as jnp

    keys = iter(jax.random.split(jax.random.PRNGKey(0), len(jax.tree.leaves(state))))
    noise = lambda x: (jax.random.normal(next(keys), x.shape) * 0.02).astype(x.dtype)  # noqa: E731
    return jax.tree.map(lambda x: noise(x) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)


def manifest_cost(targets: list[int]) -> None:
    sys.path.insert(0, ROOT)
    from slm.train.devices import configure_cpu_devices

    configure_cpu_devices(None)
    import jax

    from slm.io.checkpoints import Checkpointer
    from slm.io.manifest import check_manifest, write_manifest
    from slm.model.sizing import choose_shape, default_vocab_size, describe
    from slm.train.builder import StepSpec, build, init_state
    from slm.train.devices import data_mesh

    print(f"{jax.devices()[0].platform}, {os.cpu_count()} cores; state: params + Muon/AdamW float32 moments")
    print("| params | checkpoint MB | save s | manifest (write) s | check, warm cache s | check, cold s | "
          "manifest / save |")
    print("|---|---|---|---|---|---|---|")
    for target in targets:
        shape = choose_shape(target, default_vocab_size(target))
        built = build(StepSpec(shape, 256, 8, optimizer="muon"), data_mesh(8))
        state = trained_like(init_state(built))
        folder = tempfile.mkdtemp(prefix="manifest_")
        ck = Checkpointer(os.path.join(folder, "checkpoints"), sync=True, log=print)
        t = time.perf_counter()
        ck.save(1, state, {"step": 1})  # the save, its check and its manifest
        save_s = time.perf_counter() - t
        path = ck.path(1)
        t = time.perf_counter()
        size = write_manifest(path)  # again, timed alone
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        assert check_manifest(path) is None
        warm_s = time.perf_counter() - t
        for r, _, fs in os.walk(path):
            for f in fs:
                fd = os.open(os.path.join(r, f), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        t = time.perf_counter()
        assert check_manifest(path) is None
        cold_s = time.perf_counter() - t
        ck.close()
        print(f"| {describe(shape, 256).split(':')[0]} | {size / 2**20:,.0f} | {save_s:.2f} | {write_s:.2f} | "
              f"{warm_s:.2f} | {cold_s:.2f} | {write_s / (save_s - write_s):.0%} |")
        del state


if __name__ == "__main__":
    main()
