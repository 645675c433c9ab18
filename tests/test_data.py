"""Data layer: sources and readers, the streaming loader, tokenizer helpers, the memory estimate.

Fast (no jax): a 512-token byte-level BPE is trained once per module on a slice of the real TinyStories text.
"""

from __future__ import annotations

import csv
import itertools
import json
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT))

import hf_dataset_loader as hfl  # noqa: E402
from hf_dataset_loader import (  # noqa: E402
    BUILTIN_DATASET,
    DatasetError,
    ListSource,
    LocalFiles,
    TextSource,
    encode_documents,
    pack_rows,
    prepare_sequences,
    read_file,
    resolve_source,
)
from streaming_data_loader import StreamingDataLoader, estimate_memory_usage  # noqa: E402
from tokenizer_utils import EOT, TokenizerError, eot_id, load_tokenizer, token_byte_lengths, train_bpe  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def stories() -> list[str]:
    path = DATA / "tinystories_train.txt"
    assert path.is_file(), f"shared corpora not found at {DATA}"
    docs = list(itertools.islice(read_file(str(path)), 400))
    assert len(docs) == 400
    return docs


@pytest.fixture(scope="module")
def tok(stories):
    return train_bpe(stories, vocab_size=512)


@pytest.fixture(scope="module")
def eot(tok) -> int:
    return eot_id(tok)


def token_stream(tok, docs, eot) -> np.ndarray:
    """The reference packed stream, built without encode_documents: each doc's ids then EOT."""
    out: list[int] = []
    for d in docs:
        out += tok.encode(d, add_special_tokens=False).ids
        out.append(eot)
    return np.array(out, dtype=np.int32)


def collect(loader, epoch: int | None = None) -> list[dict]:
    it = loader if epoch is None else loader.iter_epoch(epoch)
    return [{k: v.copy() for k, v in b.items()} for b in it]


def rows_of(batches) -> np.ndarray:
    return np.concatenate([b["input_ids"] for b in batches])


def reconstruct(batches) -> np.ndarray:
    """With stride == seq_len the inputs tile the stream; the last target adds its final token."""
    inputs = rows_of(batches).reshape(-1)
    return np.concatenate([inputs, batches[-1]["targets"][-1, -1:]])


def docs_in(stream: np.ndarray, eot: int) -> list[tuple[int, ...]]:
    """The complete EOT-terminated documents in a token stream, as id tuples."""
    docs, cur = [], []
    for t in stream.tolist():
        if t == eot:
            docs.append(tuple(cur))
            cur = []
        else:
            cur.append(t)
    return docs


def distinct_docs(n: int) -> list[str]:
    words = ["cat", "dog", "sun", "tree", "ball", "red", "big", "happy", "park", "mom"]
    return [f"Story {i}: the {words[i % 10]} and the {words[(i * 7) % 10]} went home." for i in range(n)]


# ----------------------------------------------------------------------------------------------
# Streaming loader: shapes, order, determinism


def test_batches_shape_dtype_and_shifted_targets(tok, stories):
    loader = StreamingDataLoader(ListSource("s", stories), tok, seq_len=64, batch_size=8, shuffle_buffer_size=100)
    batches = collect(loader)
    assert len(batches) > 3
    for b in batches:
        assert set(b) == {"input_ids", "targets"}
        for k in ("input_ids", "targets"):
            assert isinstance(b[k], np.ndarray)
            assert b[k].dtype == np.int32
            assert b[k].shape == (8, 64)
        np.testing.assert_array_equal(b["targets"][:, :-1], b["input_ids"][:, 1:])
        assert b["input_ids"].max() < tok.get_vocab_size()
        assert b["input_ids"].min() >= 0
    # Shifted by one *within the packed stream*: a row's last target is the next row's first input.
    rows_in = rows_of(batches)
    rows_tg = np.concatenate([b["targets"] for b in batches])
    np.testing.assert_array_equal(rows_tg[:-1, -1], rows_in[1:, 0])


def test_no_token_lost_or_reordered_without_shuffle(tok, stories, eot):
    L, B = 32, 4
    loader = StreamingDataLoader(
        ListSource("s", stories), tok, seq_len=L, batch_size=B, shuffle_buffer_size=0, stride=L, chunk_chars=5000
    )
    batches = collect(loader)
    expected = token_stream(tok, stories, eot)
    assert loader.tokens_read == len(expected)
    assert loader.documents_read == len(stories)
    n_rows = (len(expected) - L - 1) // L + 1
    n_batches = n_rows // B  # only the final partial batch is dropped
    assert len(batches) == n_batches
    got = reconstruct(batches)
    assert len(got) == n_batches * B * L + 1
    np.testing.assert_array_equal(got, expected[: len(got)])
    assert len(expected) - len(got) < B * L + 1


