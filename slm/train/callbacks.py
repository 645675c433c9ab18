"""The trainer's callbacks, in the order it calls them after each optimizer step:

    Console          progress bar (terminal, notebook) or plain log lines; the first-step line
    LogMetrics       a metrics row every --log-every steps: loss, lr, tokens/s, MFU, data wait, RSS
    NonFiniteGuard   stops the run at a NaN/Inf step beyond --skip-nonfinite, before anything is saved
    Evaluate         held-out loss and bits/byte, a sample, loss.png: every --eval-every steps and at the end
    SaveCheckpoints  orbax checkpoint of the state, the counters and the data stream; and at the end
    StopConditions   --max-steps, --max-time, SIGTERM/SIGINT, a STOP file
    LossPlot         loss.png after the final eval and save
    Emitter          (no step work) closes metrics.jsonl and the trackers

Rows go to every sink at once through an `Emitter` (metrics.jsonl, TensorBoard/W&B, the console).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from slm.data.mixture import mixture_summary
from slm.errors import DiskFullError
from slm.io.checkpoints import Checkpointer
from slm.io.metrics import MetricsLog
from slm.io.tracking import Trackers, plot_loss
from slm.memory.host import release_free_heap, rss_mb
from slm.train.devices import Processes
from slm.train.evaluate import Evaluator
from slm.train.interrupts import SignalWatcher, spend_stop, stop_requested
from slm.train.loop import Callback, RunState


class Console(Callback):
    """Where lines go: a tqdm bar on a terminal or in a notebook (widget), plain log lines otherwise."""

    def __init__(self, log: Callable[[str], None], bar: Any = None):
        self.log, self.bar = log, bar

    def line(self, text: str) -> None:
        (self.bar.write if self.bar is not None else self.log)(text)

    def postfix(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")

    def on_first_step(self, run: RunState) -> None:
        self.line(f"[run] first step {run.timings.compile_s:.1f}s (the step was compiled in pre-flight)")

    def on_step(self, run: RunState) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_loop_end(self, run: RunState) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def progress_bar(total: int | None) -> Any:
    """A tqdm bar on an interactive terminal or in a notebook (widget); None (plain log lines) otherwise."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if type(shell).__name__ == "ZMQInteractiveShell":  # Jupyter, VS Code and Colab kernels
        from tqdm.auto import tqdm
    elif sys.stderr.isatty():
        from tqdm import tqdm
    else:
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True)


class Emitter(Callback):
    """One row to every sink: metrics.jsonl, the trackers (TensorBoard, W&B) and the console; closes them."""

    def __init__(self, metrics: MetricsLog, trackers: Trackers | None, console: Console):
        self.metrics, self.trackers, self.console = metrics, trackers, console
        self.rows = 0

    def __call__(self, row: dict, line: str) -> None:
        self.rows += 1
        self.metrics.write(row)
        if self.trackers is not None:
            self.trackers.write(row)
        self.console.line(line)

    def close(self) -> None:
        self.metrics.close()
        if self.trackers is not None:
            self.trackers.close()


class LogMetrics(Callback):
    """A row every --log-every steps; the mean loss of the interval is the loop's only host sync."""

    def __init__(self, emit: Emitter, flops_per_token: float, peak_flops: float, devices: int, start: float,
                 device_mb: Callable[[], float | None], clock: Callable[[], float]):
        self.emit, self.fpt, self.peak_flops, self.devices = emit, flops_per_token, peak_flops, devices
        self.start, self.device_mb, self.clock = start, device_mb, clock

    def on_step(self, run: RunState) -> None:
        if not run.due.log:
            return
        loss = float(np.mean(jax.device_get(run.losses)))
        run.losses = []
        now = self.clock()
        tps, wait = run.throughput.rate(now)
        row = {"step": run.step, "loss": loss, "lr": run.lr, "tokens": run.tokens, "tokens_per_sec": tps,
               "tokens_per_sec_per_device": tps / self.devices, "mfu": self.fpt * tps / self.peak_flops,
               "data_wait_frac": wait, "rss_mb": rss_mb(), "elapsed_s": now - self.start, "epoch": run.epoch}
        if (device_mb := self.device_mb()) is not None:
            row["device_mb"] = device_mb
        per_device = f" ({tps / self.devices:,.0f}/device)" if self.devices > 1 else ""
        self.emit(row, f"step {run.step:6d} | loss {loss:.4f} | lr {run.lr:.2e} | {tps:,.0f} tok/s{per_device} "
                       f"| mfu {row['mfu']:.1%} | wait {wait:.1%} | rss {row['rss_mb']:,.0f} MB | {now - self.start:.0f}s")
        self.emit.console.postfix(loss, tps)
        run.throughput.start(now)


