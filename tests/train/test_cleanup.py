"""A run that raises mid-way (here: a callback's bug at step 2) leaves a notebook clean: no prefetch or
monitor thread, no open file in the run dir, the signal handlers restored, the checkpoint manager closed."""

import os
import signal
import threading

import pytest

from slm.train.loop import Callback
from train_optimized import Config, train


class Boom(Callback):
    def on_step(self, run):
        if run.step == 2:
            raise RuntimeError("a bug in someone's callback")


def _open_files_under(path) -> list[str]:
    fds = os.listdir("/proc/self/fd")
    out = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


@pytest.mark.slow
def test_a_run_that_raises_closes_everything(tmp_path, data_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = {t.name for t in threading.enumerate()}
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="someone's callback"):
        train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                     seq_len=64, batch_size=8, eval_tokens=2048, max_steps=20, checkpoint_every=1,
                     output_dir=str(out)), log=lambda *_: None, callbacks=[Boom()])
    alive = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not {"data-prefetch", "memory-monitor"} & alive, alive
    assert _open_files_under(out) == []  # metrics.jsonl, TensorBoard events, statm, checkpoints: all closed
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
    assert (out / "checkpoints" / "1").is_dir()  # what was saved before the error stays
