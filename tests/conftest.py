import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    assert DATA.is_dir(), f"shared corpora not found at {DATA}"
    return DATA


def pytest_configure(config) -> None:
    # Heavier end-to-end tests (multi-run loss comparisons, real-process kills). CI runs everything;
    # `-m "not slow"` gives a quick local pass.
    config.addinivalue_line("markers", "slow: end-to-end tests of 30 s or more on 2 cores")
