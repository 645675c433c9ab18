"""slm.train.loop with a fake step (no jax compile): every stop condition, the callback order, accumulation,
the schedule and cadence, and the stream of batches across epochs. Runs in well under a second."""

from __future__ import annotations

import numpy as np
import pytest

from slm.train.callbacks import NonFiniteGuard, StopConditions
from slm.train.devices import Processes
from slm.train.interrupts import SignalWatcher, stop_requested
from slm.train.loop import Cadence, Callback, LoopPlan, RunState, Schedule, run_loop

B, L = 2, 4


def batches(n: int, epoch: int = 0) -> list[dict]:
    rng = np.random.default_rng(epoch)
    ids = rng.integers(0, 50, (n, B, L + 1)).astype(np.int32)
    return [{"input_ids": b[:, :-1], "targets": b[:, 1:]} for b in ids]


class FakeStep:
    """(state, batch, lr) -> (state + 1, metrics); `bad` micro-steps (1-based) report a non-finite loss."""

    def __init__(self, bad: set[int] = frozenset()):
        self.calls, self.lrs, self.bad = 0, [], bad

    def __call__(self, state, batch, lr):
        self.calls += 1
        self.lrs.append(float(lr))
        finite = self.calls not in self.bad
        return state + 1, {"loss": np.float32(1.0 / self.calls), "finite": np.bool_(finite)}


class FakeClock:
    def __init__(self, tick: float = 1.0):
        self.now, self.tick = 1000.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


class Recorder(Callback):
    """Records every hook it sees, with the step, into a shared list."""

    def __init__(self, name: str, events: list, stop_at: int | None = None):
        self.name, self.events, self.stop_at = name, events, stop_at

    def on_first_step(self, run):
        self.events.append((self.name, "first", run.step))

    def on_step(self, run):
        self.events.append((self.name, "step", run.step))
        return f"{self.name} stops" if run.step == self.stop_at else None

    def on_epoch_end(self, run):
        self.events.append((self.name, "epoch_end", run.epoch))

    def on_loop_end(self, run):
        self.events.append((self.name, "loop_end", run.step))


def plan(epochs: int = 1, accumulation: int = 1, max_steps: int | None = None, max_time: float | None = None,
         log_every: int = 1, eval_every: int = 10**6, checkpoint_every: int = 10**6) -> LoopPlan:
    return LoopPlan(epochs, accumulation, B * L * accumulation, B * L,
                    Schedule(1e-3, 2, max_steps, max_time, start=1000.0, epochs=epochs),
                    Cadence(log_every, eval_every, checkpoint_every))


def run(n_batches: int = 6, lp: LoopPlan | None = None, callbacks=(), step=None, clock=None, run_state=None,
        step_for=None):
    state = run_state or RunState(train_state=0)
    opened = []

    def open_epoch(epoch: int, continuing: bool):
        opened.append((epoch, continuing))
        return iter(batches(n_batches, epoch))

    step = step or FakeStep()
    run_loop(state, step_for or (lambda epoch: step), open_epoch, list(callbacks), lp or plan(), Processes(),
             clock or FakeClock(), resumed=run_state is not None)
    return state, opened


def test_callbacks_run_in_order_and_a_stop_skips_the_rest_of_that_step():
    events = []
    cbs = [Recorder("a", events), Recorder("b", events, stop_at=3), Recorder("c", events)]
    state, _ = run(callbacks=cbs)
    assert state.step == 3 and state.stop_reason == "b stops" and state.stopped
    assert events[:3] == [("a", "first", 0), ("b", "first", 0), ("c", "first", 0)]
    steps = [e for e in events if e[1] == "step"]
    assert steps == [(n, "step", s) for s in (1, 2) for n in "abc"] + [("a", "step", 3), ("b", "step", 3)]
    assert events[-3:] == [("a", "loop_end", 3), ("b", "loop_end", 3), ("c", "loop_end", 3)]
    assert not any(e[1] == "epoch_end" for e in events)  # stopped: the epoch did not run out


def test_epochs_run_out_and_the_state_counts_everything():
    events = []
    state, opened = run(n_batches=5, lp=plan(epochs=2), callbacks=[Recorder("r", events)])
    assert opened == [(0, False), (1, False)]
    assert (state.step, state.micro_step, state.epoch, state.epoch_micro) == (10, 10, 1, 5)
    assert state.tokens == 10 * B * L and state.stop_reason == "epochs done" and not state.stopped
    assert [e for e in events if e[1] == "epoch_end"] == [("r", "epoch_end", 0), ("r", "epoch_end", 1)]
    assert len(state.data_digest) == 64 and state.train_state == 10


