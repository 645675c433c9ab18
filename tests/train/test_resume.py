"""Exact resume through the trainer: interrupted runs continue with the same batches and losses; what a
resume refuses; SIGTERM and kill -9; the checkpoint policy in a run."""

import json

import pytest

from stop_after import StopAfter




@pytest.mark.slow
def test_interrupted_and_resumed_twice_equals_one_run(tmp_path, data_dir, monkeypatch):
    """40 steps in one go vs interrupted after 13 and 33 and resumed: same batches (digest), same losses.

    Epoch 0 (200 documents) ends near step 28, so the second interruption lands in epoch 1, where
    --dropout-from-epoch 1 has switched to the step with dropout: the second process switches mid-run, the
    third starts with it, and the masks (from seed and micro-step) repeat.
    """
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def cfg(out, **kw):
        base = dict(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                    seq_len=64, batch_size=8, max_examples=200, shuffle_buffer_size=50, eval_tokens=2048,
                    log_every=1, eval_every=10**6, checkpoint_every=10**6, max_steps=40, seed=3, dropout=0.2,
                    dropout_from_epoch=1, output_dir=str(out))
        return Config(**{**base, **kw})

    quiet = lambda *_: None  # noqa: E731
    whole = train(cfg(tmp_path / "whole"), log=quiet)
    out = tmp_path / "interrupted"
    first = train(cfg(out), log=quiet, callbacks=[StopAfter(13)])
    assert first["steps"] == 13 and first["stop_reason"] == "interrupted by the test"
    # the resumed process's 20th step is step 33, in epoch 1
    second = train(Config(resume=str(out), max_steps=40), log=quiet, callbacks=[StopAfter(20)])
    assert second["steps"] == 33 and second["epochs_started"] == 2
    final = train(Config(resume=str(out)), log=quiet)
    assert final["steps"] == 40 and final["data_digest"] == whole["data_digest"]

    def losses(run):
        return {r["step"]: r["loss"] for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r}

    a, b = losses(tmp_path / "whole"), losses(out)
    assert sorted(a) == sorted(b) == list(range(1, 41))
    assert max(abs(a[k] - b[k]) for k in a) <= 1e-6
    assert final["eval_loss"] == pytest.approx(whole["eval_loss"], abs=1e-6)


