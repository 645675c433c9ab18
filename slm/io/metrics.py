"""metrics.jsonl: one JSON object per logged step or eval, the run's record that plots and trackers read."""

from __future__ import annotations

import json


class MetricsLog:
    """Writes one JSON object per line to a new metrics.jsonl (line-buffered: a crash loses at most a row)."""

    def __init__(self, path: str, append: bool = False):
        self.file = open(path, "a" if append else "w", buffering=1)

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()
