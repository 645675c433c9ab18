"""slm.optim.schedule: warmup then cosine, and the warmup cap for runs of known length."""

import pytest

from slm.optim.schedule import lr_at, warmup_for


def test_lr_schedule_warmup_then_cosine():
    assert lr_at(0.0, 0, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(0.0, 9, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(0.0, 10, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(0.5, 50, 1.0, 10) == pytest.approx(0.55)
    assert lr_at(1.0, 99, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(2.0, 500, 1.0, 10) == pytest.approx(0.1)
    # cosine measured from the end of warmup: continuous there, and ends at the floor
    assert lr_at(0.45, 10, 1.0, 10, warmup_end=0.45) == pytest.approx(1.0)
    assert lr_at(0.725, 60, 1.0, 10, warmup_end=0.45) == pytest.approx(0.55)
    assert lr_at(1.0, 99, 1.0, 10, warmup_end=0.45) == pytest.approx(0.1)


def test_warmup_is_capped_at_a_fifth_of_a_known_run():
    assert warmup_for(100) == 100  # length unknown (--max-time): as asked
    assert warmup_for(100, max_steps=200) == 40
    assert warmup_for(100, est_total_steps=60.9) == 12
    assert warmup_for(100, max_steps=1000, est_total_steps=100) == 20
