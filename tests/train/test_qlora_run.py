"""QLoRA end to end (issue 33): a tiny Llama 3 fine-tuned with LoRA on an NF4 base. Interrupted and resumed, it
equals the uninterrupted run; its merged export is the dequantised base plus the adapters (transformers reads
our logits); its peft adapter loads on the original base; and the plan knows nf4."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from hf_tiny import save_tiny
from stop_after import StopAfter
from tokenizer_zoo import DOCS

from slm.cli.flags import parse_flags
from slm.data.tokenizer import train_bpe
from slm.model.transformer import Transformer
from slm.train.builder import load_run
from train_optimized import Config, main, train

pytestmark = pytest.mark.slow


def _metrics(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}


def test_qlora_resumes_exactly_and_exports_the_dequantised_merge(tmp_path, data_dir, capsys):
    base = tmp_path / "base"
    hf = save_tiny("llama3", base, vocab_size=300, tokenizer=train_bpe(DOCS, 300))
    common = ["--use-streaming", "--init-from", str(base), "--dataset-id", str(data_dir / "tinyshakespeare_train.txt"),
              "--seq-len", "32", "--batch-size", "4", "--eval-tokens", "256", "--lora-rank", "4", "--lora-targets",
              "q_proj,v_proj,down_proj", "--base-dtype", "nf4", "--learning-rate", "3e-3", "--checkpoint-every", "3",
              "--eval-every", "6", "--log-every", "1"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(common + ["--max-steps", "6", "--output-dir", str(whole)]) == 0
    log = capsys.readouterr().out
    assert "base frozen in nf4" in log
    # every weight counted, as transformers counts them (an nf4 leaf holds two a byte: leaf sizes undercount)
    assert f"{sum(p.numel() for p in hf.parameters()) / 1e6:.3f}M parameters loaded from safetensors" in log
    values, explicit, _ = parse_flags(common + ["--max-steps", "6", "--output-dir", str(cut)])
    assert train(Config(**values), explicit=explicit, callbacks=[StopAfter(3)])["steps"] == 3
    assert main(["--resume", str(cut)]) == 0
    want, got = _metrics(whole), _metrics(cut)
    assert sorted(want) == list(range(1, 7)) and got == want  # every step's loss, bit for bit
    a, b = load_run(str(whole), fold_lora=False).adapters, load_run(str(cut), fold_lora=False).adapters
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)

    from export_hf import main as export_main
    from transformers import AutoModelForCausalLM

    assert export_main(["--run", str(whole), "--out", str(tmp_path / "merged")]) == 0
    run = load_run(str(whole))  # the NF4 base dequantised, the adapters folded in
    ids = np.random.default_rng(0).integers(0, 300, (2, 24))
    ours = np.asarray(Transformer(run.shape).apply({"params": run.params}, ids))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    original = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    with torch.no_grad():
        theirs, first = merged(torch.tensor(ids)).logits.numpy(), original(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() < 1e-4
    assert np.abs(theirs - first).max() > 1e-3  # NF4's rounding and the adapters: not the original model

    assert export_main(["--run", str(whole), "--out", str(tmp_path / "adapter"), "--format", "peft"]) == 0
    from peft import PeftModel

    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)).eval(),
                                      str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        on_original = tuned(torch.tensor(ids)).logits.numpy()
    # the adapters on the unquantised base: the merged model up to NF4's rounding of the base
    assert np.abs(on_original - theirs).max() < np.abs(first - theirs).max() + 1e-3

    # generate.py samples from the base as trained (NF4 codes and adapters, no float32 copy): its decoder's
    # logits are the folded, dequantised model's (an independent reference), and the command runs
    from slm.model.decode import decode, init_cache

    held = load_run(str(whole), held_base=True)
    assert any("nf4_codes" in str(p) for p, _ in jax.tree_util.tree_flatten_with_path(held.params)[0])
    prompt = np.asarray([held.special.start + held.tokenizer.encode("ROMEO: to be", add_special_tokens=False).ids])
    got = decode(Transformer(held.shape, lora=held.lora, nf4=True), held.params, prompt,
                 init_cache(held.shape, 1, 64), 0)[0]
    want = decode(Transformer(run.shape), run.params, prompt, init_cache(run.shape, 1, 64), 0)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=0)
    from generate import main as generate_main

    assert generate_main(["--run", str(whole), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0"]) == 0
