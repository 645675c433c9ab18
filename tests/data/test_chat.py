"""slm.data.chat (issue 33, `generate.py --chat`): a conversation rendered with the published Qwen2.5, Qwen3,
Llama-3.2 and Gemma-3 chat templates (tests/chat_templates) equals transformers' apply_chat_template(
add_generation_prompt=True), as text and as token ids, and each template's end-of-turn token is found."""

from __future__ import annotations

import pathlib

import pytest
import tokenizer_zoo as zoo

from slm.data.chat import ChatTemplate
from slm.data.tokenizer import special_ids
from slm.errors import GenerateError

HERE = pathlib.Path(__file__).resolve().parent.parent / "chat_templates"
# family: (template file, special tokens, tokenizer_config's bos/eos, the end-of-turn token)
FAMILIES = {
    "qwen2.5": ("qwen2.5.jinja", zoo.CHATML, {"eos_token": "<|im_end|>", "bos_token": None}, "<|im_end|>"),
    "qwen3": ("qwen3.jinja", zoo.CHATML, {"eos_token": "<|im_end|>", "bos_token": None}, "<|im_end|>"),
    "llama3.2": ("llama3.2.jinja", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                    "<|end_header_id|>", "<|eot_id|>"],
                 {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"}, "<|eot_id|>"),
    "gemma3": ("gemma3.jinja", ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
               {"eos_token": "<eos>", "bos_token": "<bos>"}, "<end_of_turn>"),
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is a transformer?"}],
    [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "  Hi there!\n"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "And another, héllo 😀?"}],
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(ours, transformers' tokenizer, our tokenizer, end-of-turn token) for one published template."""
    from transformers import PreTrainedTokenizerFast

    file, specials, config, eot = FAMILIES[request.param]
    template = (HERE / file).read_text()
    tok = zoo.byte_level(specials)
    folder = tmp_path_factory.mktemp(request.param)
    path = zoo.save_folder(tok, folder, {**config, "chat_template": template})
    theirs = PreTrainedTokenizerFast(tokenizer_file=path, chat_template=template,
                                     **{k: v for k, v in config.items() if v})
    special = special_ids(tok, path)
    names = {"bos_token": config["bos_token"], "eos_token": config["eos_token"]}
    assert tok.token_to_id(config["eos_token"]) == special.eos
    return ChatTemplate(template, {k: v for k, v in names.items() if v}), theirs, tok, eot


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "turns"])
def test_rendered_prompt_equals_transformers(family, messages):
    ours, theirs, tok, _ = family
    want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render(messages) == want
    ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ours.encode(tok, messages) == list(ids)


def test_end_of_turn_token(family):
    ours, _, tok, eot = family
    assert ours.end_of_turn(tok) == tok.token_to_id(eot)


def test_a_template_that_refuses_the_conversation_is_one_line():
    gemma = ChatTemplate((HERE / "gemma3.jinja").read_text(), {"bos_token": "<bos>"})
    with pytest.raises(GenerateError, match="^--chat: the chat template failed on this conversation "
                                            r"\(Conversation roles must alternate"):
        gemma.render([{"role": "assistant", "content": "I speak first"}])
