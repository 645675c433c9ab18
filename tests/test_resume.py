"""Exact resume: the loader restored from its state anywhere in a stream replays the rest byte for byte."""

import hashlib
import itertools
import json

import pytest

from conftest import DATA
from hf_dataset_loader import ListSource, read_file
from streaming_data_loader import StreamingDataLoader
from tokenizer_utils import train_bpe


@pytest.fixture(scope="module")
def stories() -> list[str]:
    return list(itertools.islice(read_file(str(DATA / "tinystories_train.txt")), 60))


@pytest.fixture(scope="module")
def tok(stories):
    return train_bpe(stories, vocab_size=512)


def _digest(batch) -> str:
    return hashlib.sha256(batch["input_ids"].tobytes() + batch["targets"].tobytes()).hexdigest()


@pytest.mark.parametrize("buffer,prefetch", [(16, 2), (0, 0), (1000, 1)])
def test_restoring_at_every_batch_replays_the_rest_exactly(stories, tok, buffer, prefetch):
    """Every batch boundary of two epochs, through a JSON round trip as a checkpoint stores it.

    buffer 16: the buffer is mid-stream most of the time; 0: no shuffling; 1000 (> the 60 documents):
    the whole epoch is read into the buffer and drained, so states land inside the drain.
    """
    def make():
        return StreamingDataLoader(ListSource("stories", stories), tok, seq_len=32, batch_size=8,
                                   shuffle_buffer_size=buffer, seed=7, prefetch=prefetch, chunk_chars=3000)

    loader = make()
    for epoch in (0, 1):
        digests, states = [], []
        for batch in loader.iter_epoch(epoch):
            digests.append(_digest(batch))
            states.append(json.loads(json.dumps(loader.state_json())))
        assert len(digests) >= 20 and len(set(digests)) == len(digests)
        for k, state in enumerate(states):
            rest = [_digest(b) for b in make().iter_epoch(epoch, state)]
            assert rest == digests[k + 1:], f"epoch {epoch}: resumed after batch {k} diverged"


def test_state_for_another_epoch_is_refused(stories, tok):
    loader = StreamingDataLoader(ListSource("stories", stories), tok, seq_len=32, batch_size=4, shuffle_buffer_size=16)
    next(iter(loader.iter_epoch(0)))
    with pytest.raises(ValueError, match="epoch 0, not 1"):
        loader.iter_epoch(1, loader.state_json())


def _interrupting_at(monkeypatch, steps: set[int]):
    """Make the trainer's per-step stop check fire after the given optimizer steps (as a STOP file would)."""
    import train_optimized

    calls = {"n": 0}

    def fake(out):
        calls["n"] += 1
        return "STOP" if calls["n"] in steps else None

    monkeypatch.setattr(train_optimized, "stop_requested", fake)


@pytest.mark.slow
def test_interrupted_and_resumed_twice_equals_one_run(tmp_path, data_dir, monkeypatch):
    """40 steps in one go vs interrupted after 13 and 33 and resumed: same batches (digest), same losses.

    Epoch 0 (200 documents) ends near step 28, so the second interruption lands in epoch 1.
    """
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def cfg(out, **kw):
        base = dict(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                    seq_len=64, batch_size=8, max_examples=200, shuffle_buffer_size=50, eval_tokens=2048,
                    log_every=1, eval_every=10**6, checkpoint_every=10**6, max_steps=40, seed=3, output_dir=str(out))
        return Config(**{**base, **kw})

    quiet = lambda *_: None  # noqa: E731
    whole = train(cfg(tmp_path / "whole"), log=quiet)
    out = tmp_path / "interrupted"
    _interrupting_at(monkeypatch, {13})
    first = train(cfg(out), log=quiet)
    assert first["steps"] == 13 and first["stop_reason"] == "STOP file in the output dir"
    _interrupting_at(monkeypatch, {20})  # the resumed process's 20th step is step 33, in epoch 1
    second = train(Config(resume=str(out), max_steps=40), log=quiet)
    assert second["steps"] == 33 and second["epochs_started"] == 2
    monkeypatch.undo()
    final = train(Config(resume=str(out)), log=quiet)
    assert final["steps"] == 40 and final["data_digest"] == whole["data_digest"]

    def losses(run):
        return {r["step"]: r["loss"] for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r}

    a, b = losses(tmp_path / "whole"), losses(out)
    assert sorted(a) == sorted(b) == list(range(1, 41))
    assert max(abs(a[k] - b[k]) for k in a) <= 1e-6
    assert final["eval_loss"] == pytest.approx(whole["eval_loss"], abs=1e-6)


