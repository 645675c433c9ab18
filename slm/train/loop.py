"""The train loop: micro-batches in, optimizer steps out, callbacks around each step. Nothing else.

Everything the loop changes lives in one explicit `RunState` (the device train state and the host
counters a checkpoint saves); everything else a run does (logging, progress, eval and samples,
checkpoints, tracking, the non-finite guard, the stop conditions) is a `Callback` called in order after
each optimizer step. A callback that returns a reason stops the run: the callbacks after it do not run
for that step, so a guard placed before the checkpoint callback stops the run before anything is saved.
The step is any function (state, batch, lr) -> (state, {"loss", "finite"}), so the loop runs with a fake
step in tests (tests/train/test_loop.py) and with the compiled jax step in training. A step with a
`flush(state, lr) -> state` method applies a partial accumulation left when the data runs out.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np

from slm.optim.schedule import lr_at, warmup_done
from slm.train.devices import Processes
from slm.train.throughput import Throughput


@dataclass(frozen=True)
class Due:
    """What falls due at this optimizer step."""

    log: bool = False
    eval: bool = False
    save: bool = False

    @property
    def any(self) -> bool:
        return self.log or self.eval or self.save


@dataclass
class Timings:
    """Wall-clock bookkeeping: start-up (first batch, first step) and eval time are kept out of train time."""

    train_start: float = 0.0
    first_batch_s: float = 0.0  # fetching before the first step (fills the shuffle buffer): start-up
    compile_s: float | None = None  # the first step, end to end (it was compiled in pre-flight)
    wait_s: float = 0.0  # waiting for the data after the first step
    eval_s: float = 0.0
    last_save: float = 0.0
    train_s: float = 0.0  # frozen when the loop ends


# Keys of RunState saved in each checkpoint's meta record (with "processes"), the names older runs used.
SAVED = ("step", "tokens", "epoch", "micro_step", "epoch_micro", "warmup_end", "est_total_tokens", "data_digest",
         "skipped_nonfinite", "base_fingerprint", "train_from", "elapsed_s", "progress", "stable_step")


@dataclass
class RunState:
    """The loop's explicit state: the device train state plus the host counters (SAVED are checkpointed)."""

    train_state: Any = None
    step: int = 0  # optimizer steps
    tokens: int = 0  # global tokens of the completed optimizer steps
    epoch: int = 0
    micro_step: int = 0
    epoch_micro: int = 0  # micro-steps into this epoch (the full-load path resumes by it)
    warmup_end: float | None = None  # run progress when warmup finished: the cosine spans the rest
    train_from: float | None = None  # run progress at the first step (a --max-time run's startup came before)
    est_total_tokens: float | None = None  # epochs-bounded runs: the schedule's length
    data_digest: str = ""  # sha256 chained over every micro-batch consumed
    skipped_nonfinite: int = 0
    base_fingerprint: str | None = None  # LoRA: sha256 of the frozen base the adapters were trained on
    elapsed_s: float = 0.0  # the run's --max-time clock at the latest step (_stepped): all sessions' time
    progress: float = 0.0  # the schedule's progress at the latest step (a resume re-plans from it)
    stable_step: int | None = None  # WSD: the last step before the decay; its checkpoint is kept (a longer run
    # branches from it: slm.train.restore)
    # this process's view, not saved
    prior_s: float = 0.0  # the --max-time clock at this session's start: earlier sessions', less its start-up
    lr: float = 0.0
    losses: list = field(default_factory=list)  # per micro-step loss (device scalars) since the last log
    step_losses: list = field(default_factory=list)  # the latest optimizer step's micro-step losses (device scalars)
    finite: list = field(default_factory=list)  # per micro-step flags not yet checked
    checked_micro: int = 0  # micro-steps whose flags have been checked
    last_eval: dict | None = None
    stop_reason: str = "epochs done"
    stopped: bool = False
    nonfinite_stop: bool = False
    due: Due = Due()
    timings: Timings = field(default_factory=Timings)
    throughput: Throughput = field(default_factory=Throughput)

    def meta(self, processes: int) -> dict:
        """The saved counters as JSON types (a numpy scalar that slipped in would fail the save)."""
        plain = lambda v: v.item() if isinstance(v, np.generic) else v
        return {**{k: plain(getattr(self, k)) for k in SAVED}, "processes": processes}

    @classmethod
    def from_meta(cls, meta: dict, **kwargs: Any) -> RunState:
        run = cls(**{k: meta[k] for k in SAVED if k in meta}, **kwargs)
        run.checked_micro = run.micro_step
        return run

    def stop(self, reason: str) -> None:
        self.stop_reason, self.stopped = reason, True

    def consume(self, batch: dict, metrics: dict) -> None:
        """Count one micro-step and chain its batch into the data digest."""
        self.losses.append(metrics["loss"])
        self.finite.append(metrics["finite"])
        self.micro_step += 1
        self.epoch_micro += 1
        self.data_digest = hashlib.sha256(bytes.fromhex(self.data_digest) + batch["input_ids"].tobytes()
                                          + batch["targets"].tobytes()).hexdigest()


