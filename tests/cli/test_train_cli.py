"""The command line end to end: a tiny real run on tinyshakespeare, and every bad-input error."""

import json
import math
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from helpers import ROOT
from tokenizers import Tokenizer

from slm.cli import malloc
from train_optimized import main

TINY = ["--target-params", "150000", "--seq-len", "64", "--batch-size", "16", "--learning-rate", "3e-3",
        "--warmup-steps", "10", "--eval-tokens", "4096", "--log-every", "10"]


def _cli(args, tmp_path, env_extra=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, str(ROOT / "train_optimized.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("run") / "out"
    args = ["--use-streaming", "--dataset-id", str(data_dir / "tinyshakespeare.txt"), *TINY,
            "--max-steps", "60", "--eval-every", "30", "--checkpoint-every", "30", "--output-dir", str(out)]
    proc = _cli(args, out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.mark.slow
def test_tiny_run_beats_unigram_baseline(tiny_run, data_dir):
    out, _ = tiny_run
    summary = json.loads((out / "summary.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = tok.encode((data_dir / "tinyshakespeare.txt").read_text()).ids
    counts = np.array(list(Counter(ids).values()), dtype=np.float64)
    p = counts / counts.sum()
    unigram_nats = float(-(p * np.log(p)).sum())  # the best unigram model, fit on the data itself
    assert summary["eval_loss"] < unigram_nats, (summary["eval_loss"], unigram_nats)
    assert math.isfinite(summary["eval_bpb"]) and summary["eval_bpb"] > 0


@pytest.mark.slow
def test_tiny_run_writes_every_output(tiny_run):
    out, proc = tiny_run
    config = json.loads((out / "config.json").read_text())
    for key in ("batch_size", "seq_len", "target_params", "gradient_accumulation_steps", "learning_rate",
                "model", "params", "vocab_size", "dataset", "use_streaming"):
        assert key in config
    assert config["params"] == pytest.approx(150_000, rel=0.05)
    assert (config["optimizer"], config["schedule"]) == ("muon", "wsd")  # the defaults, resolved and recorded
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == config["vocab_size"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in train_rows] == [10, 20, 30, 40, 50, 60]
    for r in train_rows:
        assert {"step", "loss", "lr", "tokens", "tokens_per_sec", "mfu", "data_wait_frac", "rss_mb"} <= set(r)
    assert [r["step"] for r in eval_rows] == [30, 60]
    assert {"eval_loss", "eval_bpb"} <= set(eval_rows[0])
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [30, 60]
    assert (out / "samples.txt").read_text().count("=== step") == 2
    summary = json.loads((out / "summary.json").read_text())
    for key in ("eval_loss", "eval_bpb", "params", "steps", "tokens", "wall_time_s", "tokens_per_sec",
                "model_flops_per_token", "peak_rss_mb"):
        assert key in summary
    assert summary["steps"] == 60 and summary["tokens"] == 60 * 16 * 64
    if malloc.on_glibc() and "GLIBC_TUNABLES" not in os.environ:  # restarted once under huge-page malloc
        assert summary["glibc_tunables"] == "glibc.malloc.hugetlb=1"
    assert "Traceback" not in proc.stderr
    # TensorBoard events with the logged scalars, and the loss plot (a PNG).
    assert list(out.glob("events.out.tfevents.*")) and (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The run's config.json is a valid --config file: every key is a flag or a known derived key.
    from slm.cli.config_file import load_config_file
    from train_optimized import Config

    values, _ = load_config_file(str(out / "config.json"), Config)
    assert values["seq_len"] == config["seq_len"] and values["learning_rate"] == config["learning_rate"]




def _bad(tmp_path, capsys, monkeypatch, *args):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main([*args, "--output-dir", str(tmp_path / "out"), "--max-steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    return err


def test_bad_input_errors(tmp_path, capsys, monkeypatch, data_dir):
    shakespeare = str(data_dir / "tinyshakespeare.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    notext = tmp_path / "rows.jsonl"
    notext.write_text('{"a": 1, "b": 2}\n{"a": 3, "b": 4}\n')
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    one_doc = tmp_path / "one-document.txt"
    one_doc.write_text("A single long document without blank lines. " * 200)
    cases = [
        (["--dataset-id", str(tmp_path / "missing.txt")], "no such file"),
        (["--dataset-id", "nobody/no-such-dataset"], "hub cannot be reached"),
        (["--dataset-id", str(empty)], "no documents"),
        (["--dataset-id", str(notext)], "--text-column"),
        (["--dataset-id", shakespeare, "--batch-size", "0"], "--batch-size"),
        (["--dataset-id", shakespeare, "--seq-len", "1"], "--seq-len"),
        (["--dataset-id", shakespeare, "--seq-len", "32", "--stride", "64"], "--stride"),
        (["--dataset-id", shakespeare, "--target-params", "20000", "--vocab-size", "1024"], "too small for vocab"),
        (["--dataset-id", shakespeare, "--tokenizer", str(blocker)], "not a valid tokenizer.json"),
        (["--dataset-id", shakespeare, "--learning-rate", "-1"], "--learning-rate"),
        (["--dataset-id", shakespeare, "--d-model", "96", "--n-heads", "32"], "odd head dim"),
        (["--dataset-id", str(one_doc)], "leaves nothing to train on"),
        (["--dataset-id", shakespeare, "--optimizer", "muon", "--init-from", str(tmp_path), "--lora-rank", "4"],
         "--optimizer muon with --lora-rank"),
        (["--dataset-id", shakespeare, "--schedule", "wsd", "--decay-fraction", "1.5"], "--decay-fraction"),
        (["--dataset-id", shakespeare, "--optimizer", "muon", "--muon-learning-rate", "0"], "--muon-learning-rate"),
    ]
    for args, needle in cases:
        assert needle in _bad(tmp_path, capsys, monkeypatch, *args), args
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["--dataset-id", shakespeare, "--output-dir", str(blocker / "sub")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--output-dir" in err and "not writable" in err
    previous = tmp_path / "previous-run"
    previous.mkdir()
    (previous / "config.json").write_text("{}")
    code = main(["--dataset-id", shakespeare, "--output-dir", str(previous)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "already holds a run" in err and (previous / "config.json").read_text() == "{}"


def test_bad_input_exit_code_and_no_traceback_in_a_real_process(tmp_path):
    proc = _cli(["--dataset-id", str(tmp_path / "nope.txt")], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
    assert "--dataset-id" in proc.stderr and "no such file" in proc.stderr
