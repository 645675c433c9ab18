from pathlib import Path

import pytest
from helpers import DATA


@pytest.fixture(scope="session")
def data_dir() -> Path:
    assert DATA.is_dir(), f"shared corpora not found at {DATA}"
    return DATA


def pytest_configure(config) -> None:
    # One XLA compilation cache for the whole session (fresh each session, never the user's ~/.cache): runs
    # of the same shapes in different tests and subprocesses load the compiled step instead of compiling it.
    import os
    import tempfile

    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        config.xla_cache = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="slm-test-xla-")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the small programs too


def pytest_collection_modifyitems(config, items) -> None:
    # The end-to-end tests marked slow first: with `-n 2` (pytest-xdist) they start at once and the quick
    # tests fill the other worker, instead of one long test running alone at the end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_unconfigure(config) -> None:
    import shutil

    if getattr(config, "xla_cache", None):
        shutil.rmtree(config.xla_cache, ignore_errors=True)
