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


def test_wsd_holds_the_peak_then_decays_linearly_to_zero_over_the_last_fraction():
    wsd = dict(kind="wsd", decay_frac=0.2)
    assert lr_at(0.0, 4, 1.0, 10, **wsd) == pytest.approx(0.5)  # warmup as for cosine
    assert lr_at(0.3, 30, 1.0, 10, **wsd) == pytest.approx(1.0) == lr_at(0.8, 80, 1.0, 10, **wsd)
    assert lr_at(0.9, 90, 1.0, 10, **wsd) == pytest.approx(0.5)
    assert lr_at(1.0, 100, 1.0, 10, **wsd) == pytest.approx(0.0)
    assert lr_at(1.3, 130, 1.0, 10, **wsd) == 0.0  # a --max-time run's last steps past its budget
    # by the fraction of the budget left, not the step: a --max-time run decays over its last 20% of time
    assert lr_at(0.95, 7, 2.0, 5, **wsd) == pytest.approx(0.5)


def test_warmup_reaches_the_peak_by_a_fifth_of_a_timed_run():
    """--max-time: the step count is unknown, so the ramp is also bounded by progress (time) / 0.2."""
    assert lr_at(0.05, 4, 1.0, 100) == pytest.approx(0.25)  # time ahead of the step ramp (0.05)
    assert lr_at(0.01, 49, 1.0, 100) == pytest.approx(0.5)  # the step ramp ahead of time
    assert lr_at(0.2, 60, 1.0, 100, kind="wsd") == pytest.approx(1.0)  # done at 20% of the time
    assert lr_at(0.2, 60, 1.0, 100, warmup_end=0.2) == pytest.approx(1.0)  # cosine starts from there
    for s in range(40):  # a --max-steps run of 200 (warmup capped at 40): the step ramp always leads
        assert lr_at(s / 200, s, 1.0, 40) == pytest.approx((s + 1) / 40)
    # a run whose first step came at 10% of its --max-time (startup): 20% of the 90% left, from there
    assert lr_at(0.19, 3, 1.0, 100, warmup_from=0.1) == pytest.approx(0.5)
    assert lr_at(0.28, 5, 1.0, 100, kind="wsd", warmup_from=0.1) == pytest.approx(1.0)
