"""This process's memory as the operating system sees it: current and peak RSS, and what the host has free.

The one place that reads /proc (Linux); elsewhere the figures fall back to getrusage's peak. Stdlib only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import sys

MB = 1 << 20
_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / MB
_RU_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KB on Linux


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MB: VmHWM on Linux, else getrusage.

    Not getrusage on Linux: its ru_maxrss survives execve, so a trainer started from a big process (a
    notebook kernel, a test runner: fork + exec) would report its parent's RSS as its own peak (a 1.2 GB
    pytest worker's, measured). VmHWM belongs to the address space exec created.
    """
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RU_UNIT / MB


def rss_mb(fd: int | None = None) -> float:
    """Current resident set size of this process in MB.

    `fd`: an open descriptor of /proc/self/statm, read with one pread (the monitor samples every
    0.5 s without an open/close each time). Off Linux: the peak, the best cheap figure there is.
    """
    try:
        if fd is not None:
            data = os.pread(fd, 128, 0)
        else:
            with open("/proc/self/statm", "rb") as f:
                data = f.read()
        return int(data.split()[1]) * _PAGE_MB
    except (OSError, ValueError, IndexError):
        return peak_rss_mb()


def available_host_mb() -> float | None:
    """MemAvailable plus this process's RSS (what the run could grow into), or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 1024
    except (OSError, StopIteration, ValueError):
        return None
    return avail + rss_mb()


def total_ram_gb() -> float:
    """Physical memory of the host in GiB (for --preset auto)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def release_free_heap() -> float:
    """Hand the heap's free pages back to the OS (glibc malloc_trim); returns the MB of RSS released.

    glibc keeps what a thread frees in that thread's arena: XLA's compiler leaves 300-500 MB there after
    compiling a 20M step (the 8-bit one: RSS 1,003 -> 523 MB after a trim), and a checkpoint save leaves
    its staging copy (the next steps peaked 2,888 MB before a trim, 2,111 after, at 20M float32, seq 512).
    The step's own threads rarely reuse those pages, so they add to every later peak. Off glibc: 0.
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return 0.0
    before = rss_mb()
    libc.malloc_trim(0)
    return max(before - rss_mb(), 0.0)


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
