"""Experiment tracking for a run: TensorBoard always, Weights & Biases on request, and a loss plot.

`Trackers` takes the same rows as metrics.jsonl (slm.io.metrics.MetricsLog) so the train loop has one
place that emits a row. TensorBoard event files go into the run's output dir (``tensorboard --logdir
runs`` shows every run by its folder name); tensorboardX queues writes and flushes from its own
thread, so `write` costs microseconds. wandb is imported only when asked for: it is heavy, and absent
on most machines. `plot_loss` redraws loss.png from metrics.jsonl, so it works on any run, even a
crashed one. Heavy imports (tensorboardX, matplotlib, wandb) happen inside the functions that need
them, keeping ``import tracking`` free.
"""

from __future__ import annotations

import errno
import importlib
import json
import math
import os
import sys

from slm.errors import TrackingError
from slm.io.atomic import write_atomically

# metrics.jsonl key -> scalar tag. Keys not listed still appear, as train/<key> or eval/<key>.
TRAIN_TAGS = {"loss": "train/loss", "lr": "train/lr", "tokens": "train/tokens", "tokens_per_sec": "train/tokens_per_sec",
              "mfu": "train/mfu", "data_wait_frac": "train/data_wait_frac", "epoch": "train/epoch",
              "elapsed_s": "train/elapsed_s", "rss_mb": "memory/rss_mb", "device_mb": "memory/device_mb"}
EVAL_TAGS = {"eval_loss": "eval/loss", "eval_bpb": "eval/bpb", "eval_ppl": "eval/ppl", "eval_tokens": "eval/tokens"}
SKIP_KEYS = frozenset({"step"})  # the x-axis
WANDB_MISSING = "--wandb: the wandb package is not installed; pip install wandb"
TENSORBOARD_MISSING = ("the tensorboardX package is not installed (every run writes TensorBoard event files); "
                       "pip install -r requirements.txt, or pip install tensorboardX")


def is_eval_row(row: dict) -> bool:
    """Eval rows carry eval_loss; train rows carry loss (see slm.train.callbacks)."""
    return "eval_loss" in row


def row_scalars(row: dict) -> dict[str, float]:
    """The row's numeric values under their TensorBoard/wandb tags (None, strings and bools skipped)."""
    tags, prefix = (EVAL_TAGS, "eval/") if is_eval_row(row) else (TRAIN_TAGS, "train/")
    out = {}
    for k, v in row.items():
        if k in SKIP_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[tags.get(k) or prefix + (k[5:] if k.startswith("eval_") else k)] = float(v)
    return out


