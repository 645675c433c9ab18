"""slm.data.packing: encoding documents with end-of-text separators, cutting rows, the full-load path."""

from __future__ import annotations

import numpy as np
from helpers import collect, rows_of, token_stream

from slm.data.packing import encode_documents, pack_rows, prepare_sequences
from slm.data.sources import ListSource
from slm.data.stream import StreamingDataLoader
from slm.data.tokenizer import special_ids


def test_pack_rows_directly():
    tokens = np.arange(20, dtype=np.int32)
    rows, used = pack_rows(tokens, 4, 4)
    assert rows.shape == (4, 5) and used == 16
    np.testing.assert_array_equal(rows[1], [4, 5, 6, 7, 8])
    rows, used = pack_rows(tokens, 4, 2, n_rows=3)
    assert rows.shape == (3, 5) and used == 6
    np.testing.assert_array_equal(rows[2], [4, 5, 6, 7, 8])
    rows, used = pack_rows(tokens[:4], 4, 4)
    assert rows.shape == (0, 5) and used == 0


def test_encode_documents_appends_eot(tok, eot):
    docs = ["Once upon a time.", "", "Café — naïve 🙂"]
    out = encode_documents(tok, docs, special_ids(tok))
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, token_stream(tok, docs, eot))
    assert (out == eot).sum() == 3
    assert encode_documents(tok, [], special_ids(tok)).shape == (0,)


def test_prepare_sequences_matches_streaming_loader(tok, stories):
    L, B = 32, 8
    source = ListSource("s", stories[:150])
    inputs, targets = prepare_sequences(source, tok, L, chunk_docs=37)
    assert inputs.dtype == np.int32 and inputs.shape[1] == L
    np.testing.assert_array_equal(targets[:, :-1], inputs[:, 1:])
    batches = collect(StreamingDataLoader(source, tok, L, B, shuffle_buffer_size=0, chunk_chars=4000))
    rows_in = rows_of(batches)
    rows_tg = np.concatenate([b["targets"] for b in batches])
    assert len(rows_in) == (len(inputs) // B) * B  # streaming drops only the final partial batch
    np.testing.assert_array_equal(rows_in, inputs[: len(rows_in)])
    np.testing.assert_array_equal(rows_tg, targets[: len(rows_in)])
    # prepare_sequences respects skip/max the same way.
    skipped, _ = prepare_sequences(source, tok, L, skip_documents=3, max_examples=10)
    alone, _ = prepare_sequences(ListSource("t", stories[3:13]), tok, L)
    np.testing.assert_array_equal(skipped, alone)


# ----------------------------------------------------------------------------------------------
# Prefetch thread