def test_each_epoch_runs_the_step_its_epoch_asks_for():
    """--dropout-from-epoch: the loop asks for epoch e's step when e begins (a resumed epoch included), so
    a later epoch can train with another compiled step."""
    steps, asked = {0: FakeStep(), 1: FakeStep(), 2: FakeStep()}, []

    def step_for(epoch):
        asked.append(epoch)
        return steps[min(epoch, 1)] if epoch < 2 else steps[2]

    state, _ = run(n_batches=3, lp=plan(epochs=3), step_for=step_for)
    assert asked[:3] == [0, 1, 2] and [steps[e].calls for e in range(3)] == [3, 3, 3] and state.micro_step == 9
    asked.clear()
    resumed = RunState(train_state=0, epoch=1, epoch_micro=1)
    run(n_batches=3, lp=plan(epochs=3), step_for=step_for, run_state=resumed)
    assert asked[:2] == [1, 2] and steps[0].calls == 3  # epoch 0 never ran again


def test_a_later_epochs_compile_counts_as_compile_time_not_training():
    """The step with dropout compiles when its epoch begins: those seconds go to compile_s, not train_s (so
    tokens/s and MFU in the summary stay true), and out of the throughput window."""
    clock, step, compiled = FakeClock(), FakeStep(), set()

    def step_for(epoch):
        if epoch == 1 and epoch not in compiled:
            clock.now += 100.0  # the compile, once
            compiled.add(epoch)
        return step

    state, _ = run(n_batches=3, lp=plan(epochs=2), step_for=step_for, clock=clock)
    assert state.timings.compile_s >= 100 and 0 < state.timings.train_s < 100 and state.micro_step == 6


def test_accumulation_makes_one_optimizer_step_of_k_micro_steps():
    events = []
    state, _ = run(n_batches=7, lp=plan(accumulation=3), callbacks=[Recorder("r", events)])
    assert (state.micro_step, state.step, state.tokens) == (7, 2, 2 * 3 * B * L)  # the 7th is a partial step
    assert [e[2] for e in events if e[1] == "step"] == [1, 2]  # a step without `flush` drops it


class FlushingStep(FakeStep):
    """A step that can apply a partial accumulation: the flush marks the state."""

    def __init__(self):
        super().__init__()
        self.flushed = []

    def flush(self, state, lr):
        self.flushed.append((self.calls, float(lr)))
        return state + 100


@pytest.mark.parametrize("n_batches, epochs, flushed", [(7, 1, [(7, "lr")]), (6, 1, []), (5, 2, [(10, "lr")])])
def test_a_partial_accumulation_at_the_end_of_the_data_is_applied(n_batches, epochs, flushed):
    events, step = [], FlushingStep()
    state, _ = run(n_batches=n_batches, lp=plan(epochs=epochs, accumulation=3), callbacks=[Recorder("r", events)],
                   step=step)
    micro = n_batches * epochs
    partial = micro % 3
    assert [c for c, _ in step.flushed] == [c for c, _ in flushed]  # once, after the last micro-step
    assert state.step == micro // 3 + (1 if partial else 0)
    assert state.tokens == micro * B * L  # every micro-batch's tokens counted: none dropped
    assert state.train_state == micro + (100 if partial else 0)
    assert [e[2] for e in events if e[1] == "step"] == list(range(1, state.step + 1))
    assert events[-1] == ("r", "loop_end", state.step)  # the flush step's callbacks ran before the loop ended


class LossTaker(Callback):
    """Takes each optimizer step's micro-step losses, as a user's live-plot callback would."""

    def __init__(self, seen: list):
        self.seen = seen

    def on_step(self, run):
        self.seen.append([float(x) for x in run.step_losses])


def test_each_step_hands_its_own_micro_losses_to_the_callbacks():
    """step_losses is the latest optimizer step's micro-step losses, whole steps and the flushed partial one, even
    after a logging callback has emptied run.losses (FakeStep's k-th micro-step reports loss 1/k)."""
    seen = []

    class Logger(Callback):
        def on_step(self, run):
            run.losses = []

    run(n_batches=7, lp=plan(accumulation=3), callbacks=[Logger(), LossTaker(seen)], step=FlushingStep())
    assert [len(s) for s in seen] == [3, 3, 1]
    assert sum(seen, []) == pytest.approx([1 / k for k in range(1, 8)])


def test_no_flush_after_a_stop():
    step = FlushingStep()
    state, _ = run(n_batches=7, lp=plan(accumulation=3), callbacks=[Recorder("r", [], stop_at=2)], step=step)
    assert state.step == 2 and step.flushed == []


