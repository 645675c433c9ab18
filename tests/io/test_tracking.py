"""Trackers (TensorBoard events read back, wandb only on request) and the loss plot."""

import glob
import json
import os
import struct
import subprocess
import sys
import types

import pytest
from helpers import ROOT

import slm.io.tracking as tracking
from slm.errors import TrackingError
from slm.io.tracking import Trackers, plot_loss

TRAIN = {"step": 10, "loss": 4.5, "lr": 1e-3, "tokens": 20480, "tokens_per_sec": 5000.0, "mfu": 0.12,
         "data_wait_frac": 0.01, "rss_mb": 900.0, "elapsed_s": 4.1, "epoch": 0}
EVAL = {"step": 20, "tokens": 40960, "eval_loss": 3.9, "eval_ppl": 49.4, "eval_bpb": 2.1, "eval_tokens": 4096}


def read_scalars(log_dir) -> tuple[dict, list[str]]:
    """{(tag, step): value} and the text tags of every tfevents file in log_dir, parsed from the record format."""
    from tensorboardX.proto import event_pb2

    scalars, texts = {}, []
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        with open(path, "rb") as f:
            data = f.read()
        i = 0
        while i < len(data):  # record: u64 length, u32 crc(length), payload, u32 crc(payload)
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    scalars[(v.tag, event.step)] = v.simple_value
                else:
                    texts.append(v.tag)
    return scalars, texts


def test_tensorboard_scalars_read_back(tmp_path):
    t = Trackers(str(tmp_path), config={"batch_size": 8, "learning_rate": 1e-3})
    t.write(TRAIN)
    t.write({**TRAIN, "step": 20, "loss": 4.0, "device_mb": 123.0})
    t.write(EVAL)
    t.close()
    t.close()  # twice is fine
    s, texts = read_scalars(tmp_path)
    assert s[("train/loss", 10)] == pytest.approx(4.5) and s[("train/loss", 20)] == pytest.approx(4.0)
    assert s[("train/lr", 10)] == pytest.approx(1e-3)
    assert s[("train/tokens_per_sec", 10)] == pytest.approx(5000.0)
    assert s[("train/mfu", 10)] == pytest.approx(0.12)
    assert s[("train/data_wait_frac", 10)] == pytest.approx(0.01)
    assert s[("memory/rss_mb", 10)] == pytest.approx(900.0)
    assert s[("memory/device_mb", 20)] == pytest.approx(123.0)
    assert s[("eval/loss", 20)] == pytest.approx(3.9)
    assert s[("eval/bpb", 20)] == pytest.approx(2.1)
    assert s[("eval/ppl", 20)] == pytest.approx(49.4)
    assert ("train/loss", 20) in s and not any(tag.startswith("eval/") and step == 10 for tag, step in s)
    assert "config" in " ".join(texts)


def test_wandb_not_imported_by_default(tmp_path):
    code = ("import sys, slm.io.tracking as tracking; t = tracking.Trackers(sys.argv[1]); t.write({'step': 1, 'loss': 1.0, 'tokens': 1}); "
            "t.close(); assert 'wandb' not in sys.modules; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, installed or not
    with pytest.raises(TrackingError) as e:
        Trackers(str(tmp_path), use_wandb=True)
    assert str(e.value) == "--wandb: the wandb package is not installed; pip install wandb"
    assert not glob.glob(str(tmp_path / "events.*"))  # failed before writing anything
    with pytest.raises(TrackingError, match="pip install wandb"):
        tracking.require_wandb()


def test_a_missing_tensorboardx_is_refused_in_one_line_before_anything_is_made(tmp_path):
    """The trainer without tensorboardX (a pinned requirement; a lent GPU's image lacked it): exit 2, one line
    naming the package and the pip command, no traceback, no run folder."""
    text = tmp_path / "t.txt"
    text.write_text("some words of text\n" * 200)
    code = ("import sys, runpy; sys.modules['tensorboardX'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path('train_optimized.py', run_name='__main__')")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", code, "train_optimized.py", "--use-streaming", "--dataset-id",
                           str(text), "--max-steps", "1", "--output-dir", str(run)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == f"error: {tracking.TENSORBOARD_MISSING}"
    assert "Traceback" not in proc.stderr and not run.exists()


def test_wandb_gets_rows_when_asked(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    t = Trackers(str(tmp_path / "run7"), config={"seed": 0}, use_wandb=True, wandb_project="p")
    t.write(TRAIN)
    t.write(EVAL)
    t.close()
    assert calls[0] == ("init", {"project": "p", "name": "run7", "dir": str(tmp_path / "run7"), "config": {"seed": 0}})
    assert calls[1][2] == 10 and calls[1][1]["train/loss"] == 4.5
    assert calls[2][2] == 20 and calls[2][1]["eval/bpb"] == 2.1
    assert calls[-1] == ("finish",)


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def _metrics(tmp_path, rows) -> str:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_plot_loss_png(tmp_path):
    import matplotlib

    backend = matplotlib.get_backend()
    rows = [{**TRAIN, "step": s, "tokens": s * 2048, "loss": 5 - s / 100} for s in range(10, 110, 10)]
    rows.insert(5, {**EVAL, "step": 50, "tokens": 50 * 2048})
    rows.append({**EVAL, "step": 100, "tokens": 100 * 2048, "eval_loss": 3.5})
    out = plot_loss(_metrics(tmp_path, rows), str(tmp_path / "loss.png"), log_x=True)
    w, h = _png_size(out)
    assert 400 <= w <= 2000 and 300 <= h <= 2000
    assert matplotlib.get_backend() == backend
    assert set(os.listdir(tmp_path)) == {"metrics.jsonl", "loss.png"}  # no temporary file left


@pytest.mark.parametrize("rows", [[TRAIN], [TRAIN, {**TRAIN, "step": 20}], [EVAL], []])
def test_plot_loss_sparse_files(tmp_path, rows):
    out = plot_loss(_metrics(tmp_path, rows), str(tmp_path / "loss.png"))
    assert _png_size(out)[0] > 0


def test_read_metrics_after_resume_and_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{**TRAIN, "step": s} for s in (10, 20, 30)] + [{**TRAIN, "step": s, "loss": 1.0} for s in (20, 30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 40, "lo')
    train, evals = tracking.read_metrics(str(path))
    assert [(r["step"], r["loss"]) for r in train] == [(10, 4.5), (20, 1.0), (30, 1.0)] and evals == []


def test_imports_are_cheap():
    code = "import sys, slm.io.tracking, slm.cli.config_file; print(sorted(m for m in ('matplotlib', 'tensorboardX', 'wandb', 'yaml') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr[-2000:]
