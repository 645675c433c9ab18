"""slm.data.tokenizer: training a byte-level BPE, its end-of-text token, bytes per token, loading files."""

from __future__ import annotations

import pytest

from slm.data.sources import ListSource
from slm.data.stream import StreamingDataLoader
from slm.data.tokenizer import (
    EOT,
    eot_id,
    load_tokenizer,
    token_byte_lengths,
    train_bpe,
)
from slm.errors import TokenizerError


def test_train_bpe_vocab_and_eot(tok):
    assert tok.get_vocab_size() == 512
    assert tok.token_to_id(EOT) == 0
    assert eot_id(tok) == 0
    text = "Once upon a time, there was a little dog."
    assert tok.decode(tok.encode(text).ids) == text
    with pytest.raises(TokenizerError, match="too small"):
        train_bpe(["abc"], vocab_size=100)


def test_token_byte_lengths_sum_to_utf8_bytes(tok):
    lengths = token_byte_lengths(tok)
    assert len(lengths) == tok.get_vocab_size()
    assert lengths[eot_id(tok)] == 1
    for text in ["Café naïve — “quotes” 日本語 🙂 Ünïcödé", "plain ascii text, with punctuation!", "é"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
    assert lengths[1:].min() >= 1


def test_load_tokenizer_errors_name_the_file(tok, tmp_path):
    good = tmp_path / "tok.json"
    tok.save(str(good))
    loaded = load_tokenizer(str(good))
    assert loaded.encode("hello there").ids == tok.encode("hello there").ids
    bad = tmp_path / "corrupt.json"
    bad.write_text('{"this is": not json')
    with pytest.raises(TokenizerError, match="corrupt.json"):
        load_tokenizer(str(bad))
    missing = tmp_path / "missing.json"
    with pytest.raises(TokenizerError, match="missing.json"):
        load_tokenizer(str(missing))
    # A valid tokenizer without an end-of-text token loads (it packs with no separator: test_tokenizer_kinds).
    from tokenizers import Tokenizer, models

    no_eot = tmp_path / "noeot.json"
    Tokenizer(models.BPE()).save(str(no_eot))
    assert load_tokenizer(str(no_eot)).get_vocab_size() == 0
    # The loader takes a path too.
    loader = StreamingDataLoader(ListSource("s", ["a b c"] * 50), str(good), 8, 2, shuffle_buffer_size=0)
    assert next(iter(loader))["input_ids"].shape == (2, 8)