class Callback:
    """Hooks around the loop; every method is optional. `on_step` returning a reason stops the run."""

    def on_first_step(self, run: RunState) -> None:
        """After the first micro-step has run (the compiled step's first execution)."""

    def on_step(self, run: RunState) -> str | None:
        """After each optimizer step; `run.due` says what falls due."""
        return None

    def on_epoch_end(self, run: RunState) -> None:
        """After an epoch ran out of data (not after a stop)."""

    def on_loop_end(self, run: RunState) -> None:
        """When the loop is over, before train time is frozen."""

    def on_train_end(self, run: RunState) -> None:
        """After the loop, for the final eval and save (called by the trainer, in order)."""

    def close(self) -> None:
        """Release files, threads and managers; called however the run ends, errors included."""


@dataclass
class Schedule:
    """The learning rate at a step: warmup by steps, then cosine or WSD over the run's progress, which is by
    steps (--max-steps), by the fraction of --max-time spent (process 0's clock), or by tokens."""

    peak: float
    warmup: int
    max_steps: int | None = None
    max_time: float | None = None
    start: float = 0.0  # what --max-time counts from
    epochs: int = 1
    kind: str = "cosine"  # or "wsd" (slm.optim.schedule.lr_at)
    decay_frac: float = 0.5

    def progress(self, run: RunState, now: float, procs: Processes) -> float:
        """The fraction of the run done: by steps, by the --max-time clock (earlier sessions' time included), or
        by tokens."""
        if self.max_steps:
            return run.step / self.max_steps
        if self.max_time:
            return procs.value0((run.prior_s + now - self.start) / self.max_time)
        return run.tokens / run.est_total_tokens if run.est_total_tokens else 0.0

    def replan(self, run: RunState, procs: Processes, tokens_per_step: int) -> tuple[float, float]:
        """A resumed run's schedule over its (possibly new) end: the progress marks saved in the old run's terms
        (warmup's end, the first step) rescaled by where the checkpoint stands in the new terms, so the rate
        follows the schedule a straight run to the new end would have had. (old, new) progress at the checkpoint."""
        # the saved progress was read before the checkpoint's last step ran; so is `new`, at the same counters
        last = replace(run, step=max(run.step - 1, 0), tokens=max(run.tokens - tokens_per_step, 0))
        old, new = run.progress, self.progress(last, self.start, procs)
        if old > 0:
            scale = new / old
            run.warmup_end = None if run.warmup_end is None else min(run.warmup_end * scale, 1.0)
            run.train_from = None if run.train_from is None else min(run.train_from * scale, 0.5)
        return old, new

    def lr(self, run: RunState, now: float, procs: Processes) -> float:
        progress = run.progress = self.progress(run, now, procs)  # saved: a resume re-plans from it
        if run.train_from is None:
            run.train_from = min(progress, 0.5)
        if run.warmup_end is None and warmup_done(progress, run.step, self.warmup, run.train_from):
            run.warmup_end = progress
        return lr_at(progress, run.step, self.peak, self.warmup, warmup_end=run.warmup_end or 0.0,
                     kind=self.kind, decay_frac=self.decay_frac, warmup_from=run.train_from)

    def decays_next(self, run: RunState, now: float, procs: Processes) -> bool:
        """WSD: whether the next step is the run's first with a decayed rate (its progress, as read now, past
        1 - decay_frac), so the state now is the last of the stable phase."""
        if self.kind != "wsd" or self.decay_frac >= 1 or run.stable_step is not None:
            return False
        stable = 1 - self.decay_frac
        return run.progress < stable <= self.progress(run, now, procs)  # the step just taken had the peak rate

    def epoch_done(self, run: RunState) -> None:
        if run.epoch == 0 and not (self.max_steps or self.max_time):  # one epoch counted: the schedule is exact
            run.est_total_tokens = run.tokens * self.epochs


@dataclass
class Cadence:
    """When logging, eval and checkpoints fall due: every N steps, and checkpoints every M minutes."""

    log_every: int
    eval_every: int
    checkpoint_every: int
    checkpoint_minutes: float | None = None

    def due(self, run: RunState, now: float, procs: Processes) -> Due:
        save = run.step % self.checkpoint_every == 0 or (bool(self.checkpoint_minutes) and procs.any(
            now - run.timings.last_save >= 60 * self.checkpoint_minutes))
        return Due(log=run.step % self.log_every == 0, eval=run.step % self.eval_every == 0, save=save)


@dataclass
class LoopPlan:
    """The loop's fixed settings."""

    epochs: int
    accumulation: int
    tokens_per_step: int  # global tokens per optimizer step
    micro_tokens: int  # global tokens per micro-step
    schedule: Schedule
    cadence: Cadence


Step = Callable[[Any, dict, np.float32], tuple[Any, dict]]
StepFor = Callable[[int], Step]  # the step of epoch e (--dropout-from-epoch: a later epoch's differs)
OpenEpoch = Callable[[int, bool], Iterator[dict]]  # (epoch, continuing a resumed epoch) -> batches


