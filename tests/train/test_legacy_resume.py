"""A run directory written before the package redesign (tests/fixtures/legacy_run, commit 8db7e31) resumes
under the current code with the same per-step losses, eval loss and data digest as the old code's resume."""

import json
import shutil

import pytest
from helpers import ROOT

from train_optimized import Config, train

FIXTURE = ROOT / "tests" / "fixtures" / "legacy_run"


@pytest.mark.slow
def test_old_run_resumes_with_the_old_codes_losses(tmp_path, monkeypatch):
    expected = json.loads((FIXTURE / "expected_resume.json").read_text())
    shutil.copytree(FIXTURE / "run", tmp_path / "run")
    shutil.copy(FIXTURE / "corpus.txt", tmp_path / "corpus.txt")
    monkeypatch.chdir(tmp_path)  # the run's config.json names its data as corpus.txt
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    summary = train(Config(resume="run", max_steps=8, cpu_devices=1), log=lambda *_: None)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    losses = {str(r["step"]): r["loss"] for r in rows if "loss" in r and r["step"] > 4}
    assert losses.keys() == expected["train_losses"].keys()
    for step, loss in expected["train_losses"].items():
        assert losses[step] == pytest.approx(loss, abs=1e-6), step
    assert summary["eval_loss"] == pytest.approx(expected["eval_loss"], abs=1e-6)
    assert summary["data_digest"] == expected["data_digest"]
