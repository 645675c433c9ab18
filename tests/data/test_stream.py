"""slm.data.stream: the streaming loader's batches, order, determinism, memory bound and prefetch thread.

Fast (no jax).
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter

import numpy as np
import pytest
from helpers import collect, rows_of, token_stream

from slm.data.packing import prepare_sequences
from slm.data.sources import ListSource, TextSource, resolve_source
from slm.data.stream import StreamingDataLoader
from slm.errors import DatasetError


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


# -------------------------------------------------------------------------------------------
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
    new = _prefetch_threads() - before
    assert len(new) == 1
    it.close()  # joins the worker: gone when close returns, nothing left to wait for
    for t in new:
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


def test_loader_accepts_path_string(tok, tmp_path, stories):
    p = tmp_path / "s.txt"
    p.write_text("\n<|endoftext|>\n".join(stories[:100]))
    a = collect(StreamingDataLoader(str(p), tok, 32, 4, shuffle_buffer_size=0))
    b = collect(StreamingDataLoader(ListSource("s", stories[:100]), tok, 32, 4, shuffle_buffer_size=0))
    np.testing.assert_array_equal(rows_of(a), rows_of(b))



def test_held_out_head_never_reaches_training_with_shuffled_files(tmp_path, tok):
    """skip_head is applied in natural order, before the file shuffle: the eval slice stays out."""
    from slm.data.sources import LocalFiles

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
