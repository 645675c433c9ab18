"""On a GPU the trainer compiles its eval sample in pre-flight, before the state is placed (XLA:GPU's autotuning
runs candidate kernels on the card while it compiles). Here that path runs on CPU devices: the executables
compiled at abstract shapes and shardings must accept the run's real, sharded params, and be the ones the evals
use, with the samples unchanged."""

from __future__ import annotations

import pytest
from hf_tiny import save_tiny
from tokenizer_zoo import DOCS

import slm.train.evaluate as evaluate
import slm.train.run as run
from slm.data.tokenizer import train_bpe
from train_optimized import main

pytestmark = pytest.mark.slow
ahead = evaluate.sampler_ahead  # the real one, before the test patches it in


def test_a_sampler_compiled_in_preflight_is_the_one_the_evals_use(tmp_path, data_dir, monkeypatch, capsys):
    base = tmp_path / "base"
    save_tiny("llama3", base, vocab_size=300, tokenizer=train_bpe(DOCS, 300))
    common = ["--use-streaming", "--init-from", str(base), "--dataset-id", str(data_dir / "tinyshakespeare_train.txt"),
              "--seq-len", "32", "--batch-size", "4", "--eval-tokens", "256", "--lora-rank", "4", "--base-dtype",
              "nf4", "--max-steps", "4", "--eval-every", "2", "--cpu-devices", "2"]
    assert main(common + ["--output-dir", str(tmp_path / "later")]) == 0  # the first eval compiles it (CPU's way)
    assert "[eval] the sample's decoder compiled" not in capsys.readouterr().out

    made, streams = [], []

    def counted(*args):
        decoder = ahead(*args)
        stream = decoder.stream
        decoder.stream = lambda *a, **k: streams.append(1) or stream(*a, **k)
        made.append(decoder)
        return decoder

    monkeypatch.setattr(run, "SAMPLER_AHEAD_ON", ("cpu", "gpu"))
    monkeypatch.setattr(evaluate, "sampler_ahead", counted)
    assert main(common + ["--output-dir", str(tmp_path / "ahead")]) == 0
    assert "[eval] the sample's decoder compiled" in capsys.readouterr().out
    assert len(made) == 1 and len(streams) == 2  # pre-flight's decoder sampled at both evals
    assert len(made[0]._compiled) == 1  # at the shape pre-flight compiled: no compile at an eval
    later, early = ((tmp_path / d / "samples.txt").read_text() for d in ("later", "ahead"))
    assert later.count("=== step") == 2 and early == later