@pytest.mark.slow
def test_resume_refuses_a_different_model_or_dataset(tmp_path, data_dir, monkeypatch):
    from slm.errors import ConfigError
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                 seq_len=64, batch_size=8, eval_tokens=2048, max_steps=2, output_dir=str(out)), log=lambda *_: None)
    with pytest.raises(ConfigError, match="--seq-len 96 .the run used 64."):
        train(Config(resume=str(out), seq_len=96), log=lambda *_: None)
    with pytest.raises(ConfigError, match="--seq-len 128 .the run used 64."):  # the CLI knows 128 was given
        train(Config(resume=str(out), seq_len=128), log=lambda *_: None, explicit={"resume", "seq_len"})
    with pytest.raises(ConfigError, match="--dataset-id"):
        train(Config(resume=str(out), dataset_id=str(data_dir / "tinystories_train.txt")), log=lambda *_: None)
    with pytest.raises(ConfigError, match="no readable config.json"):
        train(Config(resume=str(tmp_path / "nothing")), log=lambda *_: None)


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_0_then_resumes(tmp_path, data_dir):
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import ROOT

    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train_optimized.py"), "--use-streaming", "--dataset-id",
           str(data_dir / "tinyshakespeare.txt"), "--target-params", "150000", "--seq-len", "64", "--batch-size", "8",
           "--eval-tokens", "2048", "--log-every", "1", "--max-steps", "100000", "--output-dir", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300  # a safety net against a hang, not a timing check
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3) and p.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    output, _ = p.communicate(timeout=300)
    assert p.returncode == 0, output[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"].startswith("SIGTERM: stopped after this step") and summary["steps"] >= 3
    assert str(summary["steps"]) in [d.name for d in (out / "checkpoints").iterdir()]
    r = subprocess.run([sys.executable, str(ROOT / "train_optimized.py"), "--resume", str(out),
                        "--max-steps", str(summary["steps"] + 2)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == summary["steps"] + 2


def test_checkpoint_minutes_and_keep_in_the_trainer(tmp_path, data_dir, monkeypatch):
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for schedule, kept in (("cosine", [4, 5]), ("wsd", [3, 4, 5])):  # wsd: also its last step before the decay
        out = tmp_path / schedule
        train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                     seq_len=64, batch_size=8, eval_tokens=2048, max_steps=5, checkpoint_minutes=1e-9,
                     keep_checkpoints=2, schedule=schedule, output_dir=str(out)), log=lambda *_: None)
        assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == kept


@pytest.mark.slow
def test_kill_9_while_saving_every_step_leaves_a_resumable_run(tmp_path, data_dir):
    """SIGKILL at an arbitrary moment of a run that saves at every step (so very likely mid-save)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import ROOT

    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "train_optimized.py"), "--use-streaming", "--dataset-id",
           str(data_dir / "tinyshakespeare.txt"), "--target-params", "150000", "--seq-len", "64", "--batch-size", "8",
           "--eval-tokens", "2048", "--log-every", "1", "--checkpoint-every", "1", "--keep-checkpoints", "2",
           "--max-steps", "100000", "--output-dir", str(out)]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300  # a safety net against a hang, not a timing check
    while not (metrics.exists() and metrics.read_text().count("\n") >= 6) and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    steps = sorted(int(d.name) for d in (out / "checkpoints").iterdir() if d.name.isdigit())
    assert steps, "no complete checkpoint survived"
    r = subprocess.run([sys.executable, str(ROOT / "train_optimized.py"), "--resume", str(out), "--max-steps",
                        str(steps[-1] + 2), "--checkpoint-every", "1000"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps[-1] + 2


def test_output_dir_without_room_for_checkpoints_is_refused(tmp_path, data_dir, monkeypatch):
    import collections
    import shutil

    from slm.errors import ConfigError
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    usage = collections.namedtuple("usage", "total used free")
    with pytest.raises(ConfigError, match="MB free, but 4 checkpoints of"):
        train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                     seq_len=64, batch_size=8, eval_tokens=2048, max_steps=2, output_dir=str(tmp_path / "full")),
              log=lambda *_: None, disk_usage=lambda path: usage(10**9, 10**9 - 10**5, 10**5))
    assert shutil.disk_usage(tmp_path).free > 10**5  # the real disk was never consulted or patched


def test_a_signal_aborts_the_eval_and_saves_at_once(tmp_path, data_dir, monkeypatch):
    """SIGTERM arrives as step 1 starts; step 1's eval (--eval-every 1) is aborted, the checkpoint saved."""
    import os
    import signal

    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    logs = []

    def log(line):
        logs.append(line)
        if line.startswith("[run] first step"):
            os.kill(os.getpid(), signal.SIGTERM)

    out = tmp_path / "run"
    s = train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                     seq_len=64, batch_size=8, eval_tokens=2048, eval_every=1, max_steps=50, output_dir=str(out)), log=log)
    assert s["stop_reason"].startswith("SIGTERM") and s["steps"] == 1 and s["eval_loss"] is None
    assert any("eval at step 1 aborted by SIGTERM" in line for line in logs)
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()] == ["1"]
    assert signal.getsignal(signal.SIGTERM) is not None  # the handler was restored after the run


