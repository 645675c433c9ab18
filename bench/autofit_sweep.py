"""--auto-fit against its budget: does the run it picks stay under --memory-budget, and is the estimate right?

    nice -n 10 .venv/bin/python bench/autofit_sweep.py                        # all 54 runs (hours on 2 cores)
    nice -n 10 .venv/bin/python bench/autofit_sweep.py --only budget=2GB      # one budget column first
    .venv/bin/python bench/autofit_sweep.py --only params=20M,seq=256 --steps 1
    .venv/bin/python bench/autofit_sweep.py --report                          # the table of what is measured so far

Sweeps target params 5M/20M/50M x seq 128/256/512 x --memory-budget 1.5/2/3GB x float32 / --use-8bit-optimizer,
requested batch 64, --auto-fit, on ../shared/data/tinystories_train.txt. Each combination is one trainer process
(streaming, `--steps` optimizer steps, an eval and a checkpoint after every step, so a step runs after the
first eval and save: the peak is often there) with its own empty XLA compile cache (every program compiled,
as on a first run: the larger, worse case). Results go to a JSONL file, one line per combination, so the sweep
resumes where it stopped; `--rerun` measures again. Per combination: did auto-fit find a fit (a combination
nothing fits is reported, and passes), what it chose, the effective batch (must stay 64), the measured peak RSS
against the budget (ratio <= 1.0, and >= 0.5 unless the requested setting itself fits with room), and the
pre-flight's whole-run estimate against the measured peak (within +-10%).
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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data", "tinystories_train.txt")
PARAMS = {"5M": 5_000_000, "20M": 20_000_000, "50M": 50_000_000}
SEQS = (128, 256, 512)
BUDGETS = ("2GB", "1.5GB", "3GB")  # the 2GB column first: the budget
OPTS = ("fp32", "8bit")
BATCH = 64
ERR_LIMIT = 0.10
MIN_RATIO = 0.5


def combos() -> list[dict]:
    """Every combination, in the order the sweep runs them (budget column by column)."""
    return [{"budget": b, "params": p, "seq": s, "opt": o}
            for b, p, s, o in itertools.product(BUDGETS, PARAMS, SEQS, OPTS)]


def key(c: dict) -> str:
    return f"params={c['params']},seq={c['seq']},budget={c['budget']},opt={c['opt']}"


def selected(c: dict, only: list[str]) -> bool:
    """`--only params=20M,seq=256` style filters: every name=value given must match (values ORed with '|')."""
    for item in only:
        name, _, values = item.partition("=")
        if str(c.get(name.strip())) not in values.split("|"):
            return False
    return True


def command(c: dict, out: str, steps: int) -> list[str]:
    flags = ["--use-8bit-optimizer"] if c["opt"] == "8bit" else []
    return [sys.executable, os.path.join(ROOT, "train_optimized.py"), "--use-streaming", "--dataset-id", DATA,
            "--target-params", str(PARAMS[c["params"]]), "--seq-len", str(c["seq"]), "--batch-size", str(BATCH),
            "--memory-budget", c["budget"], "--auto-fit", "--max-steps", str(steps), "--eval-every", "1",
            "--checkpoint-every", "1", "--eval-tokens", "4096", "--log-every", "1", "--output-dir", out, *flags]


def run_one(c: dict, steps: int, timeout: float) -> dict:
    """One trainer process for one combination; its outcome as a flat dict."""
    tmp = tempfile.mkdtemp(prefix="autofit_")
    out = os.path.join(tmp, "run")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_COMPILATION_CACHE_DIR": os.path.join(tmp, "xla")}
    t0 = time.time()
    try:
        r = subprocess.run(command(c, out, steps), capture_output=True, text=True, env=env, cwd=tmp, timeout=timeout,
                           check=False)
        rc, stderr = r.returncode, r.stderr
    except subprocess.TimeoutExpired:
        rc, stderr = "timeout", f"over {timeout:.0f}s"
    row = {**c, "key": key(c), "steps": steps, "wall_s": round(time.time() - t0, 1), "rc": rc,
           "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        row.update(outcome(out, rc, stderr))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return row


def outcome(out: str, rc: int | str, stderr: str) -> dict:
    """What the run chose and measured (summary.json, config.json), or why it did not run."""
    if rc == 2 and "--auto-fit" in stderr and "fits" in stderr:
        return {"fit": False, "note": last_line(stderr)}
    if rc != 0:
        return {"fit": None, "note": f"failed: {last_line(stderr)}"}
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    keys = ("batch_size", "gradient_accumulation_steps", "use_8bit_optimizer", "use_mixed_precision",
            "gradient_checkpointing")
    return {"fit": True, **{k: cfg[k] for k in keys}, "devices": s["devices"], "peak_rss_mb": s["peak_rss_mb"],
            "estimated_peak_rss_mb": s["estimated_peak_rss_mb"], "compiled_device_mb": s["compiled_device_mb"],
            "formula_peak_rss_mb": s.get("formula_peak_rss_mb"), "base_rss_mb": s.get("base_rss_mb")}


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def budget_mb(text: str) -> float:
    return float(text.rstrip("GB")) * 1024


def verdict(r: dict) -> tuple[list[str], str]:
    """(what failed, the ratio column's note) for one row."""
    if r.get("fit") is False:
        return [], ""
    if r.get("fit") is None:
        return [f"run failed ({r.get('note', '')})"], ""
    bad = []
    ratio = r["peak_rss_mb"] / budget_mb(r["budget"])
    err = r["estimated_peak_rss_mb"] / r["peak_rss_mb"] - 1
    as_asked = r["batch_size"] == BATCH and r["gradient_accumulation_steps"] == 1 and not (
        r["use_mixed_precision"] or r["gradient_checkpointing"] or (r["use_8bit_optimizer"] and r["opt"] == "fp32"))
    if r["batch_size"] * r["gradient_accumulation_steps"] != BATCH:
        bad.append("effective batch changed")
    if ratio > 1.0:
        bad.append(f"over budget ({ratio:.2f})")
    note = ""
    if ratio < MIN_RATIO:
        if as_asked:
            note = " (as asked)"  # the requested setting needs less than half the budget: nothing to fill
        else:
            bad.append(f"under half the budget ({ratio:.2f})")
    if abs(err) > ERR_LIMIT:
        bad.append(f"estimate off by {err:+.1%}")
    return bad, note


def table(rows: list[dict]) -> str:
    head = ("| params | seq | budget | opt | fit | micro × acc | 8-bit | bf16 | remat | eff. batch | peak RSS MB "
            "| peak/budget | est. peak MB | est. err | formula MB (err) | wall s | ok |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    on = {True: "on", False: "off"}
    for r in rows:
        bad, note = verdict(r)
        ok = "pass" if not bad else "FAIL: " + "; ".join(bad)
        cells = [r["params"], str(r["seq"]), r["budget"], r["opt"]]
        if r.get("fit") is not True:
            cells += ["no fit" if r.get("fit") is False else "failed", *["-"] * 11,
                      f"{r['wall_s']:.0f}", ok if r.get("fit") is None else "pass (cannot fit)"]
        else:
            ratio = r["peak_rss_mb"] / budget_mb(r["budget"])
            cells += ["yes", f"{r['batch_size']} × {r['gradient_accumulation_steps']}", on[r["use_8bit_optimizer"]],
                      on[r["use_mixed_precision"]], on[r["gradient_checkpointing"]],
                      str(r["batch_size"] * r["gradient_accumulation_steps"]), f"{r['peak_rss_mb']:,.0f}",
                      f"{ratio:.2f}{note}", f"{r['estimated_peak_rss_mb']:,.0f}",
                      f"{r['estimated_peak_rss_mb'] / r['peak_rss_mb'] - 1:+.1%}", formula(r), f"{r['wall_s']:.0f}", ok]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def formula(r: dict) -> str:
    """The pure arithmetic's whole-run figure (what auto-fit ranks by) and its error, where recorded."""
    f = r.get("formula_peak_rss_mb")
    return f"{f:,.0f} ({f / r['peak_rss_mb'] - 1:+.1%})" if f else "-"


def load(path: str) -> dict[str, dict]:
    rows = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    rows[r["key"]] = r  # the newest measurement of a combination wins
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="filters, e.g. 'budget=2GB,params=5M|20M,opt=8bit'")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per run (eval + checkpoint after each)")
    p.add_argument("--results", default=os.path.join(tempfile.gettempdir(), "autofit_sweep.jsonl"),
                   help="JSONL of measured combinations (the sweep resumes from it)")
    p.add_argument("--rerun", action="store_true", help="measure combinations already in --results again")
    p.add_argument("--report", action="store_true", help="only print the table of --results")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--max-minutes", type=float, default=None, help="start no run after this much wall time")
    p.add_argument("--nice", type=int, default=10, help="niceness of the runs (this process and its children)")
    a = p.parse_args()
    only = [x for x in a.only.split(",") if x.strip()]
    todo = [c for c in combos() if selected(c, only)]
    done = load(a.results)
    if not a.report:
        os.nice(a.nice)
        t0 = time.time()
        for c in todo:
            if key(c) in done and not a.rerun:
                continue
            if a.max_minutes is not None and time.time() - t0 > a.max_minutes * 60:
                print(f"stopping: --max-minutes {a.max_minutes} spent", flush=True)
                break
            row = run_one(c, a.steps, a.timeout)
            with open(a.results, "a") as f:
                f.write(json.dumps(row) + "\n")
            done[row["key"]] = row
            bad, _ = verdict(row)
            print(f"{row['key']}: {'pass' if not bad else '; '.join(bad)} ({row['wall_s']:.0f}s)", flush=True)
    rows = [done[key(c)] for c in todo if key(c) in done]
    print(table(rows))
    failed = [r["key"] for r in rows if verdict(r)[0]]
    print(f"{'PASS' if not failed else 'FAIL'}: {len(rows)} of {len(todo)} selected combinations measured, "
          f"{sum(r.get('fit') is True for r in rows)} fit, {sum(r.get('fit') is False for r in rows)} cannot fit, "
          f"{len(failed)} failed{': ' + '; '.join(failed) if failed else ''}")


if __name__ == "__main__":
    main()
