"""slm.io.atomic and metrics.jsonl: a crash or a full disk at any moment leaves a run's files readable."""

import errno
import json
import os

import pytest


def test_a_rewrite_that_fails_midway_leaves_the_old_file_and_no_litter(tmp_path):
    from slm.io.atomic import write_atomically, write_json

    path = tmp_path / "summary.json"
    write_json(str(path), {"steps": 10})

    def half_then_full(tmp):
        with open(tmp, "w") as f:
            f.write('{"steps": 2')  # as far as the disk had room for
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        write_atomically(str(path), half_then_full)
    assert json.loads(path.read_text()) == {"steps": 10}
    assert os.listdir(tmp_path) == ["summary.json"]
    write_json(str(path), {"steps": 20})
    assert json.loads(path.read_text()) == {"steps": 20} and os.listdir(tmp_path) == ["summary.json"]


def test_a_resumed_metrics_log_drops_a_torn_line_and_the_steps_it_will_log_again(tmp_path):
    from slm.io.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(str(path))
    for step in range(1, 8):
        log.write({"step": step, "loss": 10.0 - step})
    log.write({"step": 5, "eval_loss": 4.5})
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 8, "lo')  # the row a power cut interrupted
    log = MetricsLog(str(path), append=True, keep_through=5)  # resumed from the checkpoint of step 5
    log.write({"step": 6, "loss": 3.0})
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], "loss" in r) for r in rows] == [(1, True), (2, True), (3, True), (4, True), (5, True),
                                                          (5, False), (6, True)]
    assert rows[-1]["loss"] == 3.0


def test_a_metrics_log_that_is_whole_is_left_as_it_is(tmp_path):
    from slm.io.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\nnot json, kept\n')
    before = os.stat(path).st_ino
    MetricsLog(str(path), append=True, keep_through=3).close()
    assert path.read_text() == '{"step": 1, "loss": 2.0}\nnot json, kept\n' and os.stat(path).st_ino == before
