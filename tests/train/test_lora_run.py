"""LoRA fine-tuning end to end (issue 15): a tiny Qwen2-style folder fine-tuned with adapters on a bfloat16 frozen base
(accumulation, 8-bit state, remat), resumed exactly, refused on another base, exported merged for transformers;
and instruction data whose loss is on responses only."""

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
from slm.io.checkpoints import Checkpointer
from slm.model.lora import LoraSpec
from slm.model.sizing import lora_params
from slm.model.transformer import Transformer
from slm.train.builder import load_run
from train_optimized import Config, main, train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen2-tiny")
    save_tiny("qwen2", out, vocab_size=300, tokenizer=train_bpe(DOCS, 300))
    return out


def _adapters(run_dir, step):
    ckpt = Checkpointer(str(run_dir / "checkpoints"), keep=None)
    try:
        import orbax.checkpoint as ocp

        out = ckpt.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        return out["state"]["params"]
    finally:
        ckpt.close()


def test_lora_trains_adapters_resumes_exactly_and_exports_merged(tmp_path, folder, data_dir, capsys):
    common = ["--use-streaming", "--init-from", str(folder), "--dataset-id", str(data_dir / "tinyshakespeare_train.txt"),
              "--seq-len", "32", "--batch-size", "4", "--eval-tokens", "256", "--lora-rank", "4", "--lora-alpha", "8",
              "--lora-dropout", "0.1", "--base-dtype", "bfloat16", "--gradient-accumulation-steps", "2",
              "--use-8bit-optimizer", "--gradient-checkpointing", "--learning-rate", "3e-3", "--eval-every", "4",
              "--checkpoint-every", "2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(common + ["--max-steps", "4", "--output-dir", str(whole)]) == 0
    log = capsys.readouterr().out
    s = json.loads((whole / "summary.json").read_text())
    shape = load_run(str(whole)).shape
    assert s["trainable_params"] == lora_params(shape, 4, ("q_proj", "v_proj")) and s["params"] > 10 * s["trainable_params"]
    assert "[lora] rank 4 on q_proj,v_proj" in log and "base frozen in bfloat16" in log
    assert np.isfinite(s["eval_loss"]) and s["steps"] == 4
    config = json.loads((whole / "config.json").read_text())
    assert len(config["base_fingerprint"]) == 64 and config["trainable_params"] == s["trainable_params"]
    assert config["optimizer"] == "adamw"  # the default for adapters (Muon is for full matrices)

    # exact resume: interrupted after 2 steps, then resumed to 4, gives the same adapters (dropout masks included)
    values, explicit, _ = parse_flags(common + ["--max-steps", "4", "--output-dir", str(cut)])
    assert train(Config(**values), explicit=explicit, callbacks=[StopAfter(2)])["steps"] == 2
    assert main(["--resume", str(cut)]) == 0
    a, b = _adapters(whole, 4), _adapters(cut, 4)
    assert jax.tree.structure(a) == jax.tree.structure(b) and all("lora" in str(p) for p, _ in
                                                                   jax.tree_util.tree_leaves_with_path(a))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert json.loads((cut / "summary.json").read_text())["data_digest"] == s["data_digest"]

    # export: the merged model, which transformers loads with our logits
    out = tmp_path / "merged"
    from export_hf import main as export_main

    assert export_main(["--run", str(whole), "--out", str(out)]) == 0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    run = load_run(str(whole))
    ids = np.random.default_rng(0).integers(0, 300, (2, 24))
    ours = np.asarray(Transformer(run.shape).apply({"params": run.params}, ids))
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() < 1e-4
    # the adapters moved the model away from the base
    base = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        assert np.abs(base(torch.tensor(ids)).logits.numpy() - theirs).max() > 1e-4


def test_lora_resume_refuses_another_base(tmp_path, folder, data_dir, capsys):
    run = tmp_path / "run"
    args = ["--use-streaming", "--init-from", str(folder), "--dataset-id", str(data_dir / "tinyshakespeare_train.txt"),
            "--seq-len", "32", "--batch-size", "4", "--eval-tokens", "256", "--lora-rank", "2", "--max-steps", "1",
            "--output-dir", str(run)]
    assert main(args) == 0
    other = tmp_path / "other"
    save_tiny("qwen2", other, seed=5, vocab_size=300, tokenizer=train_bpe(DOCS, 300))
    config = json.loads((run / "config.json").read_text())
    config["init_from"] = str(other)  # the same path given new weights, as a re-download would
    (run / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["--resume", str(run), "--max-steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not the base these adapters were trained on" in err, err
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()] == ["1"]  # nothing lost


def test_a_bfloat16_checkpoint_is_held_in_bfloat16_with_the_same_losses(tmp_path, data_dir, capsys):
    """The default --base-dtype on a checkpoint stored in bfloat16: held in bf16 under bf16 products, with every
    step's loss and the eval loss bit-equal to the same run holding it in float32 (the reference); under
    float32 products it stays float32 (a bf16 base would add float32 copies)."""
    folder = tmp_path / "bf16"
    save_tiny("llama", folder, vocab_size=300, tokenizer=train_bpe(DOCS, 300), dtype=torch.bfloat16)
    args = ["--use-streaming", "--init-from", str(folder), "--dataset-id", str(data_dir / "tinyshakespeare_train.txt"),
            "--seq-len", "32", "--batch-size", "4", "--eval-tokens", "256", "--lora-rank", "4", "--max-steps", "3",
            "--eval-every", "3", "--log-every", "1"]

    def run(name: str, *flags: str) -> tuple[str, list, str]:
        capsys.readouterr()
        assert main(args + ["--output-dir", str(tmp_path / name), *flags]) == 0
        rows = [json.loads(r) for r in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        held = json.loads((tmp_path / name / "config.json").read_text())["base_dtype"]
        return held, [r.get("loss", r.get("eval_loss")) for r in rows], capsys.readouterr().out

    held, losses, log = run("default", "--matmul-precision", "bfloat16")
    assert held == "bfloat16" and "[defaults] --base-dtype bfloat16: the checkpoint is stored in bfloat16" in log
    assert "base frozen in bfloat16" in log
    reference = run("float32", "--matmul-precision", "bfloat16", "--base-dtype", "float32")
    assert reference[0] == "float32" and len(losses) == 4 and losses == reference[1]
    assert run("f32-products", "--matmul-precision", "float32")[0] == "float32"


def test_lora_on_instruction_data_with_fsdp(tmp_path, folder, capsys):
    rows = [{"q": f"Question {i}: what is {i} plus {i}?", "a": f"It is {2 * i}."} for i in range(200)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sft"
    assert main(["--use-streaming", "--init-from", str(folder), "--dataset-id", str(data), "--prompt-column", "q",
                 "--response-column", "a", "--seq-len", "32", "--batch-size", "4", "--eval-tokens", "256",
                 "--lora-rank", "4", "--lora-targets", "q_proj,k_proj,v_proj,o_proj", "--max-steps", "6",
                 "--learning-rate", "1e-2", "--eval-every", "6", "--sharding", "fsdp", "--cpu-devices", "2",
                 "--output-dir", str(out)]) == 0
    assert "state split (fsdp)" in capsys.readouterr().out
    s = json.loads((out / "summary.json").read_text())
    assert s["trainable_params"] == lora_params(load_run(str(out)).shape, 4, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert np.isfinite(s["eval_loss"])
    spec = LoraSpec(4, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    assert load_run(str(out)).config["lora_targets"] == ",".join(spec.targets)


def test_chat_template_run_and_document_mask_refusal(tmp_path, capsys):
    """Qwen2-Instruct's ChatML template from the folder's tokenizer_config.json formats each example; with
    --document-mask it is refused in one line, since <|im_end|> (the token documents are found by, there being
    no bos) ends the prompt's turns too."""
    import tokenizer_zoo as zoo

    folder = tmp_path / "chatml"
    save_tiny("qwen2", folder, vocab_size=400, tokenizer=zoo.byte_level(zoo.CHATML))
    (folder / "tokenizer_config.json").write_text(json.dumps(zoo.QWEN2_TOKENIZER_CONFIG))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Say {i}.", "output": f"{i}!"}) + "\n" for i in range(300)))
    args = ["--use-streaming", "--init-from", str(folder), "--dataset-id", str(data), "--prompt-column", "instruction",
            "--response-column", "output", "--chat-template", "--seq-len", "32", "--batch-size", "4",
            "--eval-tokens", "128", "--max-steps", "2", "--lora-rank", "2"]
    assert main(args + ["--output-dir", str(tmp_path / "ok")]) == 0
    saved = json.loads((tmp_path / "ok" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == zoo.QWEN2_TEMPLATE  # generate/export find it in the run
    capsys.readouterr()
    assert main(args + ["--document-mask", "--output-dir", str(tmp_path / "masked")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--document-mask with --chat-template" in err and "<|im_end|>" in err, err