class Trackers:
    """Fans each metrics row out to TensorBoard (always) and wandb (``use_wandb=True``).

    out_dir: the run's output dir (event files go there). config: the resolved run config, written
    once as text (TensorBoard) or as the run config (wandb). purge_step: on --resume, the restored step + 1:
    TensorBoard then drops what the interrupted process logged after its checkpoint, so curves don't
    double back. wandb_project / run_name: passed to wandb.init (run_name defaults to the output dir's name).
    Raises TrackingError when wandb is asked for but not installed.
    """

    def __init__(self, out_dir: str, config: dict | None = None, *, use_wandb: bool = False,
                 wandb_project: str | None = None, run_name: str | None = None, purge_step: int | None = None):
        self.wandb = require_wandb() if use_wandb else None  # first: a missing package fails before any file is made
        SummaryWriter = _summary_writer_class()

        self.tb = SummaryWriter(logdir=out_dir, purge_step=purge_step, flush_secs=30, max_queue=100)
        self.wandb_run = None
        if config is not None:
            text = json.dumps(config, indent=2, default=str)
            self.tb.add_text("config", "\n".join("    " + line for line in text.splitlines()), global_step=0)  # markdown code block
        if self.wandb is not None:
            name = run_name or os.path.basename(os.path.normpath(out_dir))
            self.wandb_run = self.wandb.init(project=wandb_project or "slm-trainer", name=name, dir=out_dir,
                                             config=config or {})

    def write(self, row: dict) -> None:
        """Log one metrics.jsonl-shaped row at its optimizer step."""
        if self.tb is None:  # closed
            return
        step = int(row["step"])
        scalars = row_scalars(row)
        for tag, value in scalars.items():
            self.tb.add_scalar(tag, value, global_step=step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close everything (safe to call twice)."""
        if self.tb is not None:
            try:
                self.tb.close()
            except OSError as e:  # a full disk: its last events are lost (metrics.jsonl has the rows); the
                if e.errno != errno.ENOSPC:  # run reports the full disk itself
                    raise
            self.tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def require_tensorboard() -> None:
    """TrackingError unless tensorboardX imports: every run writes event files with it, so a broken install is
    refused before the data and the compile (a lent GPU image without it died at step 1, after pre-flight)."""
    try:
        _summary_writer_class()
    except ImportError:
        raise TrackingError(TENSORBOARD_MISSING) from None


def require_wandb():
    """The wandb module, or TrackingError: call it early (before data and compile) to fail fast on --wandb."""
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise TrackingError(WANDB_MISSING) from None


def read_metrics(metrics_path: str) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) of a metrics.jsonl, skipping a torn last line.

    After a --resume the file holds rows the interrupted process logged past its last checkpoint,
    then the resumed process's rows from that step on: a row whose step does not advance replaces
    the earlier rows at and after its step (what TensorBoard's purge_step does).
    """
    train: list[dict] = []
    evals: list[dict] = []
    with open(metrics_path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line being written, or cut by a crash
            if not isinstance(row, dict) or "step" not in row:
                continue
            rows = evals if is_eval_row(row) else train if "loss" in row else None
            if rows is None:
                continue
            while rows and rows[-1]["step"] >= row["step"]:
                rows.pop()
            rows.append(row)
    return train, evals


def plot_loss(metrics_path: str, out_png: str, log_x: bool = False) -> str:
    """Draw train and eval loss against tokens, eval bits/byte in a second panel; returns out_png.

    Written to a temporary file and renamed, so a viewer never reads half a PNG. Uses the Agg canvas
    directly (no pyplot), so the caller's matplotlib backend is left alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    train, evals = read_metrics(metrics_path)
    fig = Figure(figsize=(8, 6.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_bpb = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    points = [(r["tokens"], r["loss"]) for r in train if _finite(r.get("loss"))]
    if points:
        ax_loss.plot(*zip(*points), lw=1, color="tab:blue", label="train loss")
    points = [(r["tokens"], r["eval_loss"]) for r in evals if _finite(r.get("eval_loss"))]
    if points:
        ax_loss.plot(*zip(*points), "o-", ms=4, color="tab:orange", label="eval loss")
    points = [(r["tokens"], r["eval_bpb"]) for r in evals if _finite(r.get("eval_bpb"))]
    if points:
        ax_bpb.plot(*zip(*points), "o-", ms=4, color="tab:green", label="eval bits/byte")
    else:
        ax_bpb.text(0.5, 0.5, "no eval yet", ha="center", va="center", transform=ax_bpb.transAxes, color="gray")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_bpb.set_ylabel("eval bits/byte")
    ax_bpb.set_xlabel("tokens")
    last = max(train[-1:] + evals[-1:], key=lambda r: r["step"], default=None)
    run = os.path.basename(os.path.dirname(os.path.abspath(metrics_path)))
    ax_loss.set_title(f"{run}: step {last['step']:,}, {last['tokens']:,} tokens" if last else f"{run}: no rows yet")
    for ax in (ax_loss, ax_bpb):
        ax.grid(alpha=0.3)
        if log_x and (train or evals):
            ax.set_xscale("log")
    ax_bpb.xaxis.set_major_formatter(EngFormatter())  # 200 k, 1 M: no "1e6" offset to read
    if ax_loss.lines:
        ax_loss.legend(loc="upper right")
    write_atomically(out_png, lambda tmp: fig.savefig(tmp, format="png"))
    return out_png


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch.

    tensorboardX imports torch whenever it is installed, only to accept torch tensors; that costs
    ~200 MB of RSS and ~2 s here, in a trainer whose pre-flight promises a memory figure. Scalars
    need none of it, so torch is hidden for the import unless something already loaded it.
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


if __name__ == "__main__":  # python -m slm.io.tracking RUN_DIR: redraw RUN_DIR/loss.png
    run_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    print(plot_loss(os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "loss.png")))
