"""generate.py --chat (issue 33): a pretrained Llama 3 with the published Llama-3.2 chat template, loaded with
--max-steps 0, chats: each reply is transformers' greedy generation from apply_chat_template(
add_generation_prompt=True) stopped at <|eot_id|>, the interactive mode keeps the conversation (the second
turn's reply is transformers' for the whole conversation), and misuse is one line."""

from __future__ import annotations

import io
import json
import pathlib

import pytest
import tokenizer_zoo as zoo
import torch
from hf_tiny import save_tiny

import slm.cli.generate as generate
from train_optimized import main

pytestmark = pytest.mark.slow
TEMPLATE = (pathlib.Path(__file__).resolve().parent.parent / "chat_templates" / "llama3.2.jinja").read_text()
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONFIG = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": TEMPLATE}


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, data_dir):
    """(run dir, transformers model, transformers tokenizer) of a tiny Llama 3 evaluated with --max-steps 0."""
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("chat")
    hf = save_tiny("llama3", root / "base", vocab_size=400, tokenizer=zoo.byte_level(LLAMA3))
    (root / "base" / "tokenizer_config.json").write_text(json.dumps(CONFIG))
    assert main(["--use-streaming", "--init-from", str(root / "base"), "--dataset-id",
                 str(data_dir / "tinyshakespeare_train.txt"), "--seq-len", "32", "--batch-size", "4",
                 "--eval-tokens", "256", "--max-steps", "0", "--output-dir", str(root / "run")]) == 0
    tok = PreTrainedTokenizerFast(tokenizer_file=str(root / "base" / "tokenizer.json"), **CONFIG)
    return root / "run", hf, tok


def _theirs(hf, tok, messages: list[dict], n: int) -> str:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    eot = [tok.convert_tokens_to_ids("<|eot_id|>")]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eot, pad_token_id=0)
    new = [t for t in out[0, len(ids):].tolist() if t not in eot]
    return tok.decode(new)


def test_one_turn_is_transformers_reply(chat_run):
    run, hf, tok = chat_run
    out, err = io.StringIO(), io.StringIO()
    generate.run(generate.build_parser().parse_args(["--run", str(run), "--chat", "--prompt", "Hello!",
                                                     "--temperature", "0", "--max-new-tokens", "24"]), out, err)
    assert out.getvalue() == _theirs(hf, tok, [{"role": "user", "content": "Hello!"}], 24) + "\n"
    assert "[generate] step 0 | prefill " in err.getvalue()


def test_interactive_chat_keeps_the_conversation(chat_run):
    run, hf, tok = chat_run
    out, err = io.StringIO(), io.StringIO()
    stdin = io.StringIO("Name a colour.\n\nAnd another?\n/exit\nnever read\n")
    args = ["--run", str(run), "--chat", "--system", "Be brief.", "--temperature", "0", "--max-new-tokens", "16"]
    generate.run(generate.build_parser().parse_args(args), out, err, stdin)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    first = _theirs(hf, tok, messages, 16)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And another?"}]
    second = _theirs(hf, tok, messages, 16)
    assert out.getvalue() == first + "\n" + second + "\n"
    assert err.getvalue().count("> ") == 4 and "(mean of 2 turns)" in err.getvalue()  # the blank line re-asks


def test_a_reply_stops_at_the_end_of_turn_and_joins_the_conversation(chat_run, monkeypatch):
    """The random model above never says <|eot_id|>, so the decoder is scripted here: each turn's reply is
    "Blue." then <|eot_id|> then more; the text stops before <|eot_id|>, and the next turn's prompt is
    transformers' rendering of the conversation with that reply in it."""
    import numpy as np

    from slm.model.generate import Decoder

    run, _, tok = chat_run
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    script = tok.encode("Blue.", add_special_tokens=False) + [eot] + tok.encode(" never", add_special_tokens=False)
    prompts = []

    def scripted(self, params, prompt_ids, max_new_tokens, **kwargs):
        prompts.append(list(prompt_ids))
        kwargs["timings"].update(prefill_s=0.1, decode_s=0.1, prompt_tokens=len(prompt_ids), decode_tokens=1)
        yield from (np.array([t], np.int32) for t in script)

    monkeypatch.setattr(Decoder, "stream", scripted)
    out = io.StringIO()
    args = generate.build_parser().parse_args(["--run", str(run), "--chat"])
    generate.run(args, out, io.StringIO(), io.StringIO("Name a colour.\nAnother?\n"))
    assert out.getvalue() == "Blue.\nBlue.\n"
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                    {"role": "user", "content": "Another?"}]
    assert prompts[1] == tok.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)


@pytest.mark.parametrize("extra, says", [
    (["--system", "x"], "--system: only with --chat"),
    (["--chat", "--num-samples", "2"], "--num-samples with --chat"),
    (["--chat", "--prompt", "hi"], "has no chat template"),
])
def test_chat_misuse_is_one_line(extra, says, small_run, capsys):
    assert generate.main(["--run", str(small_run), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err, err
