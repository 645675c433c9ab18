"""Tokenize and pack: documents -> token ids -> fixed-length rows (the streaming loader and full load share it).

Instruction examples (slm.data.instruction) are packed like texts, but the tokens that are not trained on
(the bos before an example, its prompt or the chat template's prompt part) are stored as -(id + 1): the
packing carry, its resume state and `pack_rows` stay one int32 array, and `split_rows` turns a row back
into input ids and targets, -1 where the target is not a response token. Plain text is never negative.

No jax here: numpy + tokenizers only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from slm.data.instruction import Document, render_parts
from slm.data.sources import TextSource
from slm.data.tokenizer import SpecialIds, special_ids
from slm.errors import DatasetError, TokenizerError, first_line


def _encode(tokenizer, texts: list[str]) -> list:
    try:
        return tokenizer.encode_batch(texts, add_special_tokens=False)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception, e.g. an unknown token and no unk
        raise TokenizerError(f"the tokenizer cannot encode this data ({first_line(e, 120)}); use a tokenizer "
                             f"with an unknown token or byte fallback, or --vocab-size N to train one") from None


def encode_documents(tokenizer, docs: Sequence[Document], special: SpecialIds,
                     chat_template: str | None = None) -> np.ndarray:
    """Tokenize documents with one `encode_batch` call, each wrapped in the separators `special` gives.
    Examples among them: see `encode_examples`."""
    if any(isinstance(d, tuple) for d in docs):
        return encode_examples(tokenizer, docs, special, chat_template)
    encodings = _encode(tokenizer, list(docs))
    lead, tail = special.lead, special.tail
    flat: list[int] = []
    for e in encodings:  # `e.ids` builds a new Python list on every access: read it once
        flat.extend(lead)
        flat.extend(e.ids)
        flat.extend(tail)
    return np.array(flat, dtype=np.int32)


def encode_examples(tokenizer, docs: Sequence[Document], special: SpecialIds,
                    chat_template: str | None = None) -> np.ndarray:
    """Like encode_documents, an Example as [lead] + prompt + response + [tail] with the lead and prompt
    tokens stored as -(id + 1) (not trained on). The two parts are encoded separately, so the boundary is
    exact and the prompt's tokens are those the model is prompted with. With `chat_template` the parts are
    the template's prompt and response parts (`render_parts`), which often hold bos and eos themselves:
    the lead is added only when the prompt part does not begin with it, the tail only when the response
    part does not hold it (ChatML's "<|im_end|>\n" with eos <|im_end|> gets no second one). The tail eos
    is trained on: the model learns to stop. A text among the examples is trained on whole."""
    name = lambda i: None if i is None else tokenizer.id_to_token(i)
    texts: list[str] = []
    for d in docs:
        if isinstance(d, tuple):
            texts.extend(render_parts(chat_template, d, name(special.bos), name(special.eos)) if chat_template else d)
        else:
            texts.append(d)
    encodings = iter(_encode(tokenizer, texts))
    lead, tail = special.lead, special.tail
    flat: list[int] = []
    masked: list[tuple[int, int]] = []  # [start, end) spans not trained on
    for d in docs:
        if not isinstance(d, tuple):
            flat.extend(lead + next(encodings).ids + tail)
            continue
        prompt, response = next(encodings).ids, next(encodings).ids
        start = len(flat)
        flat.extend(lead if lead and not (chat_template and prompt[:len(lead)] == lead) else [])
        flat.extend(prompt)
        masked.append((start, len(flat)))
        flat.extend(response)
        flat.extend(tail if tail and not (chat_template and tail[0] in response) else [])
    out = np.array(flat, dtype=np.int32)
    for a, b in masked:
        out[a:b] = -1 - out[a:b]
    return out


def split_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(input ids, targets) of packed rows of seq_len + 1 tokens: a target that is not a response token
    (stored as -(id + 1) by encode_examples) is -1, the model's "not scored"."""
    inputs, targets = rows[:, :-1], rows[:, 1:]
    if rows.size and rows.min() < 0:  # instruction data only: the plain path stays as it was
        inputs, targets = np.where(inputs < 0, -1 - inputs, inputs), np.maximum(targets, -1)
    return inputs, targets


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
    chat_template: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The original full-load path: tokenize everything up front into (inputs, targets) arrays (targets
    -1 where instruction data's prompt tokens are, as in the stream's batches).

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
            parts.append(encode_documents(tokenizer, batch, special, chat_template))
            batch = []
    if batch:
        parts.append(encode_documents(tokenizer, batch, special, chat_template))
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    rows, _ = pack_rows(tokens, seq_len, stride)
    if len(rows) == 0:
        raise DatasetError(f"{source.name}: too little text for one sequence of {seq_len + 1} tokens")
    inputs, targets = split_rows(rows)
    return inputs.copy(), targets.copy()


def full_load_batches(inputs: np.ndarray, targets: np.ndarray, batch_size: int, seed: int,
                      epoch: int) -> Iterator[dict]:
    """One epoch of the full-load path: rows in a (seed, epoch) permutation, whole batches only."""
    order = np.random.default_rng([seed, epoch]).permutation(len(inputs))
    for i in range(0, len(order) - batch_size + 1, batch_size):
        idx = np.sort(order[i : i + batch_size])
        yield {"input_ids": inputs[idx], "targets": targets[idx]}
