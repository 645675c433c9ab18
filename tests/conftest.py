from pathlib import Path

import pytest
from helpers import DATA


@pytest.fixture(scope="session")
def data_dir() -> Path:
    assert DATA.is_dir(), f"shared corpora not found at {DATA}"
    return DATA


@pytest.fixture(scope="session")
def small_run(tmp_path_factory, data_dir) -> Path:
    """One real run of the trainer's CLI (200K params, seq 64, 4 steps on tinyshakespeare) that generate and
    export tests read; the tests that use it share the xdist group "small_run", so it is trained once."""
    from train_optimized import main

    out = tmp_path_factory.mktemp("small") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        code = main(["--use-streaming", "--dataset-id", str(data_dir / "tinyshakespeare_train.txt"),
                     "--target-params", "200000", "--seq-len", "64", "--batch-size", "8", "--vocab-size", "512",
                     "--eval-tokens", "2048", "--max-steps", "4", "--eval-every", "4", "--output-dir", str(out)])
    assert code == 0
    return out


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
