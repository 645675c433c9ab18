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
