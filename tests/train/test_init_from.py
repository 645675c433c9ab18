"""--init-from (issue 15, first part): a pretrained Qwen2-style folder (GQA, q/k/v biases, tied head) with its
tokenizer becomes a run with --max-steps 0 (step-0 checkpoint, eval, summary) whose greedy continuation is
transformers' own; fine-tuning it for a few steps trains from those weights and resumes; that run is itself a
starting point for --init-from."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_tiny import save_tiny
from tokenizer_zoo import DOCS

from slm.data.tokenizer import train_bpe
from slm.model.generate import generate_ids
from slm.model.transformer import Transformer
from slm.train.builder import load_run
from train_optimized import main

pytestmark = pytest.mark.slow


def test_init_from_a_folder_evaluates_generates_and_fine_tunes(tmp_path, data_dir, capsys):
    folder = tmp_path / "qwen2-tiny"
    hf = save_tiny("qwen2", folder, vocab_size=300, tokenizer=train_bpe(DOCS, 300))
    common = ["--use-streaming", "--init-from", str(folder), "--dataset-id", str(data_dir / "tinyshakespeare_train.txt"),
              "--seq-len", "32", "--batch-size", "4", "--eval-tokens", "512"]
    zero = tmp_path / "zero"
    assert main(common + ["--max-steps", "0", "--output-dir", str(zero)]) == 0
    log = capsys.readouterr().out
    assert "[init] " in log and "M parameters loaded from safetensors" in log
    summary = json.loads((zero / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["stop_reason"] == "--max-steps 0" and summary["eval_loss"] > 0
    assert summary["params"] == sum(p.numel() for p in hf.parameters())
    assert [p.name for p in (zero / "checkpoints").iterdir() if p.name.isdigit()] == ["0"]

    run = load_run(str(zero))
    assert (run.shape.kv_heads, run.shape.qkv_bias, run.shape.tie_embeddings) == (2, True, True)
    prompt = [7, 42, 9]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 3:]
    got = generate_ids(Transformer(run.shape), run.params, prompt, 10, temperature=0.0)[0]
    assert got.tolist() == want.tolist()

    tuned = tmp_path / "tuned"
    assert main(common + ["--max-steps", "4", "--eval-every", "4", "--output-dir", str(tuned)]) == 0
    after = json.loads((tuned / "summary.json").read_text())
    assert after["steps"] == 4 and after["eval_loss"] < summary["eval_loss"] - 0.1  # it learned from step 0's model
    assert json.loads((tuned / "config.json").read_text())["optimizer"] == "adamw"  # a pretrained start's default
    config = json.loads((tuned / "config.json").read_text())
    assert config["init_from"] == str(folder) and config["tokenizer"] == str(folder / "tokenizer.json")
    assert main(["--resume", str(tuned), "--max-steps", "6"]) == 0  # the shape comes from the folder again
    final = json.loads((tuned / "summary.json").read_text())
    assert final["steps"] == 6 and final["trainable_params"] == final["params"]

    # A run of this trainer is a starting point too: its newest checkpoint, evaluated on the same data.
    again = tmp_path / "again"
    assert main(common[:1] + ["--init-from", str(tuned)] + common[3:] + ["--max-steps", "0", "--output-dir",
                                                                        str(again)]) == 0
    assert "parameters loaded from step 6 of the run" in capsys.readouterr().out
    assert json.loads((again / "summary.json").read_text())["eval_loss"] == pytest.approx(final["eval_loss"], abs=1e-6)


def test_init_from_bad_input_is_one_line(tmp_path, capsys):
    for argv, message in [
        (["--init-from", str(tmp_path / "missing-dir/")], "not a folder"),
        (["--init-from", str(tmp_path), "--max-steps", "0", "--vocab-size", "512"], "drop --vocab-size"),
        (["--max-steps", "0"], "--max-steps 0: must be positive (0 only with --init-from"),
    ]:
        assert main(["--use-streaming", *argv, "--output-dir", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
