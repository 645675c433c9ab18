"""Tokenizers people bring: BPE, WordLevel and Unigram with and without special tokens, and a Llama-style
tokenizer.json (<s>/</s>, byte fallback). Each packs, evaluates and starts samples with its own tokens, and
one with no end-of-text token packs documents with no separator and says so in one line (issue 14)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from tokenizer_zoo import DOCS, bpe, llama_style, unigram, word_level
from tokenizers import Tokenizer

from slm.data.heldout import build_eval_set
from slm.data.sources import ListSource
from slm.data.stream import StreamingDataLoader
from slm.data.tokenizer import (
    SpecialIds,
    eot_id,
    sample_start,
    special_ids,
    token_byte_lengths,
)
from slm.errors import TokenizerError


def loader_tokens(tok: Tokenizer, **kw) -> tuple[np.ndarray, StreamingDataLoader]:
    loader = StreamingDataLoader(ListSource("docs", DOCS[:20]), tok, seq_len=16, batch_size=2, shuffle_buffer_size=0,
                                 prefetch=0, **kw)
    batches = list(loader)
    assert batches, "no batch"
    rows = [b["input_ids"] for b in batches]
    assert all(r.shape == (2, 16) for r in rows)
    return np.concatenate([r.reshape(-1) for r in rows]), loader


@pytest.mark.parametrize("make, specials, eos, bos", [
    (bpe, [], None, None),
    (bpe, ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"], "[SEP]", None),
    (bpe, ["<|endoftext|>"], "<|endoftext|>", None),
    (word_level, [], None, None),
    (word_level, ["[UNK]", "<eos>"], "<eos>", None),
    (unigram, [], None, None),
    (unigram, ["<unk>", "<s>", "</s>"], "</s>", "<s>"),
    (unigram, ["<unk>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None),
])
def test_each_kind_packs_with_its_own_separator(make, specials, eos, bos, caplog):
    tok = make(specials)
    special = special_ids(tok)
    assert (special.eos, special.bos) == (tok.token_to_id(eos) if eos else None, tok.token_to_id(bos) if bos else None)
    with caplog.at_level(logging.WARNING, logger="slm.data.stream"):
        tokens, _loader = loader_tokens(tok)
    said = [r.getMessage() for r in caplog.records]
    if eos is None:
        assert said == [("[data] no end-of-text token (none of the usual names): documents are packed with no "
                        "separator")]
        with pytest.raises(TokenizerError, match="no end-of-text token"):
            eot_id(tok)
    else:
        assert said == []
        # One separator after each document: the stream's tokens are exactly the wrapped documents.
        expected = [t for d in DOCS[:20] for t in special.lead + tok.encode(d, add_special_tokens=False).ids + special.tail]
        assert tokens.tolist() == expected[: len(tokens)]
        assert int((tokens == special.eos).sum()) >= 2
    if eos is None:
        expected = [t for d in DOCS[:20] for t in tok.encode(d, add_special_tokens=False).ids]
        assert tokens.tolist() == expected[: len(tokens)]
    assert len(sample_start(tok, special)) == 1
    es = build_eval_set(DOCS[20:40], tok, 16, None, "eval")
    assert es.mask.sum() > 0 and es.n_bytes > 0


def test_seed_notebook_example_with_a_plain_bpe_file(tmp_path):
    """The seed guide's own example: Tokenizer.from_file of a plain BPE with no special tokens."""
    path = tmp_path / "tokenizer.json"
    bpe([]).save(str(path))
    tokenizer = Tokenizer.from_file(str(path))
    data = tmp_path / "stories.txt"
    data.write_text("\n\n".join(DOCS * 20))
    loader = StreamingDataLoader(dataset_id=str(data), tokenizer=tokenizer, seq_len=128, batch_size=32,
                                 streaming=True)
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (32, 128) and batch["targets"].shape == (32, 128)


def test_llama_style_tokenizer_packs_bos_doc_eos_and_counts_bytes():
    tok = llama_style()
    assert tok.encode("a b").ids[0] == tok.token_to_id("<s>")  # its post-processor adds <s>...
    special = special_ids(tok)
    s, e = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert (special.bos, special.eos, special.lead, special.tail, special.start) == (s, e, [s], [e], [s])
    tokens, _ = loader_tokens(tok)
    # ... and packing adds it once per document, itself: <s> doc </s> <s> doc </s> ...
    first = tok.encode(DOCS[0], add_special_tokens=False).ids
    assert tokens[: len(first) + 3].tolist() == [s, *first, e, s]
    # Bytes per token are exact for ▁-words and byte-fallback tokens (é is not in the vocab).
    text = "the park ran happy é"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.token_to_id("<0xC3>") in ids
    # Llama's normalizer prepends one ▁ (a space) to the text: one byte more than the text itself.
    assert int(token_byte_lengths(tok)[ids].sum()) == len(text.encode()) + 1
    es = build_eval_set(DOCS[:5], tok, 16, None, "eval")
    assert es.inputs[0, 0] == s  # the first document's own <s>, no extra prefix


def test_tokenizer_config_beside_the_file_wins(tmp_path):
    tok = unigram(["<unk>", "<s>", "</s>", "<|im_end|>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert special_ids(tok, str(path)).eos == tok.token_to_id("</s>")  # by name
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"},
                                                                "bos_token": None}))
    special = special_ids(tok, str(path))
    assert special == SpecialIds(tok.token_to_id("<|im_end|>"), None, "tokenizer_config.json")
    tokens, loader = loader_tokens(str(path))
    assert loader.special == special and int((tokens == special.eos).sum()) >= 2


def test_a_tokenizer_that_cannot_encode_the_data_says_so_in_one_line():
    tok = word_level([])  # no [UNK]: an unseen word cannot be encoded
    loader = StreamingDataLoader(ListSource("d", ["zebras unseen"] * 50), tok, 4, 1, shuffle_buffer_size=0, prefetch=0)
    with pytest.raises(TokenizerError, match=r"cannot encode this data \(.*\); use a tokenizer with an unknown token"):
        next(iter(loader))
