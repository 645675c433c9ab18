"""Tokenizer helpers on top of Hugging Face `tokenizers`: load, train a byte-level BPE, find the document
separator and start tokens (`SpecialIds`), bytes per token, and incremental detokenization for streamed output.

No jax here: the data layer works for any framework.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from slm.errors import TokenizerError, first_line

EOT = "<|endoftext|>"
# The usual names, most specific first: a tokenizer.json carries no "this is EOS" field of its own.
EOS_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>", "<|eot_id|>", "<|end|>",
             "[SEP]")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[BOS]", "<|startoftext|>")


@dataclass(frozen=True)
class SpecialIds:
    """How documents are packed and samples start, from the tokenizer's own special tokens.

    Each document is packed as [bos] + ids + [eos]: bos only when the tokenizer has one distinct from eos
    (Llama's <s>...</s>), eos when it has one (GPT-2's <|endoftext|>); with neither, documents are
    concatenated with no separator. `found` says where the tokens came from, for the log.
    """

    eos: int | None
    bos: int | None
    found: str

    @property
    def lead(self) -> list[int]:
        """Ids packed before each document: bos, unless it is eos too (GPT-2) or there is none."""
        return [] if self.bos is None or self.bos == self.eos else [self.bos]

    @property
    def tail(self) -> list[int]:
        """Ids packed after each document."""
        return [] if self.eos is None else [self.eos]

    @property
    def start(self) -> list[int]:
        """The ids a sample starts from: what the model saw before a document ([] with no specials)."""
        first = self.bos if self.bos is not None else self.eos
        return [] if first is None else [first]

    def describe(self, tok: Any) -> str:
        if self.eos is None and self.bos is None:
            return f"no end-of-text token ({self.found}): documents are packed with no separator"
        names = [f"{role} {tok.id_to_token(i)!r}" for role, i in (("bos", self.bos), ("eos", self.eos))
                 if i is not None and not (role == "bos" and i == self.eos)]
        return f"documents packed as {'…'.join(names) if len(names) > 1 else names[0]} ({self.found})"


def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer.json; a missing or corrupt file is a TokenizerError naming the file."""
    if not os.path.isfile(path):
        raise TokenizerError(f"--tokenizer {path}: no such file; pass a tokenizer.json or use --vocab-size N")
    try:
        return Tokenizer.from_file(path)
    except (KeyboardInterrupt, SystemExit):
        raise
    # tokenizers raises a bare Exception on bad JSON, and a Rust panic (a BaseException) on some
    # hostile input; an error message may also be empty or span lines: keep it to one line.
    except BaseException as e:
        why = first_line(e, 120)
        raise TokenizerError(
            f"--tokenizer {path}: not a valid tokenizer.json ({why}); pass a tokenizer.json saved by "
            f"`tokenizers` or use --vocab-size N to train one"
        ) from None


