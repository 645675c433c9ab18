"""Start the trainer under glibc's huge-page malloc (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`), by re-executing once.

XLA's CPU runtime mallocs each step's temporary buffers and frees them after the step. glibc serves blocks
over its mmap threshold (32 MB at most) with a fresh mmap each time, so every 4 KiB page of them is faulted
in and zeroed again on every step: about 16,000 page faults a step at the quality race's shape, a large part
of the step's system time. With the tunable, glibc asks for transparent huge pages for its memory (madvise),
and a fault brings in 2 MiB. `bench/malloc_hugepages.py@1a39af2` measures both. glibc reads tunables only when a
process starts, so the command line re-executes itself once with the tunable added; from a notebook, start
the kernel with the variable set to get the same.

Nothing is done off Linux/glibc, when GLIBC_TUNABLES already names the tunable (an explicit
`glibc.malloc.hugetlb=0` is respected), or with SLM_NO_REEXEC=1. The first start's time is handed on in
SLM_PROCESS_START, so --max-time still counts from the first start.
"""

from __future__ import annotations

import os
import platform
import sys
import time

TUNABLE = "glibc.malloc.hugetlb"
START_VAR = "SLM_PROCESS_START"


def on_glibc() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def reexec_env(environ: dict[str, str], start: float, glibc: bool) -> dict[str, str] | None:
    """The environment to re-execute with, or None when this process should just go on."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if not glibc or environ.get("SLM_NO_REEXEC") == "1" or TUNABLE in tunables:
        return None
    return {**with_huge_pages(environ), START_VAR: repr(start)}


def with_huge_pages(environ: dict[str, str]) -> dict[str, str]:
    """`environ` with the tunable added to GLIBC_TUNABLES (for a child process; the user's own setting wins)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables:
        return dict(environ)
    return {**environ, "GLIBC_TUNABLES": ":".join(x for x in (tunables, f"{TUNABLE}=1") if x)}


def reexec_with_huge_pages(start: float) -> None:
    """Replace this process with the same command under the tunable (same pid, so signals and job control
    are unaffected); returns only when nothing needs doing. Call before anything heavy is imported."""
    env = reexec_env(dict(os.environ), start, on_glibc())
    if env is None or not sys.executable or not sys.orig_argv:  # an embedded interpreter: nothing to restart
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:  # cannot restart (a sandbox, a vanished interpreter): train as it is, only slower
        return


def process_start(default: float | None = None) -> float:
    """When this process started, which --max-time counts from: the first start handed on by a re-execution,
    else the kernel's record of this process's start (Linux; an exec keeps it), else `default`, else now."""
    try:  # taken out of the environment, so no process started from here inherits it
        return float(os.environ.pop(START_VAR))
    except (KeyError, ValueError):
        pass
    started = linux_start_time()
    if started is not None:
        return started
    return time.time() if default is None else default


def linux_start_time() -> float | None:
    """This process's start in seconds since the epoch, from /proc (None where there is no /proc): its age is
    the system's uptime less the uptime it started at (both to 10 ms; an exec keeps the start)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, counted after the command's name
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
