"""The learning-rate schedule over the run's progress (pure Python): linear warmup, then cosine to a floor or
warmup-stable-decay (WSD: the peak, then a linear decay to 0 over the last part of the run).

Progress is the fraction of the run done by steps, tokens or wall time, so a --max-time run, which does not
know its step count, starts its WSD decay when --decay-fraction of its *time* is left."""

from __future__ import annotations

import math


def lr_at(progress: float, step: int, peak: float, warmup_steps: int, final_frac: float = 0.1,
          warmup_end: float = 0.0, kind: str = "cosine", decay_frac: float = 0.2) -> float:
    """Linear warmup over `warmup_steps` optimizer steps, then cosine from peak to final_frac * peak, or
    (kind "wsd") the peak until `decay_frac` of the run is left and then linearly to 0 at progress 1.

    `progress` in [0, 1] is the fraction of the run done (by steps, tokens or wall time); the cosine
    runs over what is left after `warmup_end`, the progress at which warmup finished, so the rate is
    continuous at the end of warmup.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
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
