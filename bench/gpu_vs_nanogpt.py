"""On one GPU, in one sitting: tokens/s against nanoGPT with torch.compile at one shape, and our MFU at 100M.

    python3 bench/gpu_vs_nanogpt.py                                   # with ../shared beside the checkout
    python3 bench/gpu_vs_nanogpt.py --shared .gpu/shared --out $OUT    # on a lent machine, ../shared carried in

Speed: nanoGPT (../shared/peers/nanoGPT, a scratch copy, its data prepared by its own prepare.py from
tinyshakespeare.txt as bench/vs_nanogpt.py does) runs its train.py with --compile=True --dtype=bfloat16
(autocast, flash attention through scaled_dot_product_attention), --gradient_accumulation_steps=1 and
--log_interval=1 at --layers x --d-model, --heads, --seq, --batch; then ours runs `train_optimized.py
--use-mixed-precision --optimizer adamw --schedule cosine` at the same shape, the same batch, nanoGPT's parameter count
(--target-params sets the SwiGLU width) and its 65-character vocabulary (its meta.pkl as a tokenizer.json), --log-every 1. They run one after the other (a GPU
cannot be time-sliced fairly); the figure is each one's median step over steps --skip+1..--steps (compile and
warm-up left out), tokens/s = batch x seq / median step, and model FLOP/s = 6 x params x tokens/s with each
program's own parameter count (nanoGPT's printed count, ours' config.json).

MFU: ours at --mfu-params (default 100M, the shape --target-params picks) with --use-mixed-precision, seq
--seq and batch --mfu-batch, --mfu-steps steps, logging (a host sync) every --mfu-log-every: the trainer's own MFU (model FLOPs of 6N + 12 L D S per token
over the published bf16 peak of the device, slm/train/throughput.py), median over the logged steps after
--skip. Prints every figure with the device's name, the date and the versions; --out also keeps the logs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vs_nanogpt as vs  # noqa: E402  (the peer's set-up, its tokenizer, the step-time parsers)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shared", default=os.path.normpath(os.path.join(vs.ROOT, "..", "shared")))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--skip", type=int, default=20)
    p.add_argument("--mfu-params", type=float, default=100e6)
    p.add_argument("--mfu-batch", type=int, default=32)
    p.add_argument("--mfu-steps", type=int, default=80)
    p.add_argument("--mfu-log-every", type=int, default=10, help="the MFU run's --log-every (a host sync per logged step)")
    p.add_argument("--mfu-flags", default="", help="extra flags for the MFU run (quoted), e.g. '--optimizer adamw'")
    p.add_argument("--mfu-only", action="store_true", help="skip the race against nanoGPT")
    p.add_argument("--out", default=None, help="keep the logs here")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no compile, float32 peer)")
    return p.parse_args()


def run(cmd: list[str], cwd: str, log: str, timeout: float = 900) -> None:
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if r.returncode:
        sys.exit(f"{cmd[:3]} failed ({r.returncode}):\n{vs.tail(log, 30)}")


def nanogpt(a: argparse.Namespace, peer: str, scratch: str) -> dict:
    log = os.path.join(scratch, "nanogpt.log")
    gpu = a.device != "cpu"
    run([vs.PY, "train.py", "config/train_shakespeare_char.py", f"--device={a.device}", f"--compile={gpu}",
         f"--dtype={'bfloat16' if gpu else 'float32'}",
         f"--batch_size={a.batch}", f"--block_size={a.seq}", f"--n_layer={a.layers}", f"--n_head={a.heads}",
         f"--n_embd={a.d_model}", "--dropout=0.0", f"--max_iters={a.steps}", f"--lr_decay_iters={a.steps}",
         "--eval_interval=1000000000", "--eval_iters=1", "--log_interval=1", "--gradient_accumulation_steps=1",
         "--out_dir=out-gpu"], peer, log)
    med, n = vs.median_over(vs.nanogpt_step_times(log), a.skip + 1, a.steps)
    params = float(re.search(r"number of parameters: ([\d.]+)M", Path(log).read_text()).group(1)) * 1e6
    return {"median_step_s": med, "n": n, "params": params, "log": log}


def ours(a: argparse.Namespace, scratch: str, tok: str, target: int) -> dict:
    run_dir, log = os.path.join(scratch, "ours-speed"), os.path.join(scratch, "ours-speed.log")
    run(vs.ours_cmd(run_dir, "--dataset-id", os.path.join(vs.DATA, "tinyshakespeare_train.txt"), "--tokenizer", tok,
                    "--n-layers", str(a.layers), "--d-model", str(a.d_model), "--n-heads", str(a.heads),
                    "--seq-len", str(a.seq), "--batch-size", str(a.batch), "--target-params", str(target),
                    "--optimizer", "adamw", "--schedule", "cosine", "--use-mixed-precision", "--dropout", "0",
                    "--max-steps", str(a.steps), "--log-every", "1", "--eval-tokens", "1024",
                    "--eval-every", "1000000000", "--checkpoint-every", "1000000000"), vs.ROOT, log)
    med, n = vs.median_over(vs.ours_step_times(run_dir), a.skip + 1, a.steps)
    cfg = json.loads(Path(run_dir, "config.json").read_text())
    return {"median_step_s": med, "n": n, "params": cfg["params"], "log": log}


def mfu_run(a: argparse.Namespace, scratch: str) -> dict:
    run_dir, log = os.path.join(scratch, "ours-mfu"), os.path.join(scratch, "ours-mfu.log")
    run(vs.ours_cmd(run_dir, "--dataset-id", os.path.join(vs.DATA, "tinystories_train.txt"),
                    "--target-params", str(int(a.mfu_params)), "--use-mixed-precision", "--dropout", "0",
                    "--seq-len", str(a.seq),
                    "--batch-size", str(a.mfu_batch), "--max-steps", str(a.mfu_steps), "--log-every", str(a.mfu_log_every),
                    "--eval-tokens", "1024", "--eval-every", "1000000000", "--checkpoint-every", "1000000000",
                    *a.mfu_flags.split()), vs.ROOT, log)
    rows = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines() if '"mfu"' in x]
    mfus = [r["mfu"] for r in rows if r.get("step", 0) > a.skip]
    cfg = json.loads(Path(run_dir, "config.json").read_text())
    return {"median_mfu": statistics.median(mfus), "n": len(mfus), "params": cfg["params"], "model": cfg["model"],
            "log": log}


def race(a: argparse.Namespace, scratch: str) -> dict:
    """nanoGPT, then ours, at the race's shape; prints each one's figures and the ratio."""
    peer = vs.setup_scratch(scratch)
    tok = os.path.join(scratch, "char_tokenizer.json")
    vs.char_tokenizer(tok, peer)
    tokens = a.batch * a.seq
    res = {"nanoGPT": nanogpt(a, peer, scratch)}
    res["ours"] = ours(a, scratch, tok, int(res["nanoGPT"]["params"]))  # d_ff: the same parameter count
    for name, r in res.items():
        r["tok_s"] = tokens / r["median_step_s"]
        r["gflops"] = 6 * r["params"] * r["tok_s"] / 1e9
        print(f"[speed] {name}: median step {r['median_step_s'] * 1e3:.2f} ms over {r['n']} steps, "
              f"{r['tok_s']:,.0f} tok/s, {r['gflops'] / 1e3:.1f} model TFLOP/s (6 x {r['params']:,.0f} x tok/s)",
              flush=True)
    ratio = res["ours"]["tok_s"] / res["nanoGPT"]["tok_s"]
    print(f"[speed] ours / nanoGPT: tokens/s {ratio:.2f}x, model FLOP/s "
          f"{res['ours']['gflops'] / res['nanoGPT']['gflops']:.2f}x", flush=True)
    return res


def main() -> None:
    a = parse_args()
    vs.SHARED, vs.PEER, vs.DATA = a.shared, os.path.join(a.shared, "peers", "nanoGPT"), os.path.join(a.shared, "data")
    import jax
    import torch

    device = torch.cuda.get_device_name(0) if a.device != "cpu" else "cpu (smoke run)"
    print(f"gpu_vs_nanogpt: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')} | {device} | "
          f"torch {torch.__version__}, jax {jax.__version__} | shape {a.layers}x{a.d_model}, {a.heads} heads, seq "
          f"{a.seq}, batch {a.batch}, steps {a.skip + 1}-{a.steps}", flush=True)
    scratch = tempfile.mkdtemp(prefix="gpu-vs-nanogpt-")
    res = {} if a.mfu_only else race(a, scratch)
    m = mfu_run(a, scratch)
    print(f"[mfu] ours at {m['params'] / 1e6:.1f}M params ({m['model']['n_layers']}x{m['model']['d_model']}, vocab "
          f"{m['model']['vocab_size']}), seq {a.seq}, batch {a.mfu_batch}, bf16 {a.mfu_flags}: median MFU {m['median_mfu']:.1%} "
          f"over {m['n']} logged steps (goal >= 40%)", flush=True)
    if a.out:
        for r in (*res.values(), m):
            shutil.copy(r["log"], a.out)


if __name__ == "__main__":
    main()
