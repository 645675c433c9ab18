"""export_hf --format peft against its real consumer: a LoRA run's adapter folder loaded by
`peft.PeftModel.from_pretrained` on the transformers base gives the merged export's logits (fp32, 1e-4); the same
run written as a merged GGUF (qwen2 or qwen3, f16) gives them within 0.05 through transformers' GGUF reader.
Both for a Qwen2 base and a Qwen3 one (q/k norms, head_dim != hidden / heads).

Needs torch, transformers, peft and gguf (requirements-dev.txt / requirements.txt); export_hf imports none of
torch, transformers or peft."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import ROOT
from hf_tiny import save_tiny
from tokenizer_zoo import DOCS

from slm.cli.export import main as export_main
from slm.data.tokenizer import train_bpe
from slm.train.builder import load_run
from train_optimized import main as train_main

pytestmark = pytest.mark.slow
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # every mapping
VOCAB = 300


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "gemma3"])
def lora_run(request, tmp_path_factory, data_dir):
    """A tiny Qwen2 folder saved by transformers (GQA 4/2, q/k/v biases, tied), a Qwen3 one (q/k norms,
    head_dim 32) or a Gemma 3 one (tests/hf_tiny.py: 3 layers, sliding windows), and a 3-step LoRA run on it with adapters on all seven projections (rank 4, alpha 8: scale
    2), trained hard enough to move the logits."""
    root = tmp_path_factory.mktemp(f"peft-{request.param}")
    save_tiny(request.param, root / "base", vocab_size=VOCAB, tokenizer=train_bpe(DOCS, VOCAB))
    run = root / "run"
    assert train_main(["--use-streaming", "--init-from", str(root / "base"), "--dataset-id",
                       str(data_dir / "tinyshakespeare_train.txt"), "--seq-len", "32", "--batch-size", "4",
                       "--eval-tokens", "128", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets",
                       ",".join(TARGETS), "--learning-rate", "2e-2", "--max-steps", "3", "--eval-every", "3",
                       "--output-dir", str(run)]) == 0
    return root / "base", run, request.param


def _logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys, export_hf; rc = export_hf.main(sys.argv[1:]); "
            "assert not {'torch', 'transformers', 'peft'} & set(sys.modules), 'export imported torch/transformers/peft'; "
            "sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False)


@pytest.mark.xdist_group("lora_run")  # one worker trains the run for both tests
def test_peft_adapter_loads_on_the_base_with_the_merged_logits(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir, run, family = lora_run
    head = 32 if family in ("qwen3", "gemma3") else 16
    layers = 3 if family == "gemma3" else 2
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    proc = _cli("--run", str(run), "--out", str(adapter), "--format", "peft")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PEFT LoRA r=4 alpha=8" in proc.stderr
    assert export_main(["--run", str(run), "--out", str(merged)]) == 0
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8.0)
    assert config["base_model_name_or_path"] == str(base_dir) and config["target_modules"] == list(TARGETS)
    from safetensors.numpy import load_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert len(tensors) == layers * 2 * len(TARGETS)  # A and B per target per layer
    assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (2 * head, 4)  # 2 kv heads
    assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 96)

    load = {"dtype": torch.float32, "attn_implementation": "eager"}
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), **load).eval()
    ids = np.random.default_rng(0).integers(0, VOCAB, (3, 40))
    base_logits = _logits(base, ids)
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    theirs = _logits(peft_model, ids)
    reference = _logits(AutoModelForCausalLM.from_pretrained(str(merged), **load).eval(), ids)
    diff = float(np.abs(theirs - reference).max())
    print(f"peft vs merged export: max |diff| {diff:.2e}; adapters move the logits by "
          f"{np.abs(reference - base_logits).max():.3f}")
    assert diff < 1e-4
    assert np.abs(reference - base_logits).max() > 1e-2  # the adapters matter, so the comparison has teeth

    # load_run(fold_lora=False): the adapters as trained and their spec; the default still folds them
    unfolded = load_run(str(run), fold_lora=False)
    assert unfolded.params is None and unfolded.lora.targets == TARGETS and unfolded.lora.scale == 2.0
    assert set(unfolded.adapters["block_0"]["attn"]) == {f"{t}_lora_{x}" for t in TARGETS[:4] for x in "ab"}
    assert load_run(str(run)).adapters is None


@pytest.mark.xdist_group("lora_run")
def test_lora_run_as_merged_gguf(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    _, run, family = lora_run
    merged, path = tmp_path / "merged", tmp_path / "gguf" / "tiny.gguf"
    assert export_main(["--run", str(run), "--out", str(merged)]) == 0
    if family == "gemma3":  # every 3rd layer global: not llama.cpp's gemma3 (test_gguf_export.py has one that is)
        assert export_main(["--run", str(run), "--out", str(path), "--format", "gguf"]) == 2
        return
    assert export_main(["--run", str(run), "--out", str(path), "--format", "gguf"]) == 0
    if family == "qwen3":  # transformers' GGUF reader ignores qwen3's attention.key_length (llama.cpp reads it),
        import gguf  # so it cannot build a head_dim 32 model: check the file itself

        reader = gguf.GGUFReader(str(path))
        value = lambda key: reader.fields[key].contents()  # noqa: E731
        assert value("general.architecture") == "qwen3" and value("qwen3.attention.key_length") == 32
        tensors = {t.name: tuple(t.shape) for t in reader.tensors}
        assert tensors["blk.1.attn_q_norm.weight"] == (32,) and tensors["blk.1.attn_k_norm.weight"] == (32,)
        return
    gguf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    # q/k/v biases: llama.cpp's qwen2 graph; q/k norms: its qwen3 graph
    assert type(gguf_model).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    ids = np.random.default_rng(1).integers(0, VOCAB, (3, 40))
    reference = _logits(AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval(), ids)
    diff = float(np.abs(_logits(gguf_model, ids) - reference).max())
    print(f"merged LoRA run as GGUF f16 vs merged export: max |diff| {diff:.4f}")
    assert diff <= 0.05


@pytest.mark.xdist_group("small_run")  # the run the other export tests read (trained once per worker)
def test_peft_refuses_a_full_run_in_one_line(small_run, tmp_path, capsys):
    assert export_main(["--run", str(small_run), "--out", str(tmp_path / "a"), "--format", "peft"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a LoRA run" in err, err
    assert not (tmp_path / "a").exists()