@pytest.mark.slow
def test_a_resume_with_a_new_limit_replaces_the_old_one_and_ends_decayed(tmp_path, data_dir, monkeypatch):
    """Issue 41's "continue exactly": a --max-time run, then --resume --max-steps N. The old time limit no
    longer stops it (it stopped at step 416 of 5000), the log says what replaced what, the rate resumes below
    the peak and ends at the cosine's floor; a finished run resumed without a new limit is refused in one line;
    a STOP file stops one run, not the next."""
    from slm.errors import ConfigError
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    first = train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                         seq_len=64, batch_size=8, eval_tokens=2048, max_time=12, log_every=1, eval_every=10**6,
                         output_dir=str(out)), log=lambda *_: None)
    assert first["stop_reason"] == "--max-time 12s" and first["steps"] >= 1
    with pytest.raises(ConfigError, match="already at its --max-time 12s; give a larger --max-time"):
        train(Config(resume=str(out)), log=lambda *_: None)
    (out / "STOP").touch()  # left over: a resume must not stop for it
    lines: list[str] = []
    n = first["steps"] + 40
    second = train(Config(resume=str(out), max_steps=n), log=lines.append)
    assert second["steps"] == n and second["stop_reason"] == f"--max-steps {n}"
    text = "\n".join(lines)
    assert "now stops at --max-steps" in text and "replacing --max-time 12s" in text, text
    assert "removed" in text and not (out / "STOP").exists()
    rows = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "lr" in r]
    peak = max(r["lr"] for r in rows)
    resumed = [r["lr"] for r in rows if r["step"] > first["steps"]]
    assert len(resumed) == 40 and max(resumed) <= peak and resumed[-1] < 0.12 * peak  # ends decayed


@pytest.mark.slow
def test_a_wsd_run_made_longer_branches_before_its_decay_and_equals_the_straight_run(tmp_path, data_dir,
                                                                                     monkeypatch):
    """Issue 41's goal for extensions: 20 steps (WSD, decaying over the last half), then --resume --max-steps 40.
    The run continues from step 10, its last before the decay (kept although --keep-checkpoints 1 prunes the
    rest), so it follows the straight 40-step run's path: the same losses step for step and the same held-out
    loss. The decayed end is kept as 20.superseded, with its metrics rows."""
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def cfg(out, steps):
        return Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                      seq_len=64, batch_size=8, eval_tokens=2048, log_every=1, eval_every=10**6, warmup_steps=2,
                      checkpoint_every=3, keep_checkpoints=1, schedule="wsd", max_steps=steps, output_dir=str(out))

    quiet = lambda *_: None  # noqa: E731
    straight = train(cfg(tmp_path / "straight", 40), log=quiet)
    out = tmp_path / "extended"
    short = train(cfg(out, 20), log=quiet)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["10", "20"]  # 10: the last stable step
    lines: list[str] = []
    extended = train(Config(resume=str(out), max_steps=40), log=lines.append)
    assert any("continues from step 10" in line for line in lines), lines

    def losses(run):
        return {r["step"]: r["loss"] for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r}

    a, b = losses(tmp_path / "straight"), losses(out)
    assert sorted(b) == list(range(1, 41)) and max(abs(a[k] - b[k]) for k in a) <= 1e-6
    assert extended["eval_loss"] == pytest.approx(straight["eval_loss"], abs=1e-6)
    assert extended["eval_loss"] < short["eval_loss"]
    assert (out / "checkpoints" / "20.superseded").is_dir() and (out / "metrics.superseded-20.jsonl").exists()


@pytest.mark.slow
def test_a_wsd_extension_whose_stable_checkpoint_is_damaged_continues_from_the_newest(tmp_path, data_dir,
                                                                                       monkeypatch):
    """The checkpoint to branch from fails its manifest check: one line says so and the run continues from its
    newest checkpoint (nothing renamed), as a cosine run would."""
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                 seq_len=64, batch_size=8, eval_tokens=2048, eval_every=10**6, warmup_steps=2, schedule="wsd",
                 max_steps=20, output_dir=str(out)), log=lambda *_: None)
    state_files = [p for p in (out / "checkpoints" / "10" / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    big = max(state_files, key=lambda p: p.stat().st_size)
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    lines: list[str] = []
    extended = train(Config(resume=str(out), max_steps=30), log=lines.append)
    assert extended["steps"] == 30
    said = [line for line in lines if "before the decay (10) cannot be used" in line]
    assert len(said) == 1 and "continuing from step 20" in said[0], lines
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit())[-1] == "30"
    assert not any(".superseded" in p.name for p in (out / "checkpoints").iterdir())
