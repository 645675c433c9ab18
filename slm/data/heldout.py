"""The held-out set: the first documents of a stream kept out of training, or a separate source, packed for eval.

Packed with no overlap, every token after the first scored once; the padded tail of the last row is
masked, and so are instruction data's prompt tokens (target -1, as in training). No jax here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from slm.data.instruction import Document, doc_chars
from slm.data.packing import encode_documents, pack_rows, split_rows
from slm.data.sources import TextSource
from slm.data.tokenizer import SpecialIds, special_ids, token_byte_lengths
from slm.errors import DatasetError


def held_out_split(source: TextSource, chars: int) -> tuple[list[Document], bool]:
    """The first documents of the stream totalling >= `chars` characters, and whether any are left after them."""
    docs, total = [], 0
    stream = source.documents()
    for doc in stream:
        docs.append(doc)
        total += doc_chars(doc)
        if total >= chars:
            break
    return docs, next(stream, None) is not None


@dataclass
class EvalSet:
    """Packed held-out rows: inputs/targets (N, L), a mask (0 on the padded tail and on targets -1), the
    bytes of the scored tokens."""

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    n_bytes: int
    name: str


def build_eval_set(docs: Iterable[Document], tokenizer, seq_len: int, max_tokens: int | None, name: str,
                   special: SpecialIds | None = None, chat_template: str | None = None) -> EvalSet:
    """Pack `docs` (at most `max_tokens` tokens when given) into eval rows; bytes for bits/byte. Instruction
    examples are scored on their response tokens only (`chat_template` formats them, as in training)."""
    special = special or special_ids(tokenizer)
    parts, n = [], 0
    batch: list[Document] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == 256:
            parts.append(encode_documents(tokenizer, batch, special, chat_template))
            n += len(parts[-1])
            batch = []
            if max_tokens and n > max_tokens:
                break
    if batch:
        parts.append(encode_documents(tokenizer, batch, special, chat_template))
    if not parts:
        raise DatasetError(f"{name}: the held-out set is empty; pass --eval-dataset-id or more data")
    # Score tokens 1..n (every token after the first, which has no context), packed with no overlap. The
    # first is the separator a document follows in training (eos), or the first document's own bos.
    prefix = [] if special.lead else special.start
    tokens = np.concatenate([prefix, np.concatenate(parts)]).astype(np.int32)
    if max_tokens:
        tokens = tokens[: max_tokens + 1]
    n_targets = len(tokens) - 1
    n_rows = math.ceil(n_targets / seq_len)
    padded = np.zeros(n_rows * seq_len + 1, np.int32)  # the tail past n_targets is masked
    padded[: len(tokens)] = tokens
    rows, _ = pack_rows(padded, seq_len, seq_len)
    inputs, targets = split_rows(rows)
    mask = ((np.arange(n_rows * seq_len) < n_targets).reshape(n_rows, seq_len) & (targets >= 0)).astype(np.float32)
    scored = tokens[1:][tokens[1:] >= 0]  # a prompt token (stored negative) is not scored: its bytes neither
    n_bytes = int(token_byte_lengths(tokenizer)[scored].sum())
    return EvalSet(inputs, targets, mask, n_bytes, name)
