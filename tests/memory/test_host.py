"""slm.memory.host: RSS figures from /proc, and handing freed heap pages back to the OS."""

import sys

import pytest

from slm.memory.host import available_host_mb, peak_rss_mb, release_free_heap, rss_mb


def test_rss_figures_are_consistent():
    assert 0 < rss_mb() <= peak_rss_mb() + 1
    avail = available_host_mb()
    assert avail is None or avail > rss_mb()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_release_free_heap_returns_pages_freed_between_live_blocks():
    blocks = [bytearray(64 * 1024) for _ in range(3000)]  # ~190 MB in heap chunks (below the mmap threshold)
    del blocks[::2]  # holes between live blocks: glibc keeps them, RSS stays
    before = rss_mb()
    released = release_free_heap()
    assert released > 50 and rss_mb() < before - 50
    assert release_free_heap() < 50  # nothing much left to give back
    del blocks


def test_peak_is_this_process_not_the_parent_it_was_started_from():
    """getrusage's ru_maxrss survives execve on Linux: a trainer started from a 1.2 GB test worker reported
    the worker's RSS as its peak. The child of a parent holding 300 MB must report its own (small) peak."""
    import subprocess

    held = bytearray(300 << 20)
    held[::4096] = b"\x01" * len(held[::4096])  # touch every page: resident in the parent
    code = "from slm.memory.host import peak_rss_mb; print(peak_rss_mb())"
    child_peak = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0 < child_peak < 150 and peak_rss_mb() >= 300
    del held
