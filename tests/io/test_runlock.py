"""slm.io.runlock: one trainer per run directory; a live run's directory is refused before anything is written."""

import os
import subprocess
import sys

import pytest
from helpers import ROOT

from slm.errors import ConfigError
from slm.io.runlock import RunLock

HOLD = ("import os, sys; sys.path.insert(0, {root!r}); from slm.io.runlock import RunLock; "
        "lock = RunLock({dir!r}); print(os.getpid(), flush=True); sys.stdin.read(); {end}")


def holder(directory, end="lock.release()"):
    """A process that takes the lock, prints its pid, and ends when its stdin closes (`end`: how)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD.format(root=str(ROOT), dir=str(directory), end=end)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, int(p.stdout.readline())


def test_a_second_owner_is_refused_naming_the_first_then_admitted_after_it(tmp_path):
    p, pid = holder(tmp_path)
    with pytest.raises(ConfigError, match=rf"another trainer owns this run directory \(pid {pid} on "):
        RunLock(str(tmp_path))
    p.communicate("")  # the holder releases and ends
    lines = []
    with RunLock(str(tmp_path), lines.append):
        pass
    assert lines == []  # a clean release leaves no owner behind to report


def test_a_lock_left_by_a_process_that_is_gone_is_taken_over_with_a_line(tmp_path):
    p, pid = holder(tmp_path, end="os._exit(0)")  # dies holding it, as a killed trainer does
    p.communicate("")
    lines = []
    lock = RunLock(str(tmp_path), lines.append)
    assert len(lines) == 1 and f"owner (pid {pid} on " in lines[0] and "is gone" in lines[0]
    lock.release()
    lock.release()  # twice is fine


@pytest.mark.slow
def test_resume_of_a_live_run_is_refused_before_writing_anything(tmp_path, data_dir):
    out = tmp_path / "run"
    common = [sys.executable, str(ROOT / "train_optimized.py"), "--use-streaming", "--dataset-id",
              str(data_dir / "tinyshakespeare.txt")]
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    first = subprocess.run([*common, "--target-params", "100000", "--max-steps", "2", "--eval-tokens", "1024",
                            "--output-dir", str(out)], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    p, pid = holder(out)  # the run is live (its trainer holds the lock)
    before = {f: os.path.getmtime(out / f) for f in os.listdir(out)}
    r = subprocess.run([*common, "--resume", str(out), "--max-steps", "4"], cwd=tmp_path, capture_output=True,
                       text=True, env=env)
    after = {f: os.path.getmtime(out / f) for f in os.listdir(out)}
    p.communicate("")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"another trainer owns this run directory (pid {pid} on " in r.stderr.strip().splitlines()[-1]
    assert after == before  # nothing written or added
