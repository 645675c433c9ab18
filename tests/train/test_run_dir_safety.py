"""A run directory the user can trust (issue 31): a damaged newest checkpoint is set aside and the run
resumes exactly from the one before; a full disk stops the run in one line (exit 2) with its summary and
the last complete checkpoint, and the resume after freeing space continues exactly. (One owner per run
directory: tests/io/test_runlock.py.)"""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT
from stop_after import StopAfter

STEPS = 20


def settings(data_dir, out, **kw) -> dict:
    return {"dataset_id": str(data_dir / "tinyshakespeare.txt"), "use_streaming": True, "target_params": 150_000,
            "seq_len": 64, "batch_size": 8, "max_examples": 400, "shuffle_buffer_size": 200, "eval_tokens": 2048,
            "log_every": 1, "eval_every": 10**6, "checkpoint_every": 5, "max_steps": STEPS, "seed": 1,
            "output_dir": str(out), **kw}


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def whole(tmp_path_factory, data_dir):
    """The uninterrupted run: (per-step losses, summary)."""
    from train_optimized import Config, train

    out = tmp_path_factory.mktemp("whole") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        summary = train(Config(**settings(data_dir, out)), log=quiet)
    return losses(out), summary


def losses(run) -> dict[int, float]:
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), "a resumed run's metrics.jsonl holds each step once"
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def assert_same_run(run, summary, whole) -> None:
    want, want_summary = whole
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-6
    assert summary["data_digest"] == want_summary["data_digest"]


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_exactly(tmp_path, data_dir, whole,
                                                                              monkeypatch):
    """Checkpoints 5, 10, 15; a state file of 15 truncated: --resume says so in one line, sets it aside and
    continues from 10, with the same per-step losses and batches as the uninterrupted run."""
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    train(Config(**settings(data_dir, out)), log=quiet, callbacks=[StopAfter(15)])
    ckpt = out / "checkpoints" / "15"
    state_file = max((p for p in (ckpt / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    state_file.write_bytes(state_file.read_bytes()[:1000])
    logs = []
    summary = train(Config(resume=str(out)), log=logs.append)
    damaged = [line for line in logs if line.startswith("[resume] checkpoint")]
    assert len(damaged) == 1 and damaged[0].startswith("[resume] checkpoint 15 is damaged (state/")
    assert "is 1,000 bytes, " in damaged[0] and "moved aside to 15.damaged" in damaged[0]
    assert any(line.startswith("[resume] step 10 of") for line in logs)
    assert (out / "checkpoints" / "15.damaged").is_dir()
    assert_same_run(out, summary, whole)


class TakeSpaceAt:
    """A disk_usage whose free space drops to 50 KB once the run reaches a step (another program took it)."""

    def __init__(self):
        self.full = False

    def __call__(self, path):
        import shutil
        from types import SimpleNamespace

        real = shutil.disk_usage(path)
        return SimpleNamespace(total=real.total, used=real.used, free=50_000 if self.full else real.free)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_the_resume_continues_exactly(tmp_path, data_dir, whole,
                                                                                monkeypatch):
    from slm.errors import DiskFullError
    from slm.train.loop import Callback
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    disk = TakeSpaceAt()

    class At7(Callback):
        def on_step(self, run):
            disk.full = disk.full or run.step == 7

    out, logs = tmp_path / "run", []
    with pytest.raises(DiskFullError, match=r"^checkpoint 10 not saved: the disk of .* is full \(0.0 MB free, the "
                                            r"checkpoint needs ~\d.\d MB\); newest complete checkpoint: step 5, "
                                            r"kept. Free space, then --resume "):
        train(Config(**settings(data_dir, out)), log=logs.append, callbacks=[At7()], disk_usage=disk)
    assert "[run] stopped: the disk is full: checkpoint 10 not saved" in logs
    summary = json.loads((out / "summary.json").read_text())  # the run stopped cleanly, with its summary
    assert summary["steps"] == 10 and summary["stop_reason"] == "the disk is full: checkpoint 10 not saved"
    assert sorted(os.listdir(out / "checkpoints")) == ["5"]
    assert_same_run(out, train(Config(resume=str(out)), log=quiet), whole)


def can_mount_tmpfs(where) -> bool:
    os.makedirs(where, exist_ok=True)
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs '{where}'"],
                              capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.slow
def test_a_disk_that_fills_mid_save_ends_in_one_line_no_traceback(tmp_path, data_dir, whole):
    """The CLI's view: another program takes the space after the start-up check, so orbax's write itself
    fails. On a small tmpfs where this machine lets a test mount one (a private mount namespace), else with
    tensorstore's ENOSPC error injected into orbax's save. One `error:` line, exit 2, no traceback from
    orbax's threads; after freeing space --resume continues exactly."""
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    os.makedirs(out)
    mode = "fill" if can_mount_tmpfs(mnt) else "inject"
    run = (mnt if mode == "fill" else tmp_path) / "run"
    values = json.dumps(settings(data_dir, run, checkpoint_sync="on"))
    py = sys.executable
    script = (f"{'mount -t tmpfs -o size=24m tmpfs ' + str(mnt) + ' && ' if mode == 'fill' else ''}"
              f"{py} {ROOT / 'tests' / 'fill_disk.py'} '{values}' 8 {mode} >{out}/1.out 2>{out}/1.err; "
              f"echo $? >{out}/1.rc; rm -f {mnt}/filler; "
              f"{py} {ROOT / 'train_optimized.py'} --resume {run} >{out}/2.out 2>{out}/2.err; echo $? >{out}/2.rc; "
              f"cp -r {run} {out}/run")
    cmd = ["unshare", "-rm", "sh", "-c", script] if mode == "fill" else ["sh", "-c", script]
    subprocess.run(cmd, check=True, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    read = lambda name: (out / name).read_text()  # noqa: E731
    first = read("1.out") + read("1.err")
    assert read("1.rc").strip() == "2", first[-3000:]
    errors = [line for line in read("1.err").splitlines() if line.strip()]
    assert errors[-1].startswith(f"error: checkpoint 10 not saved: the disk of {run}/checkpoints is full (")
    assert "newest complete checkpoint: step 5, kept" in errors[-1]
    for noise in ("Traceback", "RESOURCE_EXHAUSTED", "Event loop is closed", "ERROR:"):
        assert noise not in first, (mode, first[-3000:])
    assert "[run] stopped: the disk is full: checkpoint 10 not saved" in read("1.out")
    assert read("2.rc").strip() == "0", read("2.err")[-3000:]
    assert "[resume] step 5 of" in read("2.out")
    assert sorted(os.listdir(out / "run" / "checkpoints")) == ["10", "15", "20"]
    assert_same_run(out / "run", json.loads((out / "run" / "summary.json").read_text()), whole)