def test_max_steps_and_the_schedule():
    step = FakeStep()
    stops = StopConditions(max_steps=4, max_time=None, signals=SignalWatcher(), out_dir="/nonexistent")
    state, _ = run(lp=plan(max_steps=4), callbacks=[stops], step=step)
    assert state.step == 4 and state.stop_reason == "--max-steps 4"
    assert step.lrs[:2] == pytest.approx([5e-4, 1e-3])  # linear warmup over 2 steps
    assert step.lrs[2] > step.lrs[3]  # then the cosine falls
    # 2 warmup steps of 4 is more than the 20% cap (run.py's warmup_for never asks for it): warmup is over
    # by 20% of the run, at step 1 (progress 0.25), where the step ramp has reached the peak too
    assert state.warmup_end == pytest.approx(0.25)


def test_max_time_by_the_injected_clock():
    clock = FakeClock(tick=10.0)  # every clock read advances 10 s
    stops = StopConditions(max_steps=None, max_time=100.0, signals=SignalWatcher(), out_dir="/x")
    state, _ = run(n_batches=50, lp=plan(max_time=100.0), callbacks=[stops], clock=clock)
    assert state.stop_reason == "--max-time 100s" and 1 <= state.step < 50


def test_a_signal_stops_the_run_after_its_step():
    signals = SignalWatcher()
    stops = StopConditions(None, None, signals, "/runs/x")

    class Deliver(Callback):
        def on_step(self, run):
            if run.step == 2:
                signals.received.append("SIGTERM")

    state, _ = run(callbacks=[Deliver(), stops])
    assert state.step == 2 and state.stop_reason == "SIGTERM: stopped after this step, saved in the final checkpoint; resume with --resume /runs/x"


def test_a_stop_file_stops_the_run(tmp_path):
    (tmp_path / "STOP").touch()
    stops = StopConditions(None, None, SignalWatcher(), str(tmp_path))
    state, _ = run(callbacks=[stops])
    assert state.step == 1 and state.stop_reason.startswith("STOP file in the output dir (removed")
    assert not (tmp_path / "STOP").exists()  # spent: a later --resume trains on (issue 41: it stopped it again)
    again, _ = run(callbacks=[StopConditions(None, None, SignalWatcher(), str(tmp_path))])
    assert again.step == 6 and again.stop_reason == "epochs done"


def resumed_from(state: RunState) -> RunState:
    """What --resume restores: the saved counters only (RunState.meta / from_meta), as a checkpoint holds them."""
    return RunState.from_meta(state.meta(processes=1), train_state=state.train_state)


def lrs_by_step(step: FakeStep, first_step: int) -> dict[int, float]:
    return {first_step + i: lr for i, lr in enumerate(step.lrs)}


def test_a_run_extended_by_steps_follows_the_straight_runs_schedule():
    """300 steps, then --resume --max-steps 600: from the resumed step on, each rate equals the one a straight
    600-step run used at that step (the warmup's end rescaled into the longer run), and it ends decayed."""
    def go(max_steps, batches, state=None, first=0):
        step = FakeStep()
        lp = LoopPlan(1, 1, B * L, B * L, Schedule(1e-3, 10, max_steps), Cadence(1, 10**6, 10**6))
        if state is not None:
            lp.schedule.replan(state, Processes(), lp.tokens_per_step)
        stops = StopConditions(max_steps, None, SignalWatcher(), "/x")
        final, _ = run(n_batches=batches, lp=lp, callbacks=[stops], step=step, run_state=state)
        return final, lrs_by_step(step, first)

    _, straight = go(600, 700)
    short, _ = go(300, 700)
    extended, after = go(600, 700, resumed_from(short), first=300)
    assert extended.step == 600 and sorted(after) == list(range(300, 600))
    assert max(abs(after[s] - straight[s]) / straight[s] for s in after) < 1e-9
    assert after[599] < 0.11e-3  # decayed to the cosine's floor (10% of the peak)


