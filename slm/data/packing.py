"""Tokenize and pack: documents -> token ids -> fixed-length rows (the streaming loader and full load share it).

No jax here: numpy + tokenizers only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from slm.data.sources import TextSource
from slm.data.tokenizer import SpecialIds, special_ids
from slm.errors import DatasetError, TokenizerError, first_line


def encode_documents(tokenizer, docs: Sequence[str], special: SpecialIds) -> np.ndarray:
    """Tokenize documents with one `encode_batch` call, each wrapped in the separators `special` gives."""
    try:
        encodings = tokenizer.encode_batch(list(docs), add_special_tokens=False)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception, e.g. an unknown token and no unk
        raise TokenizerError(f"the tokenizer cannot encode this data ({first_line(e, 120)}); use a tokenizer "
                             f"with an unknown token or byte fallback, or --vocab-size N to train one") from None
    lead, tail = special.lead, special.tail
    flat: list[int] = []
    for e in encodings:  # `e.ids` builds a new Python list on every access: read it once
        flat.extend(lead)
        flat.extend(e.ids)
        flat.extend(tail)
    return np.array(flat, dtype=np.int32)


def pack_rows(tokens: np.ndarray, seq_len: int, stride: int, n_rows: int | None = None) -> tuple[np.ndarray, int]:
    """Cut rows of seq_len+1 tokens starting every `stride` tokens; returns (rows, tokens consumed).

    Row r holds tokens[r*stride : r*stride + seq_len + 1]: inputs are row[:-1], targets row[1:].
    With stride == seq_len no token is lost: the last target of a row is the first input of the next.
    """
    available = 0 if len(tokens) < seq_len + 1 else (len(tokens) - seq_len - 1) // stride + 1
    n = available if n_rows is None else min(n_rows, available)
    if n == 0:
        return np.zeros((0, seq_len + 1), np.int32), 0
    windows = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[::stride][:n]
    return np.ascontiguousarray(windows), n * stride


def prepare_sequences(
    source: TextSource,
    tokenizer,
    seq_len: int,
    stride: int | None = None,
    max_examples: int | None = None,
    skip_documents: int = 0,
    chunk_docs: int = 512,
    special: SpecialIds | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The original full-load path: tokenize everything up front into (inputs, targets) arrays.

    Memory grows with the dataset (that is the point of comparing it with StreamingDataLoader).
    """
    special = special or special_ids(tokenizer)
    stride = stride or seq_len
    parts, batch = [], []
    for i, doc in enumerate(source.documents(skip_head=skip_documents)):
        if max_examples is not None and i >= max_examples:
            break
        batch.append(doc)
        if len(batch) >= chunk_docs:
            parts.append(encode_documents(tokenizer, batch, special))
            batch = []
    if batch:
        parts.append(encode_documents(tokenizer, batch, special))
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    rows, _ = pack_rows(tokens, seq_len, stride)
    if len(rows) == 0:
        raise DatasetError(f"{source.name}: too little text for one sequence of {seq_len + 1} tokens")
    return rows[:, :-1].copy(), rows[:, 1:].copy()


def full_load_batches(inputs: np.ndarray, targets: np.ndarray, batch_size: int, seed: int,
                      epoch: int) -> Iterator[dict]:
    """One epoch of the full-load path: rows in a (seed, epoch) permutation, whole batches only."""
    order = np.random.default_rng([seed, epoch]).permutation(len(inputs))
    for i in range(0, len(order) - batch_size + 1, batch_size):
        idx = np.sort(order[i : i + batch_size])
        yield {"input_ids": inputs[idx], "targets": targets[idx]}