def test_same_seed_same_batches_different_seed_different_order(tok, stories):
    def run(seed):
        return collect(StreamingDataLoader(ListSource("s", stories), tok, 32, 4, shuffle_buffer_size=64, seed=seed))

    a, b, c = run(1), run(1), run(2)
    assert len(a) == len(b) == len(c)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["input_ids"], y["input_ids"])
        np.testing.assert_array_equal(x["targets"], y["targets"])
    assert not np.array_equal(rows_of(a), rows_of(c))


def test_shuffle_permutes_documents_without_losing_any(tok, eot):
    docs = distinct_docs(300)
    expected = sorted(tuple(tok.encode(d, add_special_tokens=False).ids) for d in docs)
    assert len(set(expected)) == len(docs)

    def docs_seen(buffer):
        # batch 1 x seq_len 2: at most the final EOT is dropped, so every document comes back whole.
        loader = StreamingDataLoader(ListSource("d", docs), tok, 2, 1, shuffle_buffer_size=buffer, seed=3)
        stream = reconstruct(collect(loader))
        if stream[-1] != eot:
            stream = np.append(stream, eot)
        return docs_in(stream, eot), loader

    plain, _ = docs_seen(0)
    shuffled, loader = docs_seen(50)
    assert plain == [tuple(tok.encode(d, add_special_tokens=False).ids) for d in docs]
    assert sorted(shuffled) == expected  # same multiset: nothing lost, nothing repeated
    assert shuffled != plain  # but a different order
    assert loader.max_buffered_documents == 50
    assert loader.documents_read == len(docs)


def test_buffer_memory_bound_does_not_grow_with_dataset(tok, stories):
    L, B, buf, chunk = 32, 4, 40, 2000
    base = stories[:100]

    def run(copies):
        loader = StreamingDataLoader(
            ListSource("m", base * copies), tok, L, B, shuffle_buffer_size=buf, chunk_chars=chunk, prefetch=0
        )
        n = sum(1 for _ in loader)
        return loader, n

    small, n1 = run(1)
    big, n8 = run(8)
    assert n8 > 7 * n1
    for loader in (small, big):
        assert 0 < loader.max_buffered_documents <= buf
    # Carry-over: < one batch of leftover tokens plus one tokenization chunk (byte-level BPE: <= 1 token/byte,
    # plus one EOT per document), whatever the dataset size.
    longest = max(len(d.encode("utf-8")) for d in base)
    bound = B * L + L + 1 + 2 * (chunk + longest)
    assert small.max_carry_tokens <= bound
    assert big.max_carry_tokens <= bound
    assert big.tokens_read > 8 * bound  # the bound is far below the data: it does not scale with it
    assert big.max_carry_tokens < 2 * small.max_carry_tokens


def test_counters_are_per_epoch(tok, stories):
    loader = StreamingDataLoader(ListSource("s", stories[:200]), tok, 32, 4, shuffle_buffer_size=30)
    collect(loader, 0)
    first = (loader.documents_read, loader.tokens_read, loader.max_buffered_documents)
    loader.shuffle_buffer_size = 10
    collect(loader, 1)
    assert loader.documents_read == first[0] == 200
    assert loader.tokens_read == first[1]
    assert first[2] == 30 and loader.max_buffered_documents == 10


def test_stride_overlapping_windows(tok, stories, eot):
    L, B, S = 16, 4, 5
    loader = StreamingDataLoader(ListSource("s", stories[:60]), tok, L, B, shuffle_buffer_size=0, stride=S,
                                 chunk_chars=3000)
    batches = collect(loader)
    ins = rows_of(batches)
    tgs = np.concatenate([b["targets"] for b in batches])
    # Row r holds stream[r*S : r*S + L + 1], as pack_rows documents.
    stream = token_stream(tok, stories[:60], eot)
    for r in range(len(ins)):
        np.testing.assert_array_equal(ins[r], stream[r * S : r * S + L])
        np.testing.assert_array_equal(tgs[r], stream[r * S + 1 : r * S + L + 1])
    np.testing.assert_array_equal(ins[1:, : L - S], ins[:-1, S:])  # consecutive windows overlap by L - S
    n_rows = (len(stream) - L - 1) // S + 1
    assert len(ins) == (n_rows // B) * B


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
    out = encode_documents(tok, docs, eot)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, token_stream(tok, docs, eot))
    assert (out == eot).sum() == 3
    assert encode_documents(tok, [], eot).shape == (0,)