def run_loop(run: RunState, step_for: StepFor, open_epoch: OpenEpoch, callbacks: Sequence[Callback], plan: LoopPlan,
             procs: Processes = Processes(), clock: Callable[[], float] = time.time, resumed: bool = False) -> None:
    """Train from `run` until the data, a stop condition or a callback ends it; `run` holds the result."""
    first_epoch, step = run.epoch, None
    run.timings.train_start = run.timings.last_save = clock()
    for epoch in range(first_epoch, plan.epochs):
        continuing = resumed and epoch == first_epoch
        run.epoch, run.epoch_micro = epoch, run.epoch_micro if continuing else 0
        batches = open_epoch(epoch, continuing)
        try:
            step = _step_of(run, step_for, epoch, clock)
            _epoch(run, step, batches, callbacks, plan, procs, clock)
        finally:
            getattr(batches, "close", lambda: None)()  # stops a prefetch thread now
        if run.stopped:
            break
        plan.schedule.epoch_done(run)
        for cb in callbacks:
            cb.on_epoch_end(run)
    if not run.stopped and step is not None:
        _finish_accumulation(run, step, callbacks, plan, procs, clock)
    for cb in callbacks:
        cb.on_loop_end(run)
    t = run.timings
    t.train_s = clock() - t.train_start - t.first_batch_s - (t.compile_s or 0.0) - t.eval_s


def _step_of(run: RunState, step_for: StepFor, epoch: int, clock: Callable[[], float]) -> Step:
    """Epoch `epoch`'s step. Past the first step, the time it takes (a compile: --dropout-from-epoch) counts as
    compile time, not training, and stays out of the throughput window."""
    t0 = clock()
    step = step_for(epoch)
    if run.timings.compile_s is not None:
        spent = clock() - t0
        run.timings.compile_s += spent
        run.throughput.pause(spent)
    return step


def _epoch(run: RunState, step: Step, batches: Iterator[dict], callbacks: Sequence[Callback], plan: LoopPlan,
           procs: Processes, clock: Callable[[], float]) -> None:
    while True:
        t0 = time.perf_counter()
        batch = next(batches, None)
        waited = time.perf_counter() - t0
        if procs.any(batch is None):  # processes end an epoch together (their parts differ by < a batch)
            return
        if run.timings.compile_s is None:
            run.timings.first_batch_s += waited
        else:
            run.timings.wait_s += waited
            run.throughput.add(wait_s=waited)
        run.lr = plan.schedule.lr(run, clock(), procs)
        run.train_state, metrics = step(run.train_state, batch, np.float32(run.lr))
        run.consume(batch, metrics)
        if run.timings.compile_s is None:
            jax.block_until_ready(metrics["loss"])
            run.timings.compile_s = clock() - run.timings.train_start - run.timings.first_batch_s
            run.throughput.start(clock(), -plan.micro_tokens)  # this micro-batch ran before the window
            for cb in callbacks:
                cb.on_first_step(run)
        if run.micro_step % plan.accumulation:
            continue
        _stepped(run, plan.tokens_per_step, callbacks, plan, procs, clock)
        if run.stopped:
            return


def _stepped(run: RunState, tokens: int, callbacks: Sequence[Callback], plan: LoopPlan, procs: Processes,
             clock: Callable[[], float]) -> None:
    """Count an optimizer step of `tokens` global tokens and call the callbacks; any of them may stop the run."""
    run.step += 1
    run.tokens += tokens
    run.elapsed_s = run.prior_s + clock() - plan.schedule.start  # --max-time's clock, read before any callback saves
    run.step_losses = run.losses[-(tokens // plan.micro_tokens):]  # its micro-steps; LogMetrics empties losses
    run.throughput.add(tokens)
    run.due = plan.cadence.due(run, clock(), procs)
    if plan.schedule.decays_next(run, clock(), procs):  # WSD's stable phase ends here: its checkpoint is kept
        run.stable_step, run.due = run.step, replace(run.due, save=True)
    for cb in callbacks:
        if reason := cb.on_step(run):
            run.stop(reason)
            break
    if procs.count > 1 and procs.any(run.stopped) and not run.stopped:
        run.stop("another process stopped (time, signal or STOP file)")  # all stop at this step


def _finish_accumulation(run: RunState, step: Step, callbacks: Sequence[Callback], plan: LoopPlan,
                         procs: Processes, clock: Callable[[], float]) -> None:
    """The data ran out m < k micro-batches into an accumulation: apply their mean gradient as one more
    (smaller) optimizer step rather than drop them. Not after a stop: stops fall on whole steps."""
    partial = run.micro_step % plan.accumulation
    flush = getattr(step, "flush", None)
    if not partial or flush is None:
        return
    run.lr = plan.schedule.lr(run, clock(), procs)
    run.train_state = flush(run.train_state, np.float32(run.lr))
    _stepped(run, partial * plan.micro_tokens, callbacks, plan, procs, clock)