class NonFiniteGuard(Callback):
    """Checks the steps' `finite` flags whenever something is due: a non-finite step (which changed
    nothing) within --skip-nonfinite is logged and counted; the next one stops the run, before the
    eval and checkpoint callbacks run, so nothing is saved after it."""

    def __init__(self, allowed: int, accumulation: int, log: Callable[[str], None]):
        self.allowed, self.accumulation, self.log = allowed, accumulation, log

    def first_bad_step(self, run: RunState) -> int | None:
        """Sync the pending flags; the first non-finite step beyond the allowance, if any."""
        if not run.finite:
            return None
        ok, base = np.asarray(jax.device_get(run.finite)), run.checked_micro
        run.checked_micro, run.finite = run.checked_micro + len(run.finite), []
        for i in np.flatnonzero(~ok).tolist():
            bad = (base + i) // self.accumulation + 1
            if run.skipped_nonfinite >= self.allowed:
                return bad
            run.skipped_nonfinite += 1
            self.log(f"[run] step {bad}: non-finite loss or gradient, skipped ({run.skipped_nonfinite} of "
                     f"--skip-nonfinite {self.allowed})")
        return None

    def _stop(self, run: RunState, bad: int) -> str:
        run.nonfinite_stop = True
        return f"non-finite loss or gradient at step {bad} (skipped; nothing saved after it)"

    def on_step(self, run: RunState) -> str | None:
        if run.due.any and (bad := self.first_bad_step(run)):
            return self._stop(run, bad)
        return None

    def on_loop_end(self, run: RunState) -> None:
        if not run.nonfinite_stop and (bad := self.first_bad_step(run)):
            run.stop(self._stop(run, bad))


class Evaluate(Callback):
    """Held-out loss, perplexity and bits/byte plus a sample, every --eval-every steps and at the end
    (unless a signal stopped the run: then it saves at once instead)."""

    def __init__(self, evaluator: Evaluator, emit: Emitter, plot: Callable[[], None], signals: SignalWatcher,
                 procs: Processes, log: Callable[[str], None], clock: Callable[[], float]):
        self.evaluator, self.emit, self.plot, self.signals = evaluator, emit, plot, signals
        self.procs, self.log, self.clock = procs, log, clock

    def evaluate(self, run: RunState) -> None:
        t0 = self.clock()
        scored = self.evaluator.score(run.train_state.params)
        if scored is None:
            why = self.signals.received[0] if self.signals.received else "a signal to another process"
            self.log(f"[run] eval at step {run.step} aborted by {why}")
            return
        nats, count = scored
        loss = nats / count
        row = {"step": run.step, "tokens": run.tokens, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50)),
               "eval_bpb": nats / math.log(2) / self.evaluator.eval_set.n_bytes, "eval_tokens": int(count)}
        sample = self.evaluator.sample(run.train_state.params, run.step)
        self.emit(row, f"eval step {run.step} | loss {loss:.4f} | ppl {row['eval_ppl']:.2f} | bpb {row['eval_bpb']:.4f} "
                       f"| sample: {sample[:80]!r}")
        self.plot()
        release_free_heap()  # the eval and sampling programs' compile leftovers: not kept beside the next steps
        spent = self.clock() - t0
        run.timings.eval_s += spent
        run.throughput.pause(spent)  # keep eval time out of the next interval's tokens/s
        run.last_eval = row

    def on_step(self, run: RunState) -> None:
        if run.due.eval:
            self.evaluate(run)

    def on_train_end(self, run: RunState) -> None:
        signalled = self.procs.any(bool(self.signals.received))
        if not signalled and (run.last_eval is None or run.last_eval["step"] != run.step):
            self.evaluate(run)


