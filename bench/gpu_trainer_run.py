"""A real `train_optimized.py` run on a lent GPU against the `--plan-for` plan made for it on this CPU (issue 40).

    # here: the plan (XLA's compile-only figures for the target), written to PLAN_DIR/plan.json
    .venv/bin/python bench/gpu_trainer_run.py plan --model ../shared/models/gemma-3-1b --target h100-80gb \
        --out .gpu/plan-gemma -- --lora-rank 16 --base-dtype nf4 --seq-len 512 --batch-size 4
    # on the GPU: random weights for the config.json, a tokenizer, then the trainer itself with the same flags
    python3 bench/gpu_trainer_run.py run --model .gpu/models/gemma-3-1b --text .gpu/tinyshakespeare.txt \
        --plan .gpu/plan-gemma/plan.json --out $OUT/gemma -- --lora-rank 16 --base-dtype nf4 --seq-len 512 ...

`run` writes the model folder the trainer starts from (`--init-from`): the config.json as given, float32
safetensors of a random initialisation (slm's own init, exported with slm.io.hf_export: no download) and a
byte-level BPE trained on `--text` (fewer tokens than the model's vocabulary; the shapes stay the model's).
The trainer runs as a user runs it, in its own process (pre-flight, steps, evals with samples, checkpoints; the
weights and the run folder in a temporary folder, removed after; --out keeps the log, summary and metrics), and
prints its summary's device figures against the plan's: the allocator's peak (`peak_device_mb`, jax's
`peak_bytes_in_use`, pre-flight's compiles on the empty card included), the state and each program XLA planned.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from slm.train.devices import import_jax_quietly  # noqa: E402

import_jax_quietly()


def random_model(model: str, text: str, out: str, vocab: int = 4096) -> None:
    """config.json + random float32 safetensors (slm's init) + a BPE tokenizer.json trained on `text`."""
    from slm.data.tokenizer import train_bpe
    from slm.io.hf_export import WEIGHTS, hf_state_dict, save_tensors
    from slm.io.hf_import import load_hf_folder
    from slm.model.transformer import Transformer, init_params

    shape, _, _ = load_hf_folder(model, weights=False)  # the shape from config.json, as --init-from reads it
    os.makedirs(out, exist_ok=True)
    shutil.copyfile(os.path.join(model, "config.json"), os.path.join(out, "config.json"))
    t = time.time()
    save_tensors(os.path.join(out, WEIGHTS), hf_state_dict(init_params(Transformer(shape), 0, 8), shape))
    with open(text) as f:
        train_bpe([f.read()], min(vocab, shape.vocab_size)).save(os.path.join(out, "tokenizer.json"))
    print(f"[weights] {out}: random {shape.n_layers} layers x d_model {shape.d_model}, vocab {shape.vocab_size} "
          f"in {time.time() - t:.1f}s", flush=True)


def rss_of(pid: int) -> float:
    """A process's resident set in MB (/proc: Linux, where the lent GPUs run), 0 once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0


class RssByLine:
    """The trainer's host RSS sampled every 20 ms, each sample charged to the last line it printed: where in a run
    the host memory goes (its phases print a line each), without instrumenting the trainer."""

    def __init__(self, pid: int):
        self.pid, self.lines, self.peaks, self.done = pid, ["(start)"], [0.0], threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.02):
            i = len(self.lines) - 1
            self.peaks[i] = max(self.peaks[i], rss_of(self.pid))

    def line(self, text: str) -> None:
        self.peaks.append(0.0)  # peaks before lines: the sampler may read the new index meanwhile
        self.lines.append(text.rstrip()[:110])

    def report(self, top: int = 12) -> list[str]:
        """The lines after which RSS rose most (in the order they printed), each with the peak it reached."""
        self.done.set()
        self.thread.join()
        before = [0.0, *itertools.accumulate(self.peaks, max)]  # the highest RSS before each line's samples
        rises = [(p - before[i], i) for i, p in enumerate(self.peaks)]
        keep = sorted(i for r, i in sorted(rises, reverse=True)[:top] if r > 0 or i == 0)
        return [f"[rss] {self.peaks[i]:8,.0f} MB (+{max(rises[i][0], 0):,.0f}) after: {self.lines[i]}" for i in keep]


def trainer(args: list[str], log: str) -> int:
    """train_optimized.py in its own process, its output to the console and to `log`; then where its RSS rose."""
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_optimized.py"), *args], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        rss = RssByLine(p.pid)
        for line in p.stdout:
            print(line, end="", flush=True)
            f.write(line)
            rss.line(line)
        rc = p.wait()
        report = rss.report()
        print("\n".join(report), flush=True)
        f.write("\n".join(report) + "\n")
        return rc


def plan(a: argparse.Namespace, flags: list[str]) -> None:
    os.makedirs(a.out, exist_ok=True)
    rc = trainer(["--use-streaming", "--init-from", a.model, "--dataset-id", a.text, "--plan-for", a.target,
                  "--output-dir", a.out, *flags], os.path.join(a.out, "plan.log"))
    print(f"[plan] exit {rc}: {os.path.join(a.out, 'plan.json')}")


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def compare(summary: dict, planned: dict | None) -> dict:
    """The run's device figures beside the plan's programs (MB per device), and its host RSS beside pre-flight's
    prediction (the last one it made: after the sampler's compile on a GPU)."""
    row = {k: summary.get(k) for k in ("peak_device_mb", "estimated_device_mb", "compiled_device_mb", "steps",
                                       "eval_loss", "tokens_per_sec", "mfu", "compile_time_s", "wall_time_s",
                                       "peak_rss_mb", "estimated_peak_rss_mb", "loading_rss_mb")}
    if summary.get("peak_rss_mb") and summary.get("estimated_peak_rss_mb"):  # the host's side of the prediction
        row["host_peak_over_prediction"] = round(summary["peak_rss_mb"] / summary["estimated_peak_rss_mb"], 3)
    if planned:
        row["plan"] = [{k: p.get(k) for k in ("program", "planned_mb", "xla_peak_mb", "device_mb", "fits")}
                       for p in planned["programs"]]
        peak = max(p["xla_peak_mb"] or 0 for p in planned["programs"])
        row["largest_planned_program_mb"] = peak
        if peak and summary.get("peak_device_mb"):  # None where the backend reports no allocator (a CPU)
            row["run_peak_over_plan"] = round(summary["peak_device_mb"] / peak, 3)
    return row


def run(a: argparse.Namespace, flags: list[str]) -> None:
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_trainer_run_")  # weights and checkpoints: large, kept out of --out
    folder, run_dir = os.path.join(work, "model"), os.path.join(work, "run")
    try:
        # its own process, on the CPU: a jax client in this one would hold the card the trainer measures
        subprocess.run([sys.executable, os.path.abspath(__file__), "weights", "--model", a.model, "--text", a.text,
                        "--out", folder], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        rc = trainer(["--use-streaming", "--init-from", folder, "--dataset-id", a.text, "--output-dir", run_dir,
                      *flags], os.path.join(a.out, "trainer.log"))
        for name in ("summary.json", "metrics.jsonl", "samples.txt", "config.json"):
            if os.path.exists(os.path.join(run_dir, name)):
                shutil.copyfile(os.path.join(run_dir, name), os.path.join(a.out, name))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    planned = read_json(a.plan) if a.plan else None
    summary_path = os.path.join(a.out, "summary.json")
    result = {"exit": rc, **(compare(read_json(summary_path), planned) if os.path.exists(summary_path) else {})}
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


def main() -> None:
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("plan", "run", "weights"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True, help="a folder holding a Hugging Face config.json")
        s.add_argument("--text", default=os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt"))
        s.add_argument("--out", required=True)
    sub.choices["plan"].add_argument("--target", default="h100-80gb")
    sub.choices["run"].add_argument("--plan", help="plan.json of the same flags, made here with `plan`")
    a = p.parse_args(argv)
    if a.cmd == "weights":
        random_model(a.model, a.text, a.out)
    else:
        (plan if a.cmd == "plan" else run)(a, flags)


if __name__ == "__main__":
    main()
