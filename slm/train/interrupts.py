"""Ways to stop a run cleanly from outside: SIGTERM/SIGINT, and a STOP file in the output dir.

Either way the run finishes its step, saves a checkpoint, writes its summary and returns; `--resume`
continues it exactly. The trainer takes a `SignalWatcher` as an argument, so tests and notebooks can
pass their own (a list they append to) instead of real signal handlers.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable


class SignalWatcher:
    """Records SIGTERM/SIGINT by name in `received` while installed (a second Ctrl-C aborts at once).

    Handlers can only be set from the main thread; elsewhere (a notebook's worker thread) `install`
    leaves them alone and `received` only changes if someone appends to it.
    """

    def __init__(self, log: Callable[[str], None] = print):
        self.received: list[str] = []
        self.log = log
        self._previous: dict = {}

    def handle(self, signum: int, frame: object = None) -> None:
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C aborts at once
        self.received.append(signal.Signals(signum).name)
        self.log(f"[run] {self.received[-1]}: finishing this step, then saving a checkpoint "
                 f"(Ctrl-C again aborts at once)")

    def __enter__(self) -> SignalWatcher:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def spend_stop(path: str) -> None:
    """A STOP file has done its job once a run stopped for it: removed, so a later --resume trains on."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def spend_stale_stop(output_dir: str, log: Callable[[str], None]) -> None:
    """A resume finding a STOP file (left by an earlier stop, or by a version that kept it): removed, said."""
    if path := stop_requested(output_dir):
        spend_stop(path)
        log(f"[resume] removed {path}, left from an earlier stop; touch it again to stop this run")


def stop_requested(output_dir: str) -> str | None:
    """Path of a `STOP` or `.stop` file in output_dir (touch one to stop a run cleanly), else None."""
    for name in ("STOP", ".stop"):
        path = os.path.join(output_dir, name)
        if os.path.exists(path):
            return path
    return None
