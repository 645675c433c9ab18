"""metrics.jsonl: one JSON object per logged step or eval, the run's record that plots and trackers read."""

from __future__ import annotations

import json
import os

from slm.io.atomic import append_line, whole_lines, write_text


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl, each line whole in one write() (slm.io.atomic):
    a crash loses at most the row being written and never tears an earlier one.

    append: continue the file (--resume). keep_through: a resumed run's step; rows logged after it (and a
    torn last line) are dropped first, since the resumed run logs those steps again (as TensorBoard's
    purge_step does for its event files).
    """

    def __init__(self, path: str, append: bool = False, keep_through: int | None = None):
        if append and os.path.isfile(path):
            _keep_rows_through(path, keep_through)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC), 0o644)

    def write(self, row: dict) -> None:
        append_line(self.fd, json.dumps(row))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _keep_rows_through(path: str, step: int | None) -> None:
    """Rewrite `path` (atomically) without a torn last line and, given a step, without rows after it."""
    lines = whole_lines(path)
    kept = [line for line in lines if step is None or _step_of(line) <= step]
    if len(kept) != len(lines) or os.path.getsize(path) != sum(len(line.encode()) + 1 for line in lines):
        write_text(path, "".join(line + "\n" for line in kept))


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0.0  # a line that is not a row is kept as it is
