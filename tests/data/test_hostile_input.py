"""Hostile and broken input: a one-line DatasetError/TokenizerError (exit 2 in the CLI) or a documented
skip with a count; never a traceback, a hang, or memory that grows past one document.

Fast and jax-free except the one CLI test; the fuzz is seeded, so a failure reproduces.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import tracemalloc
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

import slm.data.readers as hfl
from slm.data.readers import EOT_TEXT, read_file
from slm.data.sources import local_paths, resolve_source
from slm.data.tokenizer import EOT, load_tokenizer
from slm.errors import DatasetError, TokenizerError


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, repr(msg)
    return msg


def _valid_tokenizer(path: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.add_special_tokens([EOT])
    tok.save(str(path))
    return path


def _reference_txt(data: bytes) -> list[str]:
    """What the .txt reader must return: the whole file decoded and split at once (the old behaviour)."""
    text = data.decode("utf-8", errors="replace")
    parts = text.split(EOT_TEXT) if EOT_TEXT.encode() in data else hfl._BLANK_LINES.split(text)
    return [d.strip("\r\n") for d in parts if d.strip("\r\n").strip()]


# ----------------------------------------------------------------------------------------------
# 1. Tokenizer files


def test_corrupt_or_truncated_tokenizer_json_is_a_one_line_error(tmp_path):
    good = _valid_tokenizer(tmp_path / "tok.json")
    assert load_tokenizer(str(good)).token_to_id(EOT) is not None
    raw = good.read_bytes()
    cases = {
        "half.json": raw[: len(raw) // 2],  # truncated mid-file
        "one-byte.json": raw[:1],
        "empty.json": b"",  # tokenizers' message is empty-ish here: must still be one line
        "binary.json": bytes(range(256)) * 4,
        "wrong-shape.json": b'{"version": "1.0", "model": 42}',
        "array.json": b"[1, 2, 3]",
    }
    for name, data in cases.items():
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(TokenizerError) as info:
            load_tokenizer(str(p))
        msg = _one_line(info.value)
        assert msg.startswith(f"--tokenizer {p}:") and "--vocab-size" in msg, msg


def test_cli_exit_2_for_corrupt_tokenizer_and_unsupported_file(tmp_path, capsys, monkeypatch, data_dir):
    from train_optimized import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bad_tok = tmp_path / "tokenizer.json"
    bad_tok.write_bytes(_valid_tokenizer(tmp_path / "t.json").read_bytes()[:50])
    blob = tmp_path / "data.bin"
    blob.write_bytes(b"\x00\x01binary")
    shakespeare = str(data_dir / "tinyshakespeare.txt")
    for args, needles in [
        (["--dataset-id", shakespeare, "--tokenizer", str(bad_tok)], ["--tokenizer", "tokenizer.json"]),
        (["--dataset-id", str(blob)], ["--dataset-id", "data.bin", ".bin", ".jsonl"]),
    ]:
        code = main([*args, "--output-dir", str(tmp_path / "out"), "--max-steps", "1"])
        err = capsys.readouterr().err.strip()
        assert code == 2, err
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
        for needle in needles:
            assert needle in err, (needle, err)


# ----------------------------------------------------------------------------------------------
# 2. Invalid UTF-8


def test_invalid_utf8_is_replaced_and_counted_once_per_file(tmp_path, caplog):
    p = tmp_path / "bin.txt"
    # 2 + 1 + 3 invalid bytes; a genuine U+FFFD (valid UTF-8) must not count.
    p.write_bytes(b"ok \xff\xfe one\n\nbad \xc3 two \xef\xbf\xbd\n\n\x80\x80\x80 three")
    with caplog.at_level(logging.WARNING, logger="hf_dataset_loader"):
        docs = list(read_file(str(p)))
        assert docs == ["ok \ufffd\ufffd one", "bad \ufffd two \ufffd", "\ufffd\ufffd\ufffd three"]
        assert hfl.REPLACED_BYTES[str(p)] == 6
        assert list(read_file(str(p))) == docs  # a second pass (next epoch): same docs, no new warning
    warnings = [r.getMessage() for r in caplog.records if "invalid UTF-8" in r.getMessage()]
    assert warnings == [f"[data] {p}: 6 bytes of invalid UTF-8 replaced by U+FFFD"]
    clean = tmp_path / "clean.txt"
    clean.write_text("fine \ufffd text")
    assert list(read_file(str(clean))) == ["fine \ufffd text"] and hfl.REPLACED_BYTES[str(clean)] == 0
    # JSON Lines is decoded the same way, and counted too.
    j = tmp_path / "bin.jsonl"
    j.write_bytes(b'{"text": "caf\xe9 au lait"}\n')
    assert list(read_file(str(j))) == ["caf\ufffd au lait"] and hfl.REPLACED_BYTES[str(j)] == 1


# ----------------------------------------------------------------------------------------------
# 3. Malformed rows, missing columns, corrupt files


def test_jsonl_malformed_lines_name_file_and_line(tmp_path):
    ok = '{"text": "fine"}\n'
    for bad in ['{"text": broken', "[" * 100_000, "1" * 5000, '{"text": "unterminated', "\x00\x01"]:
        p = tmp_path / "m.jsonl"
        p.write_text(ok + "\n" + ok + bad + "\n" + ok)  # the blank line 2 still counts as a line
        with pytest.raises(DatasetError) as info:
            list(read_file(str(p)))
        msg = _one_line(info.value)
        assert msg.startswith(f"{p}:4: malformed JSON line"), (bad[:20], msg)
    arr = tmp_path / "a.json"
    arr.write_text('[{"text": "x"}, ')  # a truncated JSON array
    with pytest.raises(DatasetError, match=r"a\.json: invalid JSON"):
        list(read_file(str(arr)))


def test_missing_text_column_names_columns_and_flag(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    j = tmp_path / "rows.jsonl"
    j.write_text('{"id": 1, "score": 2.5}\n')
    q = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": [1], "score": [2.5]}), q)
    for p in (j, q):
        with pytest.raises(DatasetError) as info:
            list(read_file(str(p)))
        msg = _one_line(info.value)
        assert str(p) in msg and "--text-column" in msg and "'id'" in msg and "'score'" in msg, msg
    # A truncated Parquet file is a DatasetError naming it, not a pyarrow traceback.
    pq.write_table(pa.table({"text": ["a story"] * 2000}), q)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(q.read_bytes()[: q.stat().st_size // 2])
    with pytest.raises(DatasetError, match=r"cut\.parquet"):
        list(read_file(str(cut)))


# ----------------------------------------------------------------------------------------------
# 4. Empty documents


def test_empty_documents_are_skipped(tmp_path):
    t = tmp_path / "blank.txt"
    t.write_text("\n\n  \n\t\n\r\n\r\n   ")
    assert list(read_file(str(t))) == []
    e = tmp_path / "eots.txt"
    e.write_text(f"{EOT_TEXT}\n{EOT_TEXT}  \n \n{EOT_TEXT}real{EOT_TEXT}\n")
    assert list(read_file(str(e))) == ["real"]
    j = tmp_path / "empty.jsonl"
    j.write_text('{"text": ""}\n{"text": "   "}\n{"text": null}\n{"other": "x", "text": "kept"}\n{"other": "y"}\n\n')
    assert list(read_file(str(j))) == ["kept"]


# ----------------------------------------------------------------------------------------------
# 5. One huge document: linear, memory ~ one document


def test_huge_single_line_comes_in_pieces_in_bounded_memory(tmp_path):
    """A 40 MB line with no separator: documents of at most MAX_DOC_CHARS, cut at spaces, that join back
    to the line; the reader never holds the whole line (tracemalloc peak independent of its size)."""
    size = 40 << 20
    p = tmp_path / "huge.txt"
    unit = "all work and no play makes jack a dull boy, "  # no newline anywhere
    text = (unit * (size // len(unit) + 1))[:size]
    p.write_text(text)
    tracemalloc.start()
    try:
        lengths, joined = [], hashlib.sha256()
        for doc in read_file(str(p)):
            lengths.append(len(doc))
            joined.update(doc.encode())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(lengths) == size and joined.hexdigest() == hashlib.sha256(text.encode()).hexdigest()
    assert len(lengths) in (10, 11) and max(lengths) <= hfl.MAX_DOC_CHARS
    assert all(n > hfl.MAX_DOC_CHARS - len(unit) for n in lengths[:-1])  # cut at the last space before the cap
    # the joined pending text (<= cap + one 1 MB chunk), the piece cut from it, the previous piece (still
    # held by this loop) and the chunk being decoded: ~4.3 cap-sizes, whatever the line's size (the old
    # reader held the whole line and then a copy of it: 2x the size, 80 MB here).
    assert peak < 5 * hfl.MAX_DOC_CHARS < size / 1.9, peak / hfl.MAX_DOC_CHARS


def test_pieces_of_a_long_document_keep_separators_exact(tmp_path):
    """With a small cap, cutting never eats or invents a separator, in either mode, across chunk sizes."""
    p = tmp_path / "long.txt"
    for text, want in [("x" * 5000 + "\n\n" + "y " * 3000 + "<|endof", ["x" * 5000, "y " * 3000 + "<|endof"]),
                       ("a " * 2000 + EOT_TEXT + "b" * 3000 + EOT_TEXT + "c", ["a " * 2000, "b" * 3000, "c"])]:
        p.write_text(text)
        for chunk in (7, 100, 4096):
            docs = list(hfl._read_txt(str(p), chunk_bytes=chunk, max_doc_chars=700))
            assert max(map(len, docs)) <= 700 + chunk
            assert "".join(docs) == "".join(want), chunk
            # each reference document is a run of consecutive pieces
            i = 0
            for w in want:
                got = ""
                while len(got) < len(w):
                    got += docs[i]
                    i += 1
                assert got == w, chunk
            assert i == len(docs)


class _CountingSplitter:
    """Stands in for the blank-line regex and counts the characters the reader asks it to scan."""

    def __init__(self, pattern: re.Pattern):
        self.pattern, self.scanned = pattern, 0

    def split(self, text: str) -> list[str]:
        self.scanned += len(text)
        return self.pattern.split(text)


def test_huge_document_is_scanned_once_not_quadratically(tmp_path, monkeypatch):
    # Work, not time: the old reader re-split the whole growing document on every chunk
    # (~n^2 / 2 / chunk characters: 16x the file here); a linear one scans each character ~once.
    size, chunk = 2 << 20, 1 << 16
    splitter = _CountingSplitter(hfl._BLANK_LINES)
    monkeypatch.setattr(hfl, "_BLANK_LINES", splitter)
    for name, text in [("words.txt", "x y z\n" * (size // 6)), ("blanks.txt", "start\n" + " " * size)]:
        p = tmp_path / name
        p.write_text(text)
        splitter.scanned = 0
        docs = list(hfl._read_txt(str(p), chunk_bytes=chunk))
        assert docs == [text.strip("\r\n")]  # only newlines are stripped from a document's ends
        assert splitter.scanned <= len(text) + 2 * (len(text) // chunk + 1), (name, splitter.scanned / len(text))
    # The same document split by <|endoftext|>: one document, its exact text.
    e = tmp_path / "eot.txt"
    e.write_text("q" * size + EOT_TEXT + "tail")
    assert [len(d) for d in hfl._read_txt(str(e), chunk_bytes=chunk)] == [size, 4]


def test_chunked_reader_equals_whole_file_split(tmp_path):
    """The incremental scan must give exactly what splitting the whole text at once gives."""
    rng = random.Random(1234)
    pieces = ["a", "é", "日", "🙂", "\n", "\n\n", "\n \n", "\n\t \r\n", " ", "\r\n", EOT_TEXT, "<|endof", "\ufffd"]
    for i in range(150):
        use_eot = i % 2 == 0
        pool = pieces if use_eot else pieces[:-3]
        data = "".join(rng.choice(pool) for _ in range(rng.randrange(0, 60))).encode()
        if rng.random() < 0.2:
            data += b"\xff\xc3"  # a truncated multibyte character at the very end
        p = tmp_path / "r.txt"
        p.write_bytes(data)
        want = _reference_txt(data)
        for chunk in (1, 2, 3, 7, 64):
            assert list(hfl._read_txt(str(p), chunk_bytes=chunk)) == want, (data, chunk)
    # A separator straddling a long run of blanks across many chunks.
    q = tmp_path / "blanks.txt"
    q.write_bytes(b"first\n" + b" \t" * 50_000 + b"\nsecond\n" + b" " * 70_000 + b"x")
    assert list(hfl._read_txt(str(q), chunk_bytes=4096)) == _reference_txt(q.read_bytes())


# ----------------------------------------------------------------------------------------------
# 6. Unsupported extensions


def test_unsupported_extensions_refused_by_file_and_glob_skipped_in_a_directory(tmp_path):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\x00\x01\x02")
    bare = tmp_path / "README"
    bare.write_text("no extension")
    for p in (blob, bare):
        with pytest.raises(DatasetError) as info:
            local_paths(str(p))
        msg = _one_line(info.value)
        assert msg.startswith(f"--dataset-id {p}: unsupported file type") and ".txt" in msg and ".parquet" in msg
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.txt.gz").write_bytes(b"\x1f\x8b")
    logged: list[str] = []
    # A glob names what it reads: one of unsupported type is refused, named, in one line.
    with pytest.raises(DatasetError) as info:
        resolve_source(str(tmp_path / "*"), log=logged.append)
    msg = _one_line(info.value)
    assert "matches 3 file(s) of unsupported type" in msg and str(blob) in msg and "b.txt.gz" in msg
    assert "narrow it to" in msg and ".jsonl" in msg
    with pytest.raises(DatasetError, match="--eval-dataset-id .*weights.bin"):
        resolve_source(str(tmp_path / "*.bin"), flag="--eval-dataset-id", log=logged.append)
    src = resolve_source(str(tmp_path / "*.txt"), log=logged.append)
    assert [Path(p).name for p in src.paths] == ["a.txt"] and list(src.documents()) == ["alpha"] and not logged
    # A directory (a hub snapshot has README.md, .gitattributes) skips them, with a count.
    assert [Path(p).name for p in resolve_source(str(tmp_path), log=logged.append).paths] == ["a.txt"]
    assert len(logged) == 1 and "skipped 3 file(s)" in logged[0] and ".bin" in logged[0] and ".gz" in logged[0]


def test_a_binary_file_named_txt_is_refused_in_one_line_at_any_size(tmp_path):
    """Issue 41: 300 KB of binary gave "holding out --eval-tokens ... leaves nothing to train on", 4 MB trained
    on the bytes. A NUL byte (git's test for binary) or mostly invalid UTF-8 is refused, naming the file;
    a few bad bytes in real text are still replaced, with a warning (above)."""
    rng = random.Random(7)
    for size in (100, 300_000, 4_000_000):
        p = tmp_path / f"model{size}.txt"
        p.write_bytes(bytes(rng.randrange(256) for _ in range(min(size, 70_000))) * max(1, size // 70_000))
        with pytest.raises(DatasetError, match=rf"{p.name}: binary data, not text \((NUL bytes|\d+% of)"):
            list(read_file(str(p)))
    latin = tmp_path / "latin1.txt"  # another encoding, no NUL: most bytes are not UTF-8
    latin.write_bytes(bytes(range(128, 256)) * 100)
    with pytest.raises(DatasetError, match=r"binary data, not text \(100% of its first 12,800 bytes are not UTF-8"):
        list(read_file(str(latin)))


# ----------------------------------------------------------------------------------------------
# 7. Fuzz


def _random_bytes(rng: random.Random, n: int) -> bytes:
    # Mostly structure characters, so JSON lines sometimes parse; plus control bytes and invalid UTF-8 (no NUL:
    # a NUL makes a text file binary, refused whole: test_a_binary_file_named_txt_is_refused_in_one_line_at_any_size).
    alphabet = [b"{", b"}", b"[", b"]", b'"', b":", b",", b"\n", b"\n\n", b" ", b"\x01", b"\xff", b"\xc3",
                b"\xe2\x82", b"text", b"1", b"null", b"\\", b"\\u12", EOT_TEXT.encode(), b'{"text": "x"}\n']
    out = bytearray()
    while len(out) < n:
        out += rng.choice(alphabet) if rng.random() < 0.7 else bytes([rng.randrange(1, 256)])
    return bytes(out[:n])


def test_fuzz_txt_and_jsonl_readers_give_documents_or_dataset_error(tmp_path):
    rng = random.Random(20240601)
    outcomes = {"docs": 0, "error": 0}
    for i in range(200):
        data = _random_bytes(rng, rng.randrange(0, 4097))
        for ext in (".txt", ".jsonl"):
            p = tmp_path / f"f{i}{ext}"
            p.write_bytes(data)
            try:
                docs = list(read_file(str(p)))
            except DatasetError as e:
                _one_line(e)
                assert str(p) in str(e)
                outcomes["error"] += 1
                continue
            assert all(isinstance(d, str) and d.strip() for d in docs), docs
            outcomes["docs"] += 1
            if ext == ".txt":
                assert docs == _reference_txt(data)
    assert outcomes["docs"] >= 200 and outcomes["error"] > 0, outcomes  # both paths were exercised
