"""A conversation in a model's chat template, as transformers renders it, and the token that ends a turn.

`render` gives what `tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`
gives: the same jinja2 sandbox and options (slm.data.instruction.compile_template), the same template
variables (messages, tools=None, documents=None, add_generation_prompt and the special tokens), and the
text is then encoded without adding special tokens, as transformers does. No jax here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from slm.data.instruction import compile_template, load_chat_template
from slm.data.tokenizer import SpecialIds
from slm.errors import GenerateError, TokenizerError, first_line

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


@dataclass(frozen=True)
class ChatTemplate:
    template: str
    special_tokens: dict  # bos_token / eos_token names, as transformers passes its special_tokens_map

    def render(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        try:
            return compile_template(self.template).render(messages=messages, tools=None, documents=None,
                                                          add_generation_prompt=add_generation_prompt,
                                                          **self.special_tokens)
        except Exception as e:  # noqa: BLE001 - raise_exception, or any error of the template's own logic
            raise GenerateError(f"--chat: the chat template failed on this conversation ({first_line(e, 120)})") from None

    def encode(self, tokenizer: Any, messages: list[Message]) -> list[int]:
        """The conversation's ids up to the assistant's turn (add_generation_prompt=True)."""
        return tokenizer.encode(self.render(messages), add_special_tokens=False).ids

    def end_of_turn(self, tokenizer: Any) -> int | None:
        """The special token the template writes right after an assistant's message (ChatML's <|im_end|>,
        Llama 3's <|eot_id|>, Gemma's <end_of_turn>), or None when it writes none there."""
        said = "Hello there"
        turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": said}]
        text = self.render(turn, add_generation_prompt=False)
        after = text[text.rfind(said) + len(said):] if said in text else ""
        specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        for i in tokenizer.encode(after, add_special_tokens=False).ids:
            if tokenizer.id_to_token(i) in specials:
                return i
            if tokenizer.decode([i]).strip():  # text before any special token: the template ends turns with text
                return None
        return None


def run_chat_template(run_dir: str, tokenizer: Any, special: SpecialIds) -> ChatTemplate:
    """The chat template saved with a run (its tokenizer_config.json), with the run's bos/eos names."""
    try:
        template = load_chat_template(os.path.join(run_dir, "tokenizer.json"))
    except TokenizerError:
        raise GenerateError(f"--chat: {run_dir} has no chat template (its tokenizer_config.json has none); chat "
                            f"needs a run whose tokenizer came from a chat model (--init-from or --tokenizer)") from None
    name = lambda i: None if i is None else tokenizer.id_to_token(i)  # noqa: E731
    tokens = {k: v for k, v in (("bos_token", name(special.bos)), ("eos_token", name(special.eos))) if v is not None}
    return ChatTemplate(template, tokens)
