"""A run with a tokenizer people bring (issue 14): the seed's plain BPE with no special tokens packs with no
separator and says so (and refuses --document-mask); a Llama-style tokenizer packs <s> doc </s> (and trains
with --document-mask). Each trains, evaluates, samples, and its
run dir generates and exports with the same special tokens."""

from __future__ import annotations

import json

import pytest
from tokenizer_zoo import bpe, llama_style

import slm.cli.export as export
import slm.cli.generate as generate
from train_optimized import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["plain-bpe", "llama-style"])
def test_run_generate_and_export_with_a_brought_tokenizer(kind, tmp_path, data_dir, capsys):
    tok = bpe([]) if kind == "plain-bpe" else llama_style()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    out = tmp_path / "run"
    argv = ["--use-streaming", "--dataset-id", str(data_dir / "tinyshakespeare_train.txt"), "--tokenizer",
            str(path), "--target-params", "100000", "--seq-len", "32", "--batch-size", "4", "--eval-tokens",
            "512", "--max-steps", "2", "--eval-every", "2"]
    if kind == "plain-bpe":  # no separator to find documents by: --document-mask is refused in one line
        assert main(argv + ["--document-mask", "--output-dir", str(tmp_path / "masked")]) == 2
        assert "--document-mask: the tokenizer has no end-of-text or bos token" in capsys.readouterr().err
    code = main(argv + ["--output-dir", str(out)] + (["--document-mask"] if kind == "llama-style" else []))
    log = capsys.readouterr().out
    assert code == 0
    said = [line for line in log.splitlines() if line.startswith("[tokenizer]")]
    saved = json.loads((out / "tokenizer_config.json").read_text())
    if kind == "plain-bpe":
        assert said == [("[tokenizer] no end-of-text token (none of the usual names): documents are packed with "
                         "no separator")]
        assert saved == {"eos_token": None, "bos_token": None}
    else:
        assert said == ["[tokenizer] documents packed as bos '<s>'…eos '</s>' (by name)"]
        assert saved == {"eos_token": "</s>", "bos_token": "<s>"}
        assert json.loads((out / "config.json").read_text())["document_mask"] is True  # documents start at <s>
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_loss"] > 0
    assert (out / "samples.txt").read_text().startswith("=== step 2\n")

    assert generate.main(["--run", str(out), "--prompt", "ROMEO", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO")
    assert export.main(["--run", str(out), "--out", str(tmp_path / "hf")]) == 0
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf_tok = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    if kind == "plain-bpe":
        assert (hf["bos_token_id"], hf["eos_token_id"], hf_tok["eos_token"]) == (None, None, None)
    else:
        assert (hf["bos_token_id"], hf["eos_token_id"]) == (tok.token_to_id("<s>"), tok.token_to_id("</s>"))
        assert (hf_tok["bos_token"], hf_tok["eos_token"]) == ("<s>", "</s>")
