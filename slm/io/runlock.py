"""One owner per run directory: an OS advisory lock (flock) on `<run>/.lock`, held for a trainer's life.

The file names the holder (pid and host), so a second trainer, or a --resume of a live run, is refused
before it writes anything, in one line naming them. The kernel drops the lock when its process ends, however
it ends (SIGKILL included), so a lock file left by a process that is gone is simply taken over, with a line
saying whose it was. In a multi-process run process 0 takes it for all of them (they are one owner). Stdlib
only; off POSIX (no fcntl) it does nothing.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable

try:
    import fcntl
except ImportError:  # Windows: no advisory locks here
    fcntl = None

from slm.errors import ConfigError

LOCK_NAME = ".lock"


class RunLock:
    """Hold `<directory>/.lock` until `release` (a context manager too)."""

    def __init__(self, directory: str, log: Callable[[str], None] = print):
        self.path = os.path.join(directory, LOCK_NAME)
        self.fd: int | None = None
        if fcntl is None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read(fd)
            os.close(fd)
            raise ConfigError(f"{directory}: another trainer owns this run directory (pid {holder.get('pid', '?')} "
                              f"on {holder.get('host', '?')}); wait for it to end or stop it (touch "
                              f"{os.path.join(directory, 'STOP')}), then --resume") from None
        previous = _read(fd)
        if previous.get("pid") and (previous.get("pid"), previous.get("host")) != (os.getpid(), socket.gethostname()):
            log(f"[run] took over {self.path}: its owner (pid {previous['pid']} on {previous.get('host', '?')}) "
                f"is gone")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Drop the lock (the file stays: the next owner reads whose it was). Safe to call twice."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(fd: int) -> dict:
    """The holder recorded in the lock file ({} when empty or unreadable)."""
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
