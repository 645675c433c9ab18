"""Background host/device memory sampling and RSS alerts.

Stdlib only at import time, so the trainer can start it before jax is imported.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable

from slm.memory.host import MB as _MB
from slm.memory.host import peak_rss_mb, rss_mb


class MemoryMonitor:
    """Samples RSS (and optionally device memory) every `interval_s` on a daemon thread.

    `device_bytes` returns bytes in use, or (bytes in use, peak bytes in use) when the backend
    tracks its own peak (catches spikes between samples), or None when unknown (CPU).
    """

    def __init__(self, interval_s: float = 0.5, alert_mb: float | None = None,
                 on_alert: Callable[[str], None] | None = None,
                 device_bytes: Callable[[], int | tuple[int, int] | None] | None = None,
                 alert_flag: str = "--memory-alert-mb") -> None:
        self.interval_s = interval_s
        self.alert_mb = alert_mb
        self.on_alert = on_alert or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.device_bytes = device_bytes
        self.alert_flag = alert_flag
        self.alerts = 0
        self.samples = 0
        self.rss_mb = 0.0
        self.peak_rss_mb = 0.0
        self.device_mb: float | None = None
        self.peak_device_mb: float | None = None
        self._armed = True
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None

    def _read_device(self) -> int | tuple[int, int] | None:
        if self.device_bytes is None:
            return None
        try:
            return self.device_bytes()
        except Exception as e:  # a broken backend query must not kill the thread or spam
            self.device_bytes = None
            self.on_alert(f"[memory] device memory query failed, no longer sampled: {e!r}")
            return None

    def sample(self) -> None:
        """Take one sample now (the thread calls this; also useful right before a summary)."""
        self._observe(rss_mb(self._fd), self._read_device(), peak_rss_mb())

    def _observe(self, rss_mb: float, device: int | tuple[int, int] | None = None,
                 ru_peak_mb: float = 0.0) -> None:
        """Record one sample and fire the RSS alert on an upward crossing (pure: unit-testable)."""
        msg = None
        with self._lock:
            self.samples += 1
            self.rss_mb = rss_mb
            self.peak_rss_mb = max(self.peak_rss_mb, rss_mb, ru_peak_mb)
            if device is not None:
                cur, peak = device if isinstance(device, tuple) else (device, device)
                self.device_mb = cur / _MB
                self.peak_device_mb = max(self.peak_device_mb or 0.0, cur / _MB, peak / _MB)
            if self.alert_mb is not None:
                if self._armed and rss_mb >= self.alert_mb:
                    self._armed = False
                    self.alerts += 1
                    msg = (f"[memory] RSS {rss_mb:,.0f} MB crossed {self.alert_flag} "
                           f"{self.alert_mb:,.0f} (peak {self.peak_rss_mb:,.0f} MB)")
                elif not self._armed and rss_mb < 0.95 * self.alert_mb:
                    self._armed = True  # hysteresis: no alert storm while hovering at the line
        if msg is not None:
            self.on_alert(msg)  # outside the lock: the callback may call snapshot()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> "MemoryMonitor":
        if self._thread is not None:
            raise RuntimeError("MemoryMonitor already started")
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:  # not Linux
            self._fd = None
        self.sample()  # snapshot() is meaningful from the first call on
        self._thread = threading.Thread(target=self._run, name="memory-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop and join the thread, taking a last sample; safe to call more than once."""
        with self._lock:  # check-and-set, so two concurrent stop()s cannot both close the fd
            if self._thread is None or self._stop.is_set():
                return
            self._stop.set()
        self._thread.join()
        self.sample()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "MemoryMonitor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def snapshot(self) -> dict:
        with self._lock:
            return {"rss_mb": self.rss_mb, "peak_rss_mb": self.peak_rss_mb,
                    "device_mb": self.device_mb, "peak_device_mb": self.peak_device_mb}


def jax_device_bytes(device=None) -> Callable[[], tuple[int, int] | None]:
    """A `device_bytes` callable for one jax device (default: the first local one); jax imported lazily."""
    if device is None:
        import jax
        device = jax.local_devices()[0]

    def read() -> tuple[int, int] | None:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_in_use" not in stats:
            return None  # CPU and some backends report nothing
        return stats["bytes_in_use"], stats.get("peak_bytes_in_use", stats["bytes_in_use"])

    return read
