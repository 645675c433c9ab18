"""Instruction data: (prompt, response) examples and their formatting, plain or with the tokenizer's chat template.

Sources yield an `Example` instead of a string when given --prompt-column/--response-column
(slm.data.readers.row_pairs). Packing (slm.data.packing.encode_documents) tokenizes each example in two
parts, so that the prompt/response boundary is exact: without a template, the prompt and the response
as they are; with --chat-template, the conversation rendered up to the assistant's turn
(`add_generation_prompt=True`, what a chat model is prompted with) and the rest of the full
conversation's rendering. Only the second part (and the end-of-text after it) is trained on.

The template is rendered with jinja2 in the sandboxed environment and with the options transformers'
`apply_chat_template` uses, so a model's own template formats the data as transformers would (jinja2
is the engine transformers uses: hand-written templating would drift from it). No jax here.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Any, ClassVar, NamedTuple

from slm.errors import DatasetError, TokenizerError, first_line


class Example(NamedTuple):
    """One instruction example: the loss is taken on `response` only."""

    prompt: str
    response: str


Document = str | Example  # what a source yields: a text, or an example when given the pair columns


def doc_chars(doc: Document) -> int:
    """Characters of a document (chunk sizes, the held-out budget)."""
    return len(doc.prompt) + len(doc.response) if isinstance(doc, tuple) else len(doc)


def as_document(item: Any) -> Document:
    """A document back from a loader state: JSON turns an Example into a list."""
    return Example(*item) if isinstance(item, (list, tuple)) else item


def plain_documents(docs: list[Document]) -> list[str | list[str]]:
    """Documents as JSON types (an Example as [prompt, response]), for a checkpoint's loader state."""
    return [list(d) if isinstance(d, tuple) else d for d in docs]


def load_chat_template(tokenizer_path: str | None) -> str:
    """The "chat_template" of the tokenizer_config.json beside `tokenizer_path` (a tokenizer.json or its
    folder), else of a chat_template.jinja there (newer transformers save it so); one line when there is none."""
    if not tokenizer_path:
        raise TokenizerError("--chat-template: needs a tokenizer folder with a tokenizer_config.json (--tokenizer "
                             "or --init-from); a BPE trained on the stream has no chat template")
    folder = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(os.path.abspath(tokenizer_path))
    config = os.path.join(folder, "tokenizer_config.json")
    try:
        with open(config, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except FileNotFoundError:
        template = None
    except (OSError, ValueError, AttributeError) as e:
        raise TokenizerError(f"--chat-template: cannot read {config} ({first_line(e, 120)}); fix the file")
    if isinstance(template, list):  # several named templates (e.g. default and tool_use): the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja = os.path.join(folder, "chat_template.jinja")
    if not isinstance(template, str) and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    if not isinstance(template, str) or not template.strip():
        raise TokenizerError(f"--chat-template: {config} has no \"chat_template\" (nor is there a "
                             f"chat_template.jinja); use a tokenizer of a chat model, or leave --chat-template off")
    return template


def optional_chat_template(tokenizer_path: str) -> str | None:
    """`load_chat_template`, or None when the tokenizer has none (a base model's tokenizer)."""
    try:
        return load_chat_template(tokenizer_path)
    except TokenizerError:
        return None


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> Any:
    """The template compiled as transformers compiles it (sandbox, trim_blocks, lstrip_blocks, loop controls,
    its tojson, raise_exception and strftime_now); a syntax error is one line."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %} (transformers' assistant-mask marker): its body as is."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> list:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # jinja's own escapes HTML characters; transformers' does not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise TokenizerError(f"--chat-template: the chat template does not compile ({first_line(e, 120)})") from None


def render_parts(template: str, example: Example, bos: str | None, eos: str | None) -> tuple[str, str]:
    """(prompt part, response part) of an example in the chat template: the user turn rendered with
    add_generation_prompt=True, and what the full conversation renders after it."""
    compiled = compile_template(template)
    tokens = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    user = {"role": "user", "content": example.prompt}
    try:
        head = compiled.render(messages=[user], add_generation_prompt=True, **tokens)
        full = compiled.render(messages=[user, {"role": "assistant", "content": example.response}],
                               add_generation_prompt=False, **tokens)
    except Exception as e:  # noqa: BLE001 - raise_exception, or any error of the template's own logic
        raise DatasetError(f"--chat-template: the chat template failed on an example ({first_line(e, 120)})") from None
    if not full.startswith(head):  # then no boundary in the text says where the response starts
        raise DatasetError("--chat-template: the template renders the conversation so that it does not begin with "
                           "its prompt (add_generation_prompt=True); the response tokens cannot be found")
    return head, full[len(head):]
