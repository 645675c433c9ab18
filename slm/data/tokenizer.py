"""Tokenizer helpers on top of Hugging Face `tokenizers`: load, train a byte-level BPE, EOT id, bytes per token,
and incremental detokenization for streamed output.

No jax here: the data layer works for any framework.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from slm.errors import TokenizerError, first_line

EOT = "<|endoftext|>"
_EOT_CANDIDATES = (EOT, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer.json; a missing or corrupt file is a TokenizerError naming the file."""
    if not os.path.isfile(path):
        raise TokenizerError(f"--tokenizer {path}: no such file; pass a tokenizer.json or use --vocab-size N")
    try:
        tok = Tokenizer.from_file(path)
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
    eot_id(tok, source=path)
    return tok


def eot_id(tok: Tokenizer, source: str = "tokenizer") -> int:
    """Id of the end-of-text token that separates packed documents."""
    for name in _EOT_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise TokenizerError(f"{source}: has no end-of-text token (looked for {', '.join(_EOT_CANDIDATES)})")


def train_bpe(texts: Iterable[str], vocab_size: int, max_bytes: int = 8 << 20) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) on the first `max_bytes` of `texts`; id 0 is <|endoftext|>."""
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
        for t in texts:
            yield t
            seen += len(t)
            if seen >= max_bytes:
                return

    tok.train_from_iterator(limited(), trainer=trainer)
    return tok


def token_byte_lengths(tok: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for, used to turn nats/token into bits per byte.

    Exact for byte-level BPE (each character of a token string is one byte). Otherwise each token is
    decoded on its own, which is exact for byte-fallback vocabularies up to word-boundary spaces.
    Special tokens count as 1 byte: the end-of-text token stands for the separator between documents.
    """
    vocab = tok.get_vocab(with_added_tokens=True)
    lengths = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    byte_level = json.loads(tok.to_str()).get("decoder", {}) or {}
    byte_level = byte_level.get("type") == "ByteLevel"
    for token, i in vocab.items():
        if token in specials:
            lengths[i] = 1
        elif byte_level:
            lengths[i] = len(token)
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