def test_skip_documents_and_max_examples(tok, stories, eot):
    L, B = 16, 2
    loader = StreamingDataLoader(ListSource("s", stories), tok, L, B, shuffle_buffer_size=0, skip_documents=5,
                                 max_examples=20)
    batches = collect(loader)
    assert loader.documents_read == 20
    expected = token_stream(tok, stories[5:25], eot)
    assert loader.tokens_read == len(expected)
    got = reconstruct(batches)
    np.testing.assert_array_equal(got, expected[: len(got)])
    # Without the skip the stream starts elsewhere.
    assert not np.array_equal(got[:50], token_stream(tok, stories[:20], eot)[:50])


def test_iter_epoch_reshuffles_per_epoch(tok, stories):
    loader = StreamingDataLoader(ListSource("s", stories[:200]), tok, 32, 4, shuffle_buffer_size=64, seed=5)
    e0a, e1, e0b = rows_of(collect(loader, 0)), rows_of(collect(loader, 1)), rows_of(collect(loader, 0))
    np.testing.assert_array_equal(e0a, e0b)
    assert e0a.shape == e1.shape
    assert not np.array_equal(e0a, e1)
    # Same tokens overall (only the document order changed): counts agree up to the dropped final partial
    # batch, which is under one batch of tokens per epoch.
    c0, c1 = Counter(e0a.ravel().tolist()), Counter(e1.ravel().tolist())
    assert sum(((c0 - c1) + (c1 - c0)).values()) <= 2 * 4 * 33


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


class _FailingSource(TextSource):
    def __init__(self, docs, fail_after):
        super().__init__("failing")
        self.docs, self.fail_after = docs, fail_after

    def documents(self, shuffle_seed=None, skip_head=0):
        for i, d in enumerate(itertools.cycle(self.docs)):
            if i == self.fail_after:
                raise RuntimeError("boom from the source")
            yield d


class _EndlessSource(TextSource):
    def __init__(self, docs):
        super().__init__("endless")
        self.docs, self.closed, self.served = docs, threading.Event(), 0

    def documents(self, shuffle_seed=None, skip_head=0):
        try:
            for d in itertools.cycle(self.docs):
                self.served += 1
                yield d
        finally:
            self.closed.set()


def _prefetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "data-prefetch"}


def test_source_exception_propagates_to_consumer(tok, stories):
    loader = StreamingDataLoader(_FailingSource(stories[:50], fail_after=300), tok, 16, 2, shuffle_buffer_size=0,
                                 chunk_chars=500, prefetch=2)
    seen = 0
    with pytest.raises(RuntimeError, match="boom from the source"):
        for _ in loader:
            seen += 1
    assert seen > 0  # it failed mid-epoch, after good batches went through


def test_source_exception_before_first_batch_propagates(tok, stories):
    loader = StreamingDataLoader(_FailingSource(stories, fail_after=3), tok, 16, 2, prefetch=2)
    with pytest.raises(RuntimeError, match="boom"):
        next(iter(loader))


def test_breaking_out_early_stops_the_prefetch_thread(tok, stories):
    before = _prefetch_threads()
    source = _EndlessSource(stories[:30])
    loader = StreamingDataLoader(source, tok, 16, 2, shuffle_buffer_size=0, chunk_chars=500, prefetch=2)
    for i, _ in enumerate(loader):  # an endless epoch: only stopping the worker can end it
        if i == 5:
            break
    new = _prefetch_threads() - before
    for t in new:
        t.join(timeout=30)  # a safety net against a hang, not a timing check
        assert not t.is_alive(), "prefetch thread still running after the consumer left"
    assert source.closed.is_set()  # the source generator was closed, releasing its resources
    # An explicitly closed iterator stops too.
    before = _prefetch_threads()
    it = loader.iter_epoch(1)
    next(it)
    it.close()
    for t in _prefetch_threads() - before:
        t.join(timeout=30)
        assert not t.is_alive()