def test_a_time_limited_run_counts_its_earlier_sessions_and_an_extension_follows_the_straight_schedule():
    """--max-time 100 interrupted at step 5 and resumed: it stops at 100 s of the run's time, not 100 s more;
    then --resume --max-time 200: it trains as long as a straight 200-s run, resumes at that run's rate for
    the same point, and ends decayed (a fake clock: every read is a second)."""
    def go(max_time, state=None, stop_at=None):
        clock, step = FakeClock(tick=1.0), FakeStep()
        clock.now = 0.0
        lp = LoopPlan(1, 1, B * L, B * L, Schedule(1e-3, 2, None, max_time, start=0.0), Cadence(1, 10**6, 10**6))
        if state is not None:
            state.prior_s = state.elapsed_s
            lp.schedule.replan(state, Processes(), lp.tokens_per_step)
        cbs = [StopConditions(None, max_time, SignalWatcher(), "/x")]
        cbs += [Recorder("stop", [], stop_at=stop_at)] if stop_at else []
        final, _ = run(n_batches=1000, lp=lp, callbacks=cbs, step=step, clock=clock, run_state=state)
        return final, step.lrs

    straight_200, lrs_200 = go(200.0)
    whole, _ = go(100.0)
    first, _ = go(100.0, stop_at=5)
    finished, _ = go(100.0, resumed_from(first))
    assert first.step == 5 and abs(finished.step - whole.step) <= 1 and whole.step > 12  # not 100 s more
    extended, lrs = go(200.0, resumed_from(finished))
    assert abs(extended.step - straight_200.step) <= 0.1 * straight_200.step  # each start-up costs clock reads
    assert lrs[0] == pytest.approx(lrs_200[finished.step], rel=0.1)  # no jump back to the peak (issue 41)
    assert lrs[-1] < 0.15e-3 and lrs_200[-1] < 0.15e-3  # both end decayed


def test_stop_requested(tmp_path):
    assert stop_requested(str(tmp_path)) is None
    (tmp_path / ".stop").touch()
    assert stop_requested(str(tmp_path)) == str(tmp_path / ".stop")
    (tmp_path / "STOP").touch()
    assert stop_requested(str(tmp_path)) == str(tmp_path / "STOP")
    (tmp_path / ".stop").unlink()
    assert stop_requested(str(tmp_path)) == str(tmp_path / "STOP")
    assert stop_requested(str(tmp_path / "missing")) is None


def test_nonfinite_stops_before_later_callbacks_and_skips_within_the_allowance():
    events, logs = [], []
    guard = NonFiniteGuard(allowed=0, accumulation=1, log=logs.append)
    state, _ = run(callbacks=[guard, Recorder("save", events)], step=FakeStep(bad={3}))
    assert state.step == 3 and state.nonfinite_stop
    assert state.stop_reason == "non-finite loss or gradient at step 3 (skipped; nothing saved after it)"
    assert [e[2] for e in events if e[1] == "step"] == [1, 2]  # the callback after the guard never saw step 3
    guard = NonFiniteGuard(allowed=1, accumulation=2, log=logs.append)
    state, _ = run(n_batches=8, lp=plan(accumulation=2), callbacks=[guard], step=FakeStep(bad={3, 7}))
    assert state.skipped_nonfinite == 1 and state.step == 4  # micro 3 = step 2 skipped; micro 7 = step 4 stops
    assert logs == ["[run] step 2: non-finite loss or gradient, skipped (1 of --skip-nonfinite 1)"]


def test_nonfinite_checked_at_the_end_when_nothing_was_due():
    guard = NonFiniteGuard(allowed=0, accumulation=1, log=print)
    state, _ = run(n_batches=3, lp=plan(log_every=10**6), callbacks=[guard], step=FakeStep(bad={2}))
    assert state.nonfinite_stop and state.stop_reason.startswith("non-finite loss or gradient at step 2 ")


def test_cadence_and_timings():
    seen = []

    class Due(Callback):
        def on_step(self, run):
            seen.append((run.step, run.due.log, run.due.eval, run.due.save))

    state, _ = run(n_batches=4, lp=plan(log_every=2, eval_every=3, checkpoint_every=4), callbacks=[Due()])
    assert seen == [(1, False, False, False), (2, True, False, False), (3, False, True, False),
                    (4, True, False, True)]
    t = state.timings
    assert t.compile_s is not None and t.train_s > 0 and t.eval_s == 0.0


def test_resumed_run_continues_its_epoch_and_counters():
    resumed = RunState.from_meta({"step": 5, "tokens": 40, "epoch": 1, "micro_step": 5, "epoch_micro": 2,
                                  "warmup_end": 0.1, "est_total_tokens": None, "data_digest": "ab" * 32,
                                  "skipped_nonfinite": 0}, train_state=5)
    state, opened = run(n_batches=3, lp=plan(epochs=3), run_state=resumed)
    assert opened == [(1, True), (2, False)]
    assert state.step == 5 + 3 + 3 and state.epoch_micro == 3 and state.checked_micro == 5
    assert state.meta(1)["step"] == 11 and state.meta(1)["processes"] == 1
