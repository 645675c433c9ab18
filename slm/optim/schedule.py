"""The learning-rate schedule over the run's progress (pure Python): linear warmup, then cosine to a floor or
warmup-stable-decay (WSD: the peak, then a linear decay to 0 over the last part of the run).

Progress is the fraction of the run done by steps, tokens or wall time, so a --max-time run, which does not
know its step count, starts its WSD decay when --decay-fraction of its *time* is left."""

from __future__ import annotations

import math


WARMUP_CAP = 0.2  # warmup ends by this fraction of the run, however long --warmup-steps is


def warmup_done(progress: float, step: int, warmup_steps: int, warmup_from: float = 0.0) -> bool:
    """Warmup is over after `warmup_steps` steps or WARMUP_CAP of the run's training, whichever comes first
    (`warmup_from`: the progress at the first step; a --max-time run's startup is part of its time)."""
    return step >= warmup_steps or progress - warmup_from >= WARMUP_CAP * (1.0 - warmup_from)


def lr_at(progress: float, step: int, peak: float, warmup_steps: int, final_frac: float = 0.1,
          warmup_end: float = 0.0, kind: str = "cosine", decay_frac: float = 0.5, warmup_from: float = 0.0) -> float:
    """Linear warmup over `warmup_steps` optimizer steps, then cosine from peak to final_frac * peak, or
    (kind "wsd") the peak until `decay_frac` of the run is left and then linearly to 0 at progress 1.

    Warmup reaches the peak by WARMUP_CAP of the run's training at the latest: the rate is the larger of the
    step ramp and the progress since the first step (`warmup_from`) over WARMUP_CAP of what was left then, so
    a --max-time run, whose step count is unknown, warms up over at most 20% of its training time as a
    --max-steps run does over 20% of its steps (warmup_for; there the step ramp is always the larger).

    `progress` in [0, 1] is the fraction of the run done (by steps, tokens or wall time); the cosine
    runs over what is left after `warmup_end`, the progress at which warmup finished, so the rate is
    continuous at the end of warmup.
    """
    if warmup_steps > 0 and not warmup_done(progress, step, warmup_steps, warmup_from):
        by_time = (progress - warmup_from) / (WARMUP_CAP * (1.0 - warmup_from))
        return peak * min(max((step + 1) / warmup_steps, by_time), 1.0)
    if kind == "wsd":
        return peak * min(max((1.0 - progress) / decay_frac, 0.0), 1.0)
    p = (progress - warmup_end) / max(1.0 - warmup_end, 1e-9)
    p = min(max(p, 0.0), 1.0)
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def warmup_for(warmup_steps: int, max_steps: int | None = None, est_total_steps: float | None = None) -> int:
    """Warmup steps actually used: at most 20% of a run whose length is known (by --max-steps, or by an
    estimate of the total steps of an epochs-bounded run)."""
    warmup = min(warmup_steps, max_steps // 5) if max_steps else warmup_steps
    if est_total_steps is not None:
        warmup = min(warmup, int(est_total_steps) // 5)
    return warmup
