"""--resume: the settings of the run being continued, checked against what this command line asks for.

Which fields a resumed run keeps, may change or takes from this launch is declared on each Config field
(slm.train.config: identity, adjustable, launch, per_run); this module applies those declarations.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

from slm.errors import ConfigError
from slm.train.config import (
    BEFORE_THE_SETTING,
    IDENTITY,
    LAUNCH,
    Config,
    explicit_fields,
    fields_with,
    flag_name,
)


def run_dir_of(c: Config) -> str:
    """The run directory `c.resume` names (--resume RUN_DIR, or --resume with --output-dir)."""
    run = c.output_dir if c.resume == "latest" else c.resume
    if run is None:
        raise ConfigError("--resume: give the run to continue (--resume RUN_DIR, or --resume with --output-dir)")
    run = os.path.normpath(run)
    if os.path.basename(os.path.dirname(run)) == "checkpoints":  # a checkpoint dir: its run is two levels up
        run = os.path.dirname(os.path.dirname(run))
    return run


LIMITS = ("max_steps", "max_time", "epochs")  # what stops a run: a resume that names one replaces them all


def limit_text(values: dict) -> str:
    """'--max-steps 5000', '--max-time 120s', '--epochs 2', or the default's words."""
    given = [f"--max-time {values['max_time']:g}s" if k == "max_time" else f"{flag_name(k)} {values[k]}"
             for k in LIMITS if values.get(k) is not None]
    return " and ".join(given) or "one epoch"


def limits_line(run: str, saved: dict, changed: dict) -> str:
    """The one line a resume prints about where it stops: the run's own limits, or this command's instead."""
    new = {k: changed.get(k, saved.get(k)) for k in LIMITS}
    old = {k: saved.get(k) for k in LIMITS}
    if new == old:
        return (f"[resume] {run} continues to its own limit, {limit_text(old)} (--max-time counts the run's time "
                f"across sessions); give --max-steps or --max-time to train to another end")
    return (f"[resume] {run} now stops at {limit_text(new)}, replacing {limit_text(old)}; the learning-rate "
            f"schedule is re-planned to end there")


def resume_config(c: Config, explicit: set[str] | None = None, log: Callable[[str], None] = print) -> Config:
    """The config of the run `c.resume` continues, checked against `c`: the resumed run's settings.

    `explicit`: the flags given on the command line (default: the fields that differ from Config's
    defaults). An identity field given with another value than the run's is refused, naming each one.
    A stop condition given (--max-steps, --max-time, --epochs) replaces the run's whole (`log` says so).
    """
    run = run_dir_of(c)
    try:
        with open(os.path.join(run, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume {run}: no readable config.json there ({e}); pass the output dir of a run")
    saved = {**BEFORE_THE_SETTING, **saved}
    explicit = explicit_fields(c) if explicit is None else explicit
    identity = set(fields_with(IDENTITY)) - {"tokenizer"}  # the tokenizer is the run's own file: checked below
    differs = [f"{flag_name(k)} {getattr(c, k)} (the run used {saved.get(k)})"
               for k in fields_with(IDENTITY) if k in identity and k in explicit and getattr(c, k) != saved.get(k)]
    if c.tokenizer and os.path.abspath(c.tokenizer) != os.path.abspath(os.path.join(run, "tokenizer.json")):
        differs.append(f"--tokenizer {c.tokenizer} (the run has its own tokenizer.json)")
    if differs:
        raise ConfigError(f"--resume {run}: cannot change the model, tokenizer, data or optimizer of a run: "
                          + "; ".join(differs) + ". Only --max-steps, --max-time and logging may change")
    names = [f.name for f in dataclasses.fields(Config)]
    changed = {k: getattr(c, k) for k in names if k not in identity and k in explicit}  # this command's changes
    if any(k in explicit for k in LIMITS):  # a new stop condition replaces the old one whole
        changed = {**dict.fromkeys(LIMITS), **changed}
    log(limits_line(run, saved, changed))
    resumed = Config(**{**{k: saved[k] for k in names if k in saved}, **changed})
    resumed.output_dir, resumed.resume = run, c.resume
    for k in fields_with(LAUNCH):  # how this process was started, never inherited from the saved run
        setattr(resumed, k, getattr(c, k))
    resumed.tokenizer = os.path.join(run, "tokenizer.json")
    resumed.vocab_size = None  # it comes with the tokenizer
    resumed.preset, resumed.auto_fit = None, False  # their choices are in the saved settings already
    return resumed


def check_process_count(run_dir: str, saved_by: int, processes: int) -> None:
    """Refuse to resume with another number of processes: each process owns its part of the stream."""
    if saved_by != processes:
        raise ConfigError(f"--resume {run_dir}: the run was saved by {saved_by} process(es), each with its own part "
                          f"of the data; resume it with --num-processes {saved_by} (devices per process may change)")


def saved_process_count(run_dir: str) -> int:
    """The processes a run recorded in its config.json (1 for runs that predate the record)."""
    with open(os.path.join(run_dir, "config.json")) as f:
        return int(json.load(f).get("processes", 1))
