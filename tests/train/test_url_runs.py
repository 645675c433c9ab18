"""Training from an http(s) URL (issue 14): a run whose server fails (503, 429, a cut body) trains on exactly
the batches of the same run from the local file; a server that starts answering 404 mid-run stops the run with
one line, exit 2, and the checkpoint it had saved kept."""

from __future__ import annotations

import json
import shutil

import pytest
from fault_server import FaultServer

from train_optimized import main

pytestmark = pytest.mark.slow

ARGS = ["--use-streaming", "--target-params", "100000", "--seq-len", "32", "--batch-size", "4", "--vocab-size",
        "300", "--eval-tokens", "512", "--shuffle-buffer-size", "64", "--log-every", "1"]


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_faults_on_the_url_leave_the_batches_unchanged(tmp_path, data_dir, capsys):
    served = tmp_path / "served"
    served.mkdir()
    shutil.copy(data_dir / "tinyshakespeare_train.txt", served / "shakespeare.txt")
    local = ["--dataset-id", str(served / "shakespeare.txt")]
    assert main(ARGS + local + ["--max-steps", "12", "--output-dir", str(tmp_path / "local")]) == 0
    with FaultServer(served, {2: "503", 3: "cut:100000", 5: "429", 7: "cut:250000"}) as server:
        remote = ["--dataset-id", server.url("shakespeare.txt")]
        assert main(ARGS + remote + ["--max-steps", "12", "--output-dir", str(tmp_path / "url")]) == 0
        gets = list(server.gets)
    log = capsys.readouterr().out
    retries = [line for line in log.splitlines() if "; retry " in line]
    assert len(retries) >= 3, log  # each fault met was retried, one line each in the run's log
    assert any(r == "bytes=100000-" for _, r in gets)  # resumed at the byte it reached
    a, b = _summary(tmp_path / "local"), _summary(tmp_path / "url")
    assert a["data_digest"] == b["data_digest"] and a["eval_loss"] == b["eval_loss"]


def test_a_permanent_error_mid_run_stops_in_one_line_and_keeps_the_checkpoint(tmp_path, data_dir, capsys):
    served = tmp_path / "served"
    served.mkdir()
    shutil.copy(data_dir / "tinystories_valid.jsonl", served / "stories.jsonl")
    args = ARGS + ["--seq-len", "64", "--batch-size", "32", "--checkpoint-every", "5"]  # later flags win
    with FaultServer(served) as probe:  # how many GETs come before the training stream's own
        assert main(args + ["--dataset-id", probe.url("stories.jsonl"), "--max-steps", "1", "--output-dir",
                            str(tmp_path / "probe")]) == 0
        training_get = len(probe.gets)
    capsys.readouterr()
    # The training stream is cut after 400 KB and every request after that is refused: 404.
    faults = lambda n: "cut:400000" if n == training_get else ("404" if n > training_get else "")
    out = tmp_path / "run"
    with FaultServer(served, faults) as server:
        code = main(args + ["--dataset-id", server.url("stories.jsonl"), "--max-steps", "100000", "--output-dir",
                            str(out)])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: http://127.0.0.1:") and "HTTP 404" in err[0], err
    assert "; retry 1/8" in captured.out  # the cut was retried; the 404 that answered was not
    saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and saved[-1] % 5 == 0  # the checkpoints saved before the failure are kept
