"""--resume's side of a run: the newest sound checkpoint restored, the LoRA base checked, and the run's clock
and learning-rate schedule carried over to the (possibly new) end it now trains to (docs/resume.md)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

from slm.errors import ConfigError, RunError
from slm.io.checkpoints import Checkpointer, Unreadable
from slm.train.config import Config
from slm.train.loop import LoopPlan, RunState
from slm.train.resume import check_process_count

SUPERSEDED = ".superseded"  # a decayed checkpoint a longer WSD run branched before (kept, not loaded)


def restore(c: Config, ckpt: Checkpointer, state: Any, est: float | None, env: Any) -> tuple[RunState, dict]:
    """A fresh RunState, or (--resume) the newest complete checkpoint's: (run, {"meta", "loader"} or {})."""
    if not c.resume:
        return RunState(train_state=state, est_total_tokens=est), {}
    ckpt_dir, procs = os.path.join(env.out, "checkpoints"), env.procs
    for partial in sorted(p for p in os.listdir(ckpt_dir) if "tmp" in p) if procs.primary else ():
        shutil.rmtree(os.path.join(ckpt_dir, partial), ignore_errors=True)  # a save that never committed
        env.log(f"[resume] removed the incomplete checkpoint {partial} (an interrupted save; the last complete one "
                f"is used)")
    restored = ckpt.restore_sound(state, env.log, procs.decide0)  # process 0 checks; every process restores
    if restored is None:
        aside = sorted(p for p in os.listdir(ckpt_dir) if ".damaged" in p)
        raise RunError(f"--resume {env.out}: no complete, sound checkpoint in {ckpt_dir}"
                       + (f" ({len(aside)} damaged ones moved aside: {', '.join(aside)})" if aside else "")
                       + "; an interrupted save is skipped")
    return _resumed(c, restored, est, env)


def _resumed(c: Config, restored: tuple[Any, dict, dict], est: float | None, env: Any) -> tuple[RunState, dict]:
    """The RunState of a restored checkpoint (state with the live state's shardings, meta, loader state)."""
    state, meta, loader_state = restored
    procs = env.procs
    check_process_count(env.out, meta.get("processes", 1), procs.count)
    if procs.count > 1 and c.use_streaming:
        mine = loader_state["processes"][procs.index]
        meta, loader_state = {**meta, "data_digest": mine["digest"]}, mine["loader"]
    env.log(f"[resume] step {meta['step']} of {env.out}: {meta['tokens']:,} tokens, epoch {meta['epoch']}")
    run = RunState.from_meta({"est_total_tokens": est, **meta}, train_state=state)
    return run, {"meta": meta, "loader": loader_state}


def branch_before_decay(c: Config, ckpt: Checkpointer, template: Any, run: RunState, resumed: dict, lplan: LoopPlan,
                        env: Any) -> tuple[RunState, dict]:
    """WSD, a run made longer: continue from its last step before the decay began (the checkpoint kept for this),
    so the run follows a straight run's path to the new end instead of climbing back from a decayed rate. The
    decayed checkpoints after it are renamed `<step>.superseded` (the old end's model stays on disk) and the
    metrics rows of those steps are kept in metrics.superseded-<step>.jsonl. Otherwise (run, resumed) as given."""
    stable = run.stable_step
    if lplan.schedule.kind != "wsd" or stable is None or stable >= run.step:
        return run, resumed
    if _progress_at(run, lplan, env) >= run.progress - 1e-9:  # not longer: continue where it stopped
        return run, resumed
    newest = run.step
    problem = "it is gone" if stable not in ckpt.manager.all_steps() else env.procs.decide0(lambda: ckpt.check(stable))
    if problem:
        env.log(f"[resume] the run is made longer, but its last checkpoint before the decay ({stable}) cannot be "
                f"used ({problem}); continuing from step {newest}, whose rate climbs back from the decayed one")
        return run, resumed
    run.train_state = None  # the decayed state goes before the stable one is read: one state in memory
    try:
        restored = ckpt.restore(template, stable)  # before anything is renamed: a failure leaves the run as it was
    except Unreadable as e:
        env.log(f"[resume] the run is made longer, but its last checkpoint before the decay ({stable}) is damaged "
                f"({e}); continuing from step {newest}, whose rate climbs back from the decayed one")
        return _resumed(c, ckpt.restore(template, newest), run.est_total_tokens, env)

    def supersede() -> list[str]:
        names = [ckpt.set_aside(s, SUPERSEDED) for s in sorted(ckpt.manager.all_steps()) if s > stable]
        metrics = os.path.join(env.out, "metrics.jsonl")
        if os.path.exists(metrics):
            shutil.copyfile(metrics, os.path.join(env.out, f"metrics{SUPERSEDED}-{newest}.jsonl"))
        return names

    names = env.procs.decide0(supersede)
    ckpt.manager.reload()
    env.log(f"[resume] the run is made longer and decays at its end (WSD): it continues from step {stable}, its "
            f"last before the decay began, as a straight run to the new end would; steps {stable + 1}-{newest} "
            f"are trained again (their checkpoints kept as {', '.join(names)})")
    branched, resumed = _resumed(c, restored, run.est_total_tokens, env)
    branched.stable_step = None  # the stable phase goes on: the new run keeps the step before its own decay
    return branched, resumed


def _progress_at(run: RunState, lplan: LoopPlan, env: Any) -> float:
    """The newest checkpoint's progress in the run's new terms (read as Schedule.replan reads it)."""
    last = dataclasses.replace(run, step=max(run.step - 1, 0), tokens=max(run.tokens - lplan.tokens_per_step, 0),
                               prior_s=run.elapsed_s)
    return lplan.schedule.progress(last, env.start, env.procs)


def replan(c: Config, run: RunState, lplan: LoopPlan, env: Any) -> None:
    """A resumed run: the time earlier sessions spent counts toward --max-time; a limit already reached is
    refused in one line; the schedule is re-planned for the run's end and the rate it resumes at is said."""
    run.prior_s = run.elapsed_s
    where = (f"step {run.step}" + (f", {run.prior_s:,.0f}s of training time" if run.prior_s else ""))
    reached = ("--max-steps", f"{c.max_steps}") if c.max_steps and run.step >= c.max_steps else (
        ("--max-time", f"{c.max_time:g}s") if c.max_time and run.prior_s >= c.max_time else None)
    if reached:
        raise ConfigError(f"--resume {env.out}: the run is at {where}, already at its {' '.join(reached)}; give a "
                          f"larger {reached[0]} (the run's total) to train more")
    old, new = lplan.schedule.replan(run, env.procs, lplan.tokens_per_step)
    lr = lplan.schedule.lr(dataclasses.replace(run), env.start, env.procs)  # a copy: the first step sets the real one
    env.log(f"[resume] schedule: {where} is {new:.0%} of the run to its end (was {old:.0%}); the rate resumes at "
            f"{lr:.3g}")


def check_base(c: Config, run: RunState, fingerprint: str | None, out: str) -> None:
    """LoRA: a fresh run records its base's sha256 in every checkpoint; a resumed one must find the same base."""
    if fingerprint is None:
        return
    if run.base_fingerprint is None:
        run.base_fingerprint = fingerprint
    elif run.base_fingerprint != fingerprint:
        raise RunError(f"--resume {out}: --init-from {c.init_from} is not the base these adapters were trained on "
                       f"(sha256 {fingerprint[:12]}..., the checkpoint's {run.base_fingerprint[:12]}...); give the "
                       f"same weights (--init-revision pins a hub model)")
