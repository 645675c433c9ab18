"""A trainer callback for the resume tests (its own module: tests/helpers.py stays free of jax)."""

from __future__ import annotations

from slm.train.loop import Callback


class StopAfter(Callback):
    """Stops the run after this process's n-th optimizer step, as a STOP file or a signal would."""

    def __init__(self, n: int):
        self.n, self.seen = n, 0

    def on_step(self, run) -> str | None:
        self.seen += 1
        return "interrupted by the test" if self.seen == self.n else None
