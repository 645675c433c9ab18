"""slm.data.readers: .txt (end-of-text or blank-line documents), .jsonl/.json, .parquet, .csv."""

from __future__ import annotations

import csv
import json

import pytest
from helpers import DATA, read_docs

from slm.data.readers import _read_txt, read_file
from slm.data.tokenizer import EOT
from slm.errors import DatasetError


def test_txt_split_on_endoftext_keeps_newlines(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("first line\nsecond line\n\nthird\n<|endoftext|>\nnext doc\n<|endoftext|>\n\n<|endoftext|>last")
    assert read_docs(p) == ["first line\nsecond line\n\nthird", "next doc", "last"]


def test_txt_split_on_blank_lines(tmp_path):
    p = tmp_path / "b.txt"
    p.write_text("para one\nstill one\n\npara two\n \t\n\n\npara three\r\n\r\nfour\n")
    assert read_docs(p) == ["para one\nstill one", "para two", "para three", "four"]


def test_txt_doc_across_chunk_boundary(tmp_path):
    # A real 1 MB boundary with the default reader...
    filler = ("x" * 99 + "\n<|endoftext|>\n") * ((1 << 20) // 114)
    straddler = "straddling " + "é" * 500 + " end"
    p = tmp_path / "big.txt"
    p.write_text(filler + straddler + "\n<|endoftext|>\ntail")
    start = len((filler).encode())
    assert start < (1 << 20) < start + len(straddler.encode())
    docs = read_docs(p)
    assert docs[-2] == straddler and docs[-1] == "tail"
    assert len(docs) == (1 << 20) // 114 + 2
    # ... and tiny chunks that split the separator, a blank line and multibyte characters everywhere.
    q = tmp_path / "small.txt"
    text = "héllo wörld\n<|endoftext|>\n日本語の文\nline two\n<|endoftext|>\n🙂 emoji doc"
    q.write_text(text)
    want = ["héllo wörld", "日本語の文\nline two", "🙂 emoji doc"]
    for chunk in (1, 2, 3, 5, 7, 13):
        assert list(_read_txt(str(q), chunk_bytes=chunk)) == want
    r = tmp_path / "blank.txt"
    r.write_text("α β\nγ\n\nδ ε\n\n\nζ")
    for chunk in (1, 2, 3, 4, 6):
        assert list(_read_txt(str(r), chunk_bytes=chunk)) == ["α β\nγ", "δ ε", "ζ"]


def test_txt_invalid_utf8_is_replaced(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"good \xff\xfe bytes\n\nsecond \xc3\n<|endoftext|>\nthird")  # \xc3 is a truncated char
    assert read_docs(p) == ["good \ufffd\ufffd bytes\n\nsecond \ufffd", "third"]
    assert list(_read_txt(str(p), chunk_bytes=3)) == read_docs(p)


def test_jsonl_autodetects_text_column(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [{"id": 1, "text": "a\nb"}, {"id": 2, "text": "c"}, {"id": 3, "text": "   "}, {"id": 4, "text": "d"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_docs(p) == ["a\nb", "c", "d"]
    q = tmp_path / "e.jsonl"
    q.write_text('{"n": 1, "story": "s1"}\n{"n": 2, "story": "s2"}\n')
    assert read_docs(q) == ["s1", "s2"]
    r = tmp_path / "only.jsonl"  # no known name, but exactly one string column
    r.write_text('{"n": 1, "words": "w1"}\n')
    assert read_docs(r) == ["w1"]
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([{"content": "x"}, {"content": "y"}]))
    assert read_docs(arr) == ["x", "y"]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"text": "with a byte-order mark"}\n')
    assert read_docs(bom) == ["with a byte-order mark"]


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
    assert read_docs(pq_path) == texts
    csv_path = tmp_path / "t.csv"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "content"])
        for i, t in enumerate(texts):
            w.writerow([i, t])
    assert read_docs(csv_path) == texts
    assert read_docs(csv_path, text_column="content") == texts


@pytest.mark.parametrize("kind", ["string_view", "large_string", "dictionary"])
def test_parquet_text_column_of_any_string_type_is_found(tmp_path, kind):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["one story", "another story"]
    column = {"string_view": pa.array(texts, pa.string_view()), "large_string": pa.array(texts, pa.large_string()),
              "dictionary": pa.array(texts).dictionary_encode()}[kind]
    path = tmp_path / f"{kind}.parquet"
    pq.write_table(pa.table({"n": [1, 2], "body": column}), path, store_schema=True)
    stored = pq.ParquetFile(path).schema_arrow.field("body").type
    assert kind in str(stored)  # the file really carries that type, so detection is what is tested
    assert read_docs(path) == texts  # "body" is not a usual name: found as the only text column


def test_missing_column_lists_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "c.jsonl"
    p.write_text('{"alpha": "x", "beta": "y"}\n')
    with pytest.raises(DatasetError, match=r"cannot tell.*alpha.*beta"):
        read_docs(p)
    with pytest.raises(DatasetError, match=r"--text-column nope.*columns are \['alpha', 'beta'\]"):
        read_docs(p, text_column="nope")
    q = tmp_path / "c.parquet"
    pq.write_table(pa.table({"alpha": ["x"], "gamma": [1]}), q)
    with pytest.raises(DatasetError, match=r"columns are \['alpha', 'gamma'\]"):
        read_docs(q, text_column="nope")


def test_real_tinystories_valid_jsonl_equals_parquet():
    jl = read_docs(DATA / "tinystories_valid.jsonl")
    pq_docs = read_docs(DATA / "tinystories_valid.parquet")
    assert len(jl) == 959
    assert jl == pq_docs
    txt = read_docs(DATA / "tinystories_valid.txt")
    assert [d.strip() for d in txt] == [d.strip() for d in jl]


def test_real_tinystories_train_story_count(stories):
    docs = read_docs(DATA / "tinystories_train.txt")
    assert len(docs) == 1616  # PROVENANCE.md: 1,616 stories separated by <|endoftext|>
    assert docs[: len(stories)] == stories
    assert all(EOT not in d for d in docs)
    assert any("\n" in d for d in docs)  # paragraphs inside a story are kept