def _config_token(value: Any) -> str | None:
    """tokenizer_config.json writes a token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _from_config(tok: Any, tokenizer_path: str | None) -> tuple[int | None, int | None] | None:
    """(eos, bos) named by a tokenizer_config.json beside the tokenizer.json, if there is one."""
    if not tokenizer_path:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(tokenizer_path)), "tokenizer_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or not ({"eos_token", "bos_token"} & cfg.keys()):
        return None
    ids = [tok.token_to_id(t) if (t := _config_token(cfg.get(k))) else None for k in ("eos_token", "bos_token")]
    return ids[0], ids[1]


def special_ids(tok: Any, tokenizer_path: str | None = None) -> SpecialIds:
    """The document separator (eos) and start (bos) tokens: from tokenizer_config.json beside
    `tokenizer_path` when it names them, else by the usual names (special tokens first)."""
    configured = _from_config(tok, tokenizer_path)
    if configured is not None:
        return SpecialIds(*configured, found="tokenizer_config.json")
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}

    def named(names: Sequence[str]) -> int | None:
        present = [n for n in names if tok.token_to_id(n) is not None]
        chosen = next((n for n in present if n in specials), present[0] if present else None)
        return None if chosen is None else tok.token_to_id(chosen)

    eos, bos = named(EOS_NAMES), named(BOS_NAMES)
    return SpecialIds(eos, bos, found="by name" if eos is not None or bos is not None else "none of the usual names")


def sample_start(tok: Any, special: SpecialIds) -> list[int]:
    """A sample's first id: `special.start`, else (no special tokens at all) a newline's token, else id 0."""
    if special.start:
        return special.start
    try:
        return tok.encode("\n", add_special_tokens=False).ids[:1] or [0]
    except Exception:  # noqa: BLE001 - a vocabulary with no newline and no unknown token
        return [0]


def special_config(tok: Any, special: SpecialIds, chat_template: str | None = None) -> dict:
    """A minimal tokenizer_config.json for beside a run's tokenizer.json, so that the run's later readers
    (resume, generate, export) find the same separator (and chat template, when one formatted the data)
    as training did."""
    name = lambda i: None if i is None else tok.id_to_token(i)
    config = {"eos_token": name(special.eos), "bos_token": name(special.bos)}
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def eot_id(tok: Any, source: str = "tokenizer") -> int:
    """Id of the end-of-text token; a TokenizerError for tokenizers without one (see `special_ids`)."""
    eos = special_ids(tok).eos
    if eos is None:
        raise TokenizerError(f"{source}: has no end-of-text token (looked for {', '.join(EOS_NAMES)})")
    return eos


def train_bpe(texts: Iterable[str | tuple[str, ...]], vocab_size: int, max_bytes: int = 8 << 20) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) on the first `max_bytes` of `texts`; id 0 is <|endoftext|>.
    An instruction example (a tuple: prompt, response) counts as its two texts, as they are encoded."""
    if vocab_size < 257:
        raise TokenizerError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least 257")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def limited() -> Iterator[str]:
        seen = 0
        for doc in texts:
            for t in doc if isinstance(doc, tuple) else (doc,):
                yield t
                seen += len(t)
            if seen >= max_bytes:
                return

    tok.train_from_iterator(limited(), trainer=trainer)
    return tok


def _decoder_steps(decoder: Any) -> list[dict]:
    """A tokenizer.json decoder flattened: Sequence decoders hold the steps in `decoders`."""
    if not isinstance(decoder, dict):
        return []
    if decoder.get("type") == "Sequence":
        return [d for step in decoder.get("decoders", []) for d in _decoder_steps(step)]
    return [decoder]


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token (Llama, Mistral)


def token_byte_lengths(tok: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for, used to turn nats/token into bits per byte.

    Exact for byte-level BPE (each character of a token string is one byte), for byte-fallback tokens
    (`<0x0A>` is one byte) and for SentencePiece-style vocabularies (`▁` is a space). Otherwise each
    token is decoded on its own, which drops what the pre-tokenizer dropped (WordLevel's spaces).
    Special tokens count as 1 byte: the end-of-text token stands for the separator between documents.
    """
    vocab = tok.get_vocab(with_added_tokens=True)
    lengths = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    steps = _decoder_steps(json.loads(tok.to_str()).get("decoder"))
    byte_level = any(d.get("type") == "ByteLevel" for d in steps)
    byte_fallback = any(d.get("type") == "ByteFallback" for d in steps)
    metaspace = any(d.get("type") == "Metaspace" or (d.get("type") == "Replace" and
                                                    (d.get("pattern") or {}).get("String") == "\u2581")
                    for d in steps)
    for token, i in vocab.items():
        if token in specials:
            lengths[i] = 1
        elif byte_level:
            lengths[i] = len(token)
        elif byte_fallback and _BYTE_TOKEN.fullmatch(token):
            lengths[i] = 1
        elif metaspace:
            lengths[i] = len(token.replace("\u2581", " ").encode("utf-8"))
        else:
            lengths[i] = len(tok.decode([i], skip_special_tokens=False).encode("utf-8"))
    return lengths


class TextStream:
    """Incremental detokenizer: the text each new token adds, so multi-byte characters split over BPE
    tokens print once complete. Decodes a short window (a few tokens of context + the unprinted ones)
    and holds output back while it ends in an incomplete UTF-8 sequence (U+FFFD)."""

    def __init__(self, tokenizer: Any, context_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.ids = list(context_ids)
        self.read = len(self.ids)  # ids before this are printed (or are the prompt)
        self.prefix = max(0, self.read - 4)  # window start: context for decoders that strip leading spaces

    def _text(self, end: int) -> str:
        return self.tokenizer.decode(self.ids[self.prefix:end])

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before, now = self._text(self.read), self._text(len(self.ids))
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character prints as U+FFFD)."""
        before, now = self._text(self.read), self._text(len(self.ids))
        self.prefix = self.read = len(self.ids)
        return now[len(before):]
