"""A weighted mixture end to end (issue 14): repeated --dataset-id with --dataset-weights (and the same as a
config file's lists), realised shares in the log and summary.json's data_sources, and an exact resume that
restores the mixture's state (same batches as the uninterrupted run)."""

from __future__ import annotations

import json

import pytest

from train_optimized import main

pytestmark = pytest.mark.slow


def test_mixture_shares_summary_and_exact_resume(tmp_path, data_dir, capsys):
    stories, shakespeare = str(data_dir / "tinystories_train.txt"), str(data_dir / "tinyshakespeare_train.txt")
    common = ["--use-streaming", "--target-params", "100000", "--seq-len", "32", "--batch-size", "8",
              "--vocab-size", "300", "--eval-tokens", "1024", "--eval-every", "20", "--log-every", "20",
              "--shuffle-buffer-size", "200", "--checkpoint-every", "20"]
    whole = tmp_path / "whole"
    assert main(common + ["--dataset-id", stories, "--dataset-id", shakespeare, "--dataset-weights", "0.7,0.3",
                          "--max-steps", "40", "--output-dir", str(whole)]) == 0
    log = capsys.readouterr().out
    said = [line for line in log.splitlines() if line.startswith("[data] mixture shares: ")]
    assert len(said) == 2 and f"{stories} 0." in said[0] and "(weight 0.700)" in said[0]
    summary = json.loads((whole / "summary.json").read_text())
    sources = summary["data_sources"]
    assert [s["id"] for s in sources] == [stories, shakespeare] and [s["weight"] for s in sources] == [0.7, 0.3]
    assert sum(s["tokens"] for s in sources) == summary["tokens"] and all(s["documents"] > 0 for s in sources)

    # The same run from a config file's lists, stopped at step 20 and resumed to 40: the same batches.
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(f"dataset_id: [{stories}, {shakespeare}]\ndataset_weights: [7, 3]\n")
    part = tmp_path / "part"
    assert main(common + ["--config", str(cfg), "--max-steps", "20", "--output-dir", str(part)]) == 0
    assert main(["--resume", str(part), "--max-steps", "40"]) == 0
    resumed = json.loads((part / "summary.json").read_text())
    # (The losses differ: the learning-rate schedule followed --max-steps 20, then 40.)
    assert resumed["data_digest"] == summary["data_digest"] and resumed["steps"] == 40
    assert resumed["data_sources"] == sources
    capsys.readouterr()


def test_mixture_flags_are_checked(tmp_path, data_dir, capsys):
    one = str(data_dir / "tinystories_train.txt")
    for argv, message in [
        (["--dataset-id", one, "--dataset-weights", "0.5,0.5"], "--dataset-weights: needs several --dataset-id"),
        (["--dataset-id", one, "--dataset-id", one, "--dataset-weights", "1,2,3"], "give 2 positive weights"),
        (["--dataset-id", one, "--dataset-id", one, "--no-use-streaming"], "need --use-streaming"),
    ]:
        assert main(["--use-streaming", *argv, "--output-dir", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
