import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import ROOT

from slm.memory.monitor import MemoryMonitor, jax_device_bytes

MB = 2**20


def wait_for(cond, timeout_s: float = 5.0) -> bool:
    """Poll until cond() holds (bounded); no timing is asserted, only the condition."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def test_thread_sees_allocation():
    with MemoryMonitor(interval_s=0.01) as mon:
        first = mon.samples
        assert wait_for(lambda: mon.samples >= first + 2), "sampling thread took no samples"
        base = mon.snapshot()["rss_mb"]
        assert base > 0
        arr = np.ones(25_000_000, dtype=np.float64)  # 200 MB (191 MiB), every page touched
        assert wait_for(lambda: mon.snapshot()["rss_mb"] >= base + 150), mon.snapshot()
        snap = mon.snapshot()
        assert snap["peak_rss_mb"] >= snap["rss_mb"] >= base + 150
        assert snap["device_mb"] is None and snap["peak_device_mb"] is None
        del arr
    assert set(snap) == {"rss_mb", "peak_rss_mb", "device_mb", "peak_device_mb"}


def test_alert_fires_once_per_upward_crossing_with_hysteresis():
    msgs = []
    mon = MemoryMonitor(alert_mb=1000, on_alert=msgs.append)
    for rss in (100, 999):
        mon._observe(rss)
    assert mon.alerts == 0 and msgs == []
    mon._observe(1000)
    assert mon.alerts == 1
    assert msgs == ["[memory] RSS 1,000 MB crossed --memory-alert-mb 1,000 (peak 1,000 MB)"]
    for rss in (1200, 960, 1100, 999, 951):  # stays above 95% of the threshold: not re-armed
        mon._observe(rss)
    assert mon.alerts == 1 and len(msgs) == 1
    mon._observe(949)  # below 95%: re-armed
    assert mon.alerts == 1
    mon._observe(1234)
    assert mon.alerts == 2
    assert msgs[-1] == "[memory] RSS 1,234 MB crossed --memory-alert-mb 1,000 (peak 1,234 MB)"
    assert mon.peak_rss_mb == 1234 and mon.rss_mb == 1234


def test_alert_peak_includes_ru_maxrss_and_default_goes_to_stderr(capsys):
    mon = MemoryMonitor(alert_mb=1200)
    mon._observe(1234, ru_peak_mb=1240)
    err = capsys.readouterr().err
    assert err == "[memory] RSS 1,234 MB crossed --memory-alert-mb 1,200 (peak 1,240 MB)\n"
    assert mon.snapshot()["peak_rss_mb"] == 1240


def test_no_alert_without_threshold():
    msgs = []
    mon = MemoryMonitor(on_alert=msgs.append)
    for rss in (10, 10_000_000, 10):
        mon._observe(rss)
    assert mon.alerts == 0 and msgs == []
    assert mon.peak_rss_mb == 10_000_000 and mon.rss_mb == 10


def test_device_callable_peak():
    values = iter([100 * MB, 300 * MB, None, 50 * MB, (60 * MB, 500 * MB)])
    mon = MemoryMonitor(device_bytes=lambda: next(values))
    mon.sample()
    assert mon.snapshot()["device_mb"] == 100 and mon.snapshot()["peak_device_mb"] == 100
    mon.sample()
    mon.sample()  # None: keeps the last figures
    assert mon.snapshot()["device_mb"] == 300 and mon.snapshot()["peak_device_mb"] == 300
    mon.sample()
    assert mon.snapshot()["device_mb"] == 50 and mon.snapshot()["peak_device_mb"] == 300
    mon.sample()  # (in use, backend's own peak): the peak wins even if never sampled
    assert mon.snapshot()["device_mb"] == 60 and mon.snapshot()["peak_device_mb"] == 500


def test_device_callable_on_thread_and_never_reported():
    with MemoryMonitor(interval_s=0.01, device_bytes=lambda: 64 * MB) as mon:
        assert wait_for(lambda: mon.samples >= 3)
    assert mon.snapshot()["peak_device_mb"] == 64
    mon = MemoryMonitor(device_bytes=lambda: None)
    mon.sample()
    assert mon.snapshot()["peak_device_mb"] is None and mon.snapshot()["device_mb"] is None


def test_failing_device_callable_is_disabled_once():
    msgs, calls = [], []

    def broken():
        calls.append(1)
        raise RuntimeError("no stats")

    mon = MemoryMonitor(device_bytes=broken, on_alert=msgs.append)
    mon.sample()
    mon.sample()
    assert len(calls) == 1 and len(msgs) == 1 and "no stats" in msgs[0]
    assert mon.samples == 2 and mon.peak_device_mb is None


def test_jax_device_bytes_with_fake_device():
    class Dev:
        stats = {"bytes_in_use": 10 * MB, "peak_bytes_in_use": 40 * MB}

        def memory_stats(self):
            return self.stats

    dev = Dev()
    assert jax_device_bytes(dev)() == (10 * MB, 40 * MB)
    dev.stats = None  # CPU backends return None
    assert jax_device_bytes(dev)() is None


def test_stop_is_idempotent_and_ends_thread():
    mon = MemoryMonitor(interval_s=0.01)
    mon.stop()  # before start: no-op
    assert mon.samples == 0
    mon.start()
    thread = mon._thread
    assert thread.is_alive() and thread.daemon
    with pytest.raises(RuntimeError):
        mon.start()
    assert wait_for(lambda: mon.samples >= 2)
    mon.stop()
    assert not thread.is_alive()
    n = mon.samples
    mon.stop()
    assert mon.samples == n and not thread.is_alive() and mon._fd is None


def test_context_manager_stops_thread():
    with MemoryMonitor(interval_s=0.01) as mon:
        thread = mon._thread
        assert thread.is_alive()
        assert mon.snapshot()["rss_mb"] > 0  # start() samples synchronously
    assert not thread.is_alive()


def test_module_does_not_import_jax():
    code = "import sys, slm.memory.monitor; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="current RSS needs /proc")
def test_sample_outside_thread_reads_current_rss_not_peak():
    mon = MemoryMonitor()
    arr = np.ones(25_000_000, dtype=np.float64)  # large: numpy mmaps it, so del gives it back
    mon.sample()
    high = mon.rss_mb
    del arr
    mon.sample()
    assert mon.rss_mb <= high - 150  # a peak figure (ru_maxrss) could not drop
    assert mon.peak_rss_mb >= high