class SaveCheckpoints(Callback):
    """An orbax checkpoint every --checkpoint-every steps (or --checkpoint-minutes) and at the end, holding
    the train state, the run's counters and every process's data-stream position."""

    def __init__(self, ckpt: Checkpointer, stream_state: Callable[[], dict | None] | None, procs: Processes,
                 clock: Callable[[], float]):
        self.ckpt, self.stream_state, self.procs, self.clock = ckpt, stream_state, procs, clock

    def save(self, run: RunState) -> None:
        stream = self.stream_state() if self.stream_state else None
        if self.procs.count > 1 and self.stream_state:  # every process's stream position, in the one checkpoint
            stream = {"processes": self.procs.gather({"loader": stream, "digest": run.data_digest})}
        scored = run.last_eval if run.last_eval and run.last_eval["step"] == run.step else None
        self.ckpt.pinned = {run.stable_step} if run.stable_step is not None else set()
        self.ckpt.save(run.step, run.train_state, run.meta(self.procs.count), stream,
                       eval_loss=scored["eval_loss"] if scored else None)
        run.timings.last_save = self.clock()

    def on_step(self, run: RunState) -> str | None:
        try:
            self.save(run) if run.due.save else self.ckpt.poll()
        except DiskFullError:  # the checkpointer kept it (ckpt.failure): raised once the summary is written
            return f"the disk is full: checkpoint {self.ckpt.failed_step} not saved"
        return None

    def on_train_end(self, run: RunState) -> None:
        if self.ckpt.failure is None and self.ckpt.latest_step() != run.step and not run.nonfinite_stop:
            try:
                self.save(run)
            except DiskFullError:
                pass  # in ckpt.failure

    def close(self) -> None:
        self.ckpt.close()


class StopConditions(Callback):
    """--max-steps, --max-time (the run's clock, RunState.elapsed_s: earlier sessions' time included), SIGTERM/SIGINT
    and a STOP file in the output dir."""

    def __init__(self, max_steps: int | None, max_time: float | None, signals: SignalWatcher, out_dir: str):
        self.max_steps, self.max_time, self.signals, self.out_dir = max_steps, max_time, signals, out_dir

    def on_step(self, run: RunState) -> str | None:
        if self.max_steps and run.step >= self.max_steps:
            return f"--max-steps {self.max_steps}"
        if self.max_time and run.elapsed_s >= self.max_time:
            return f"--max-time {self.max_time:g}s"
        if self.signals.received:
            return (f"{self.signals.received[0]}: stopped after this step, saved in the final checkpoint; resume with "
                    f"--resume {self.out_dir}")
        if stop_file := stop_requested(self.out_dir):
            spend_stop(stop_file)
            return f"{os.path.basename(stop_file)} file in the output dir (removed: --resume {self.out_dir} trains on)"
        return None


class LossPlot(Callback):
    """Redraws loss.png from metrics.jsonl (process 0) after each eval and at the end; a failed plot is a
    warning, never a stop."""

    def __init__(self, out_dir: str, enabled: bool, log: Callable[[str], None], emit: Emitter):
        self.out_dir, self.enabled, self.log, self.emit = out_dir, enabled, log, emit
        self.plotted = -1  # the emitter's row count at the last plot

    def __call__(self) -> None:
        if not self.enabled:
            return
        self.plotted = self.emit.rows
        try:
            plot_loss(os.path.join(self.out_dir, "metrics.jsonl"), os.path.join(self.out_dir, "loss.png"))
        except Exception as e:  # noqa: BLE001 - a plot must never stop training
            self.log(f"[plot] warning: loss.png not updated ({e})")

    def on_train_end(self, run: RunState) -> None:
        if self.emit.rows != self.plotted:  # rows since the final eval's plot (or no eval at all)
            self()


class MixtureShares(Callback):
    """With several --dataset-id: each source's realised share of training tokens beside its weight, at
    each eval and at the end (process 0)."""

    def __init__(self, counts: Callable[[], list[dict]], enabled: bool, log: Callable[[str], None]):
        self.counts, self.enabled, self.log = counts, enabled, log
        self.logged_step = -1

    def on_step(self, run: RunState) -> str | None:
        if run.due.eval:
            self._say(run)
        return None

    def on_train_end(self, run: RunState) -> None:
        self._say(run)

    def _say(self, run: RunState) -> None:
        if self.enabled and run.step != self.logged_step:
            self.logged_step = run.step
            self.log(mixture_summary(self.counts()))