def test_resume_refuses_a_different_model_or_dataset(tmp_path, data_dir, monkeypatch):
    from train_optimized import Config, ConfigError, train

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

    from conftest import ROOT

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
    assert summary["stop_reason"].startswith("SIGTERM: checkpoint saved") and summary["steps"] >= 3
    assert str(summary["steps"]) in [d.name for d in (out / "checkpoints").iterdir()]
    r = subprocess.run([sys.executable, str(ROOT / "train_optimized.py"), "--resume", str(out),
                        "--max-steps", str(summary["steps"] + 2)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == summary["steps"] + 2


def test_keep_policy_keeps_newest_and_best_by_eval(tmp_path):
    import jax.numpy as jnp

    from checkpointing import Checkpointer

    ck = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    losses = {2: 1.5, 5: 2.0}  # step 2 has the best eval loss
    for step in range(1, 7):
        ck.save(step, {"w": jnp.full((4,), step)}, {"step": step}, eval_loss=losses.get(step))
    ck.wait()
    assert sorted(ck.manager.all_steps()) == [2, 5, 6]
    ck.close()


def test_checkpoint_minutes_and_keep_in_the_trainer(tmp_path, data_dir, monkeypatch):
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                 seq_len=64, batch_size=8, eval_tokens=2048, max_steps=5, checkpoint_minutes=1e-9,
                 keep_checkpoints=2, output_dir=str(out)), log=lambda *_: None)
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [4, 5]


@pytest.mark.slow
def test_kill_9_while_saving_every_step_leaves_a_resumable_run(tmp_path, data_dir):
    """SIGKILL at an arbitrary moment of a run that saves at every step (so very likely mid-save)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

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

    import train_optimized
    from train_optimized import Config, ConfigError, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(train_optimized.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**5, 10**5))
    with pytest.raises(ConfigError, match="MB free, but 4 checkpoints of"):
        train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                     seq_len=64, batch_size=8, eval_tokens=2048, max_steps=2, output_dir=str(tmp_path / "full")),
              log=lambda *_: None)
    assert shutil.disk_usage is not None


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


def test_each_save_is_verified_and_a_broken_one_is_loud(tmp_path):
    import jax.numpy as jnp

    from checkpointing import Checkpointer

    logs = []
    ck = Checkpointer(str(tmp_path / "ckpt"), keep=3, log=logs.append)
    ck.save(1, {"w": jnp.ones(4)}, {"step": 1})
    ck.save(2, {"w": jnp.ones(4)}, {"step": 2})  # verifies step 1 first
    ck.close()  # verifies step 2
    assert logs == [] and ck.verify(1) is None and ck.verify(2) is None
    ck = Checkpointer(str(tmp_path / "ckpt"), keep=3, log=logs.append)
    ck.save(3, {"w": jnp.ones(4)}, {"step": 99})  # a record that does not match its step
    ck.close()
    assert len(logs) == 1 and "VERIFY FAILED for step 3" in logs[0] and "records step 99" in logs[0]
    # The state tree is compared too: a checkpoint whose state lacks a saved leaf is reported.
    ck = Checkpointer(str(tmp_path / "ckpt"), keep=None, log=logs.append)
    assert ck.verify(2, {"w"}) is None
    assert "lacks 1 saved leaves" in ck.verify(2, {"w", "b"})
    ck.close()