def test_leaving_when_the_queue_is_full_at_the_end_does_not_strand_the_thread(tok, eot):
    # Exactly 3 batches with prefetch=2: the consumer takes one, the worker fills the queue with the other two
    # and then has only the end marker left to queue. Leaving at that moment must still stop the worker.
    docs = distinct_docs(6)
    total = len(token_stream(tok, docs, eot))
    L = -(-total // 4)
    assert 3 * L + 1 <= total <= 4 * L  # -> (total - L - 1) // L + 1 == 3 rows, one per batch
    loader = StreamingDataLoader(ListSource("d", docs), tok, L, 1, shuffle_buffer_size=0, prefetch=2)
    produced_all = threading.Event()
    original = loader._batches

    def batches(epoch):
        yield from original(epoch)
        produced_all.set()  # the worker asks for another item only after queueing the previous one

    loader._batches = batches
    before = _prefetch_threads()
    it = iter(loader)
    next(it)
    assert produced_all.wait(timeout=30)
    it.close()
    new = _prefetch_threads() - before
    assert len(new) == 1
    for t in new:
        t.join(timeout=30)
        assert not t.is_alive(), "prefetch thread stuck queueing the end marker"


# ----------------------------------------------------------------------------------------------
# Errors from the loader


def test_dataset_smaller_than_one_batch(tok, stories):
    loader = StreamingDataLoader(ListSource("tiny", stories[:2]), tok, 128, 32)
    with pytest.raises(DatasetError, match="smaller than one batch"):
        list(loader)
    with pytest.raises(DatasetError, match="too little text"):
        prepare_sequences(ListSource("tiny", ["hi"]), tok, 128)


def test_bad_seq_len_and_stride(tok, stories):
    src = ListSource("s", stories)
    with pytest.raises(DatasetError, match="seq-len"):
        StreamingDataLoader(src, tok, seq_len=1)
    with pytest.raises(DatasetError, match="stride"):
        StreamingDataLoader(src, tok, seq_len=16, stride=17)
    with pytest.raises(DatasetError, match="stride"):
        StreamingDataLoader(src, tok, seq_len=16, stride=0)
    with pytest.raises(DatasetError, match="batch-size"):
        StreamingDataLoader(src, tok, seq_len=16, batch_size=0)
    with pytest.raises(ValueError, match="tokenizer"):
        StreamingDataLoader(src, None)


# ----------------------------------------------------------------------------------------------
# Readers


def _docs(path, **kw) -> list[str]:
    return list(read_file(str(path), **kw))


def test_txt_split_on_endoftext_keeps_newlines(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("first line\nsecond line\n\nthird\n<|endoftext|>\nnext doc\n<|endoftext|>\n\n<|endoftext|>last")
    assert _docs(p) == ["first line\nsecond line\n\nthird", "next doc", "last"]


def test_txt_split_on_blank_lines(tmp_path):
    p = tmp_path / "b.txt"
    p.write_text("para one\nstill one\n\npara two\n \t\n\n\npara three\r\n\r\nfour\n")
    assert _docs(p) == ["para one\nstill one", "para two", "para three", "four"]


def test_txt_doc_across_chunk_boundary(tmp_path):
    # A real 1 MB boundary with the default reader...
    filler = ("x" * 99 + "\n<|endoftext|>\n") * ((1 << 20) // 114)
    straddler = "straddling " + "é" * 500 + " end"
    p = tmp_path / "big.txt"
    p.write_text(filler + straddler + "\n<|endoftext|>\ntail")
    start = len((filler).encode())
    assert start < (1 << 20) < start + len(straddler.encode())
    docs = _docs(p)
    assert docs[-2] == straddler and docs[-1] == "tail"
    assert len(docs) == (1 << 20) // 114 + 2
    # ... and tiny chunks that split the separator, a blank line and multibyte characters everywhere.
    q = tmp_path / "small.txt"
    text = "héllo wörld\n<|endoftext|>\n日本語の文\nline two\n<|endoftext|>\n🙂 emoji doc"
    q.write_text(text)
    want = ["héllo wörld", "日本語の文\nline two", "🙂 emoji doc"]
    for chunk in (1, 2, 3, 5, 7, 13):
        assert list(hfl._read_txt(str(q), chunk_bytes=chunk)) == want
    r = tmp_path / "blank.txt"
    r.write_text("α β\nγ\n\nδ ε\n\n\nζ")
    for chunk in (1, 2, 3, 4, 6):
        assert list(hfl._read_txt(str(r), chunk_bytes=chunk)) == ["α β\nγ", "δ ε", "ζ"]


def test_txt_invalid_utf8_is_replaced(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"good \xff\xfe bytes\n\nsecond \xc3\n<|endoftext|>\nthird")  # \xc3 is a truncated char
    assert _docs(p) == ["good \ufffd\ufffd bytes\n\nsecond \ufffd", "third"]
    assert list(hfl._read_txt(str(p), chunk_bytes=3)) == _docs(p)


def test_jsonl_autodetects_text_column(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [{"id": 1, "text": "a\nb"}, {"id": 2, "text": "c"}, {"id": 3, "text": "   "}, {"id": 4, "text": "d"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert _docs(p) == ["a\nb", "c", "d"]
    q = tmp_path / "e.jsonl"
    q.write_text('{"n": 1, "story": "s1"}\n{"n": 2, "story": "s2"}\n')
    assert _docs(q) == ["s1", "s2"]
    r = tmp_path / "only.jsonl"  # no known name, but exactly one string column
    r.write_text('{"n": 1, "words": "w1"}\n')
    assert _docs(r) == ["w1"]
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([{"content": "x"}, {"content": "y"}]))
    assert _docs(arr) == ["x", "y"]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"text": "with a byte-order mark"}\n')
    assert _docs(bom) == ["with a byte-order mark"]


def test_jsonl_malformed_line_names_line_number(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "ok too"}\n{"text": broken\n')
    it = read_file(str(p))
    assert next(it) == "ok"
    with pytest.raises(DatasetError, match=r"m\.jsonl:3: malformed JSON"):
        list(it)


def test_parquet_and_csv(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["first, with comma", "second\nwith newline", "third \"quoted\""]
    pq_path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "body": texts}), pq_path)
    assert _docs(pq_path) == texts
    csv_path = tmp_path / "t.csv"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "content"])
        for i, t in enumerate(texts):
            w.writerow([i, t])
    assert _docs(csv_path) == texts
    assert _docs(csv_path, text_column="content") == texts


def test_missing_column_lists_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "c.jsonl"
    p.write_text('{"alpha": "x", "beta": "y"}\n')
    with pytest.raises(DatasetError, match=r"cannot tell.*alpha.*beta"):
        _docs(p)
    with pytest.raises(DatasetError, match=r"--text-column nope.*columns are \['alpha', 'beta'\]"):
        _docs(p, text_column="nope")
    q = tmp_path / "c.parquet"
    pq.write_table(pa.table({"alpha": ["x"], "gamma": [1]}), q)
    with pytest.raises(DatasetError, match=r"columns are \['alpha', 'gamma'\]"):
        _docs(q, text_column="nope")


def test_directory_and_glob_sources(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("b1\n\nb2")
    (d / "a.jsonl").write_text('{"text": "a1"}\n')
    (d / "sub" / "c.txt").write_text("c1")
    (d / "ignored.bin").write_bytes(b"\x00\x01")
    src = resolve_source(str(d))
    assert isinstance(src, LocalFiles)
    assert [Path(p).name for p in src.paths] == ["a.jsonl", "b.txt", "c.txt"]
    assert list(src.documents()) == ["a1", "b1", "b2", "c1"]
    assert src.size_bytes == sum(Path(p).stat().st_size for p in src.paths)
    g = resolve_source(str(d / "*.txt"))
    assert list(g.documents()) == ["b1", "b2"]
    # A shuffle seed only permutes files, deterministically, and loses none.
    assert sorted(src.documents(shuffle_seed=1)) == ["a1", "b1", "b2", "c1"]
    assert list(src.documents(shuffle_seed=1)) == list(src.documents(shuffle_seed=1))
    with pytest.raises(DatasetError, match="matches no files"):
        resolve_source(str(d / "*.nothing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="directory has no"):
        resolve_source(str(empty))


def test_missing_path(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        resolve_source(str(tmp_path / "nope.txt"))
    with pytest.raises(DatasetError, match="no such file"):
        resolve_source("./does/not/exist")


def test_real_tinystories_valid_jsonl_equals_parquet():
    jl = _docs(DATA / "tinystories_valid.jsonl")
    pq_docs = _docs(DATA / "tinystories_valid.parquet")
    assert len(jl) == 959
    assert jl == pq_docs
    txt = _docs(DATA / "tinystories_valid.txt")
    assert [d.strip() for d in txt] == [d.strip() for d in jl]


def test_real_tinystories_train_story_count(stories):
    docs = _docs(DATA / "tinystories_train.txt")
    assert len(docs) == 1616  # PROVENANCE.md: 1,616 stories separated by <|endoftext|>
    assert docs[: len(stories)] == stories
    assert all(EOT not in d for d in docs)
    assert any("\n" in d for d in docs)  # paragraphs inside a story are kept


# ----------------------------------------------------------------------------------------------
# resolve_source and the hub


def test_resolve_source_offline_falls_back_to_builtin(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = resolve_source(None)
    assert isinstance(src, ListSource)
    assert src.name == BUILTIN_DATASET
    assert src.size_bytes > 1 << 20
    assert len(src.docs) > 100
    out = capsys.readouterr().out
    assert "hub" in out and "built-in" in out
    with pytest.raises(DatasetError, match=r"someone/some-dataset.*hub"):
        resolve_source("someone/some-dataset")
    with pytest.raises(DatasetError, match="hub id"):
        resolve_source("not a valid id!")
    assert resolve_source(BUILTIN_DATASET).name == BUILTIN_DATASET


def test_loader_accepts_path_string(tok, tmp_path, stories):
    p = tmp_path / "s.txt"
    p.write_text("\n<|endoftext|>\n".join(stories[:100]))
    a = collect(StreamingDataLoader(str(p), tok, 32, 4, shuffle_buffer_size=0))
    b = collect(StreamingDataLoader(ListSource("s", stories[:100]), tok, 32, 4, shuffle_buffer_size=0))
    np.testing.assert_array_equal(rows_of(a), rows_of(b))


# ----------------------------------------------------------------------------------------------
# tokenizer_utils


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
    # A valid tokenizer without an end-of-text token is rejected too, naming the file.
    from tokenizers import Tokenizer, models

    no_eot = tmp_path / "noeot.json"
    Tokenizer(models.BPE()).save(str(no_eot))
    with pytest.raises(TokenizerError, match="noeot.json"):
        load_tokenizer(str(no_eot))
    # The loader takes a path too.
    loader = StreamingDataLoader(ListSource("s", ["a b c"] * 50), str(good), 8, 2, shuffle_buffer_size=0)
    assert next(iter(loader))["input_ids"].shape == (2, 8)


# ----------------------------------------------------------------------------------------------
# Memory estimate


def test_estimate_memory_usage():
    est = estimate_memory_usage(num_sequences=100000, seq_len=128, batch_size=32)
    assert {"full_load_mb", "streaming_mb", "memory_savings"} <= set(est)
    assert est["full_load_mb"] == round(100000 * 128 * 2 * 4 / 2**20, 3) == 97.656
    assert est["streaming_mb"] < est["full_load_mb"]
    assert est["memory_savings"].endswith("%")
    assert float(est["memory_savings"][:-1]) == pytest.approx(100 * (1 - est["streaming_mb"] / est["full_load_mb"]),
                                                               abs=0.01)
    big = estimate_memory_usage(num_sequences=1_000_000, seq_len=128, batch_size=32)
    assert big["full_load_mb"] == round(1_000_000 * 128 * 8 / 2**20, 3)
    assert big["full_load_mb"] == pytest.approx(10 * est["full_load_mb"], abs=0.01)  # linear in num_sequences
    assert big["streaming_mb"] == est["streaming_mb"]
    assert float(big["memory_savings"][:-1]) > float(est["memory_savings"][:-1])
    no_buffer = estimate_memory_usage(100000, 128, 32, shuffle_buffer_size=0)
    assert no_buffer["streaming_mb"] < est["streaming_mb"]


def test_held_out_head_never_reaches_training_with_shuffled_files(tmp_path, tok):
    """skip_head is applied in natural order, before the file shuffle: the eval slice stays out."""
    from hf_dataset_loader import LocalFiles

    for name in "abcd":
        (tmp_path / f"{name}.txt").write_text("\n\n".join(f"doc {name}{i} words" for i in range(20)))
    src = resolve_source(str(tmp_path))
    assert isinstance(src, LocalFiles)
    head = [d for _, d in zip(range(27), src.documents())]  # spans a.txt and part of b.txt
    assert head[-1] == "doc b6 words"
    for seed in range(3):
        trained = list(src.documents(shuffle_seed=seed, skip_head=27))
        assert not set(head) & set(trained)
        assert len(trained) == 80 - 27
    loader = StreamingDataLoader(src, tok, seq_len=4, batch_size=1, shuffle_buffer_size=8, skip_documents=27,
                                 prefetch=0)
    for epoch in range(3):
        text = "".join(tok.decode(b["input_ids"][0].tolist()) for b in loader.iter_epoch(epoch))
        assert "b6 " not in text and "a0 " not in text and "b7 " in text
