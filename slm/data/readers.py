"""Readers of local files: one document at a time, never a whole file in memory (except a `.json` array).

    .txt              documents separated by `<|endoftext|>` when the file contains it, else by blank
                      lines; newlines inside a document are kept. Memory: one document + one read chunk.
    .jsonl / .json    one JSON object per line (or a JSON array); the text column is auto-detected.
    .parquet / .csv   read in record batches; the text column is auto-detected.

Hostile input: invalid UTF-8 is replaced by U+FFFD (counted per file in `REPLACED_BYTES`, warned once
per file); empty or whitespace-only documents are skipped; anything unreadable (a malformed JSON line,
a missing text column, a corrupt Parquet file, an unreadable file) is a one-line DatasetError naming
the file (and line, for JSON Lines). Given `pair` (--prompt-column, --response-column), the readers of
files with columns yield `Example(prompt, response)` instead of a text (slm.data.instruction).
"""

from __future__ import annotations

import codecs
import csv
import json
import logging
import os
import re
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from slm.data.instruction import Document, Example
from slm.errors import DatasetError, first_line

TEXT_COLUMNS = ("text", "content", "story", "document", "body", "sentence")
LOCAL_EXTENSIONS = (".txt", ".text", ".md", ".jsonl", ".json", ".parquet", ".csv")
EOT_TEXT = "<|endoftext|>"
_BLANK_LINES = re.compile(r"\n[ \t\r]*\n")

_log = logging.getLogger(__name__)
Opener = Callable[..., IO[Any]]  # open(path, mode, **kwargs)

# Invalid UTF-8 bytes replaced by U+FFFD, per file path, in the latest complete read of that file.
# A genuine U+FFFD in the file is not counted: the count comes from the decoder's error handler.
REPLACED_BYTES: dict[str, int] = {}
_warned_replaced: set[str] = set()
_decode_errors = threading.local()  # the handler has no idea which file it decodes: count per thread


def _replace_and_count(e: UnicodeError) -> tuple[str, int]:
    """Like errors="replace" (one U+FFFD per invalid sequence) but counts the invalid bytes."""
    _decode_errors.n = getattr(_decode_errors, "n", 0) + (e.end - e.start)
    return "\ufffd", e.end


_REPLACE = "slm.data.replace_and_count"
codecs.register_error(_REPLACE, _replace_and_count)


def _counting_replacements(path: str, items: Iterator) -> Iterator:
    """Yield from `items` (whose decoding uses _REPLACE), attributing replaced bytes to `path`.

    The count is taken around each next(): decoding happens inside it, on this thread, so readers of
    other files interleaved on the same thread do not mix their counts.
    """
    replaced = 0
    while True:
        before = getattr(_decode_errors, "n", 0)
        try:
            item = next(items)
        except StopIteration:
            break
        finally:
            replaced += getattr(_decode_errors, "n", 0) - before
        yield item
    REPLACED_BYTES[path] = replaced
    if replaced and path not in _warned_replaced:  # once per file, not once per epoch
        _warned_replaced.add(path)
        _log.warning("[data] %s: %d bytes of invalid UTF-8 replaced by U+FFFD", path, replaced)


def pick_text_column(columns: list[str], wanted: str | None, where: str, sample: dict | None = None) -> str:
    if wanted:
        if wanted not in columns:
            raise DatasetError(f"--text-column {wanted}: {where} has no such column; columns are {columns}")
        return wanted
    for c in TEXT_COLUMNS:
        if c in columns:
            return c
    if sample is not None:
        strings = [c for c in columns if isinstance(sample.get(c), str)]
        if len(strings) == 1:
            return strings[0]
    raise DatasetError(f"{where}: cannot tell which column holds the text; pass --text-column, one of {columns}")


def check_pair_columns(columns: list[str], pair: tuple[str, str], where: str) -> None:
    """Both instruction columns are there, else one line naming the missing one and the columns found."""
    for flag, name in zip(("--prompt-column", "--response-column"), pair):
        if name not in columns:
            raise DatasetError(f"{flag} {name}: {where} has no such column; columns are {columns}")


def extension(path: str) -> str:
    """The lower-case extension of a path or URL (a URL's query and fragment left out)."""
    return os.path.splitext(urllib.parse.urlsplit(path).path if "://" in path else path)[1].lower()


def read_file(path: str, text_column: str | None = None, opener: Opener = open,
              pair: tuple[str, str] | None = None) -> Iterator[Document]:
    """The documents of one file; any problem with it is a DatasetError naming it. `opener` opens it like
    `open` (slm.data.remote.open_url for an http(s) URL). With `pair` (prompt and response columns): its
    Examples."""
    ext = extension(path)
    if ext in (".jsonl", ".json"):
        docs = _read_json(path, text_column, opener, pair)
    elif ext == ".parquet":
        docs = _read_parquet(path, text_column, opener, pair)
    elif ext == ".csv":
        docs = _read_csv(path, text_column, opener, pair)
    elif pair:
        raise DatasetError(f"--prompt-column/--response-column: {path} is a text file, with no columns; "
                           f"use a .jsonl/.json/.parquet/.csv file")
    else:
        docs = _read_txt(path, opener=opener)
    return _os_errors_named(path, _counting_replacements(path, docs))


def _os_errors_named(path: str, docs: Iterator[str]) -> Iterator[str]:
    # A file that vanishes or is unreadable mid-run: one line naming it, not a traceback.
    try:
        yield from docs
    except OSError as e:
        raise DatasetError(f"{path}: cannot read it ({e.strerror or type(e).__name__}); check the file and its permissions")


def _file_contains(path: str, needle: bytes, opener: Opener = open, chunk: int = 1 << 20,
                   limit: int | None = None) -> bool:
    """Whether the file (its first `limit` bytes, when given) contains `needle`."""
    with opener(path, "rb") as f:
        tail, seen = b"", 0
        while (limit is None or seen < limit) and (block := f.read(chunk)):
            seen += len(block)
            if needle in tail + block:
                return True
            tail = block[-len(needle) :]
    return False


def _blank_tail(text: str, prev: int) -> int:
    """Length of the end of the pending text that may start a blank-line separator.

    That is a newline followed only by spaces/tabs/CRs up to the end; `text` is the newly appended
    piece and `prev` the previous such length (0 when none).
    """
    j = text.rfind("\n")
    if j < 0:  # no newline in the new piece: the old tail goes on only if the piece is all blank
        return prev + len(text) if prev and not text.strip(" \t\r") else 0
    return len(text) - j if not text[j + 1 :].strip(" \t\r") else 0


MAX_DOC_CHARS = 1 << 22  # a longer document is cut into pieces of at most this (4M characters, ~1M tokens)


def _cut(pending: list[str], tail: int, limit: int) -> tuple[str, str]:
    """A huge pending document split into (a piece to yield, the rest to keep): after the last space in
    the second half of the first `limit` characters (else at `limit`), and never inside the last `tail`
    characters, which may begin a separator. Empties `pending`, so the pieces are not held twice."""
    text = "".join(pending)
    pending.clear()
    end = min(limit, len(text) - tail)
    at = text.rfind(" ", end // 2, end) + 1 or end
    return text[:at], text[at:]


BINARY_HEAD = 1 << 16  # the bytes of a text file looked at for signs of binary data


def binary_reason(head: bytes) -> str | None:
    """Why `head` (a file's first bytes) is not text: NUL bytes, which UTF-8 text never holds, or more than 30% of
    it invalid UTF-8 (a lone bad byte in real text is replaced with a warning instead); None for text."""
    if b"\0" in head:
        return f"NUL bytes in its first {len(head):,} bytes"
    bad = len(head) - len(head.decode("utf-8", errors="ignore").encode("utf-8"))
    if head and bad > 0.3 * len(head) and bad > 16:
        return f"{bad / len(head):.0%} of its first {len(head):,} bytes are not UTF-8"
    return None


def refuse_binary(path: str, opener: Opener = open) -> None:
    """A binary file passed as text (a model, an archive, a file of another encoding) is refused in one line."""
    with opener(path, "rb") as f:
        head = f.read(BINARY_HEAD)
    why = binary_reason(head)
    if why:
        raise DatasetError(f"{path}: binary data, not text ({why}); pass a UTF-8 text file, or .jsonl, .json, "
                           f".parquet or .csv")


def _read_txt(path: str, chunk_bytes: int = 1 << 20, max_doc_chars: int = MAX_DOC_CHARS,
              opener: Opener = open) -> Iterator[str]:
    """Documents of a text file, split on `<|endoftext|>` if the file has one, else on blank lines.

    Invalid UTF-8 is decoded with replacement characters (one U+FFFD per invalid sequence); the
    number of replaced bytes is in REPLACED_BYTES[path] after a full read (see read_file).

    Linear time, memory ~ one document + one chunk, even for a huge document without separators:
    each chunk is scanned once, plus only the short end of the pending document that could begin
    a separator (the last len(EOT)-1 characters, or a trailing newline + blanks, scanned as "\n").
    The result equals splitting the whole file's text at once, except that a document longer than
    `max_doc_chars` comes as several documents (cut at whitespace by `_cut`): memory stays bounded even
    for a 100 MB line, and a separator every ~1M tokens costs nothing a model of any seq-len would see.
    """
    refuse_binary(path, opener)  # its first 64 KB, before any scan: a binary file is refused at once
    # A remote file is not read twice: its first 4 MB decide whether <|endoftext|> separates documents.
    limit = None if opener is open else 4 << 20
    separator = EOT_TEXT if _file_contains(path, EOT_TEXT.encode(), opener, limit=limit) else None
    decoder = codecs.getincrementaldecoder("utf-8")(errors=_REPLACE)
    pending: list[str] = []  # pieces of the document not yet ended by a separator
    pending_len = 0
    tail = 0  # length of the end of `pending` that may begin a separator (see _blank_tail)
    eot_tail = ""  # with a separator: the last len(separator)-1 characters of `pending`, kept as text

    def finish(doc: str) -> Iterator[str]:
        doc = doc.strip("\r\n")
        if doc and not doc.isspace():  # == doc.strip() != "", without copying a huge document
            yield doc

    with opener(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            text = decoder.decode(block, final=not block)
            if separator:
                prefix = eot_tail
                parts = (prefix + text).split(separator)
            else:
                prefix = "\n" if tail else ""  # a newline + blanks scans the same as "\n" alone
                parts = _BLANK_LINES.split(prefix + text)
            if len(parts) == 1:
                pending.append(text)
                pending_len += len(text)
                if separator:
                    eot_tail = (eot_tail + text[-(len(separator) - 1) :])[-(len(separator) - 1) :]
                    tail = len(eot_tail)
                else:
                    tail = _blank_tail(text, tail)
                if pending_len > max_doc_chars + tail:  # the rest keeps the tail: the scan state stays valid
                    piece, rest = _cut(pending, tail, max_doc_chars)
                    pending, pending_len = [rest], len(rest)
                    yield from finish(piece)
                    del piece
            else:
                head = parts[0]
                if len(head) < len(prefix):  # the separator began inside the pending tail
                    first = "".join(pending)[: pending_len - tail + len(head)]
                else:
                    first = "".join(pending) + head[len(prefix) :]
                last = parts[-1]
                pending, pending_len = [last], len(last)
                if separator:
                    eot_tail = last[-(len(separator) - 1) :]
                    tail = len(eot_tail)
                else:
                    tail = _blank_tail(last, 0)
                yield from finish(first)
                del first
                for doc in parts[1:-1]:
                    yield from finish(doc)
            if not block:
                yield from finish("".join(pending))
                return


def row_texts(rows: Iterable, text_column: str | None, where: str) -> Iterator[str]:
    """Non-blank strings of the text column of dict rows; the column is picked on the first row.

    Rows whose text is missing, not a string, or blank are skipped (they are not documents).
    """
    column = None
    for row in rows:
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object per row, got {type(row).__name__}")
        if column is None:
            column = pick_text_column(list(row), text_column, where, row)
        text = row.get(column)
        if isinstance(text, str) and text.strip():
            yield text


def row_pairs(rows: Iterable, pair: tuple[str, str], where: str) -> Iterator[Example]:
    """(prompt, response) Examples of dict rows; the columns are checked on the first row. Rows whose
    prompt or response is not a string, or whose response is blank, are skipped (nothing to learn)."""
    checked = False
    for row in rows:
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object per row, got {type(row).__name__}")
        if not checked:
            check_pair_columns(list(row), pair, where)
            checked = True
        prompt, response = row.get(pair[0]), row.get(pair[1])
        if isinstance(prompt, str) and isinstance(response, str) and response.strip():
            yield Example(prompt, response)


def row_documents(rows: Iterable, text_column: str | None, where: str,
                  pair: tuple[str, str] | None = None) -> Iterator[Document]:
    """Texts of dict rows, or their Examples when given the pair of columns."""
    return row_pairs(rows, pair, where) if pair else row_texts(rows, text_column, where)


def _read_json(path: str, text_column: str | None, opener: Opener = open,
               pair: tuple[str, str] | None = None) -> Iterator[Document]:
    with opener(path, "rb") as f:
        head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    if head[:1] == b"[":  # a JSON array: cannot be streamed with the standard library
        with opener(path, "r", encoding="utf-8-sig", errors=_REPLACE) as f:  # -sig: drop a byte-order mark
            try:
                rows = json.load(f)
            except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, huge ints
                msg = getattr(e, "msg", None) or type(e).__name__
                raise DatasetError(f"{path}: invalid JSON ({msg}); fix the file or convert it to JSON Lines")
        yield from row_documents(rows, text_column, path, pair)
        return
    yield from row_documents(_jsonl_rows(path, opener), text_column, path, pair)


def _jsonl_rows(path: str, opener: Opener = open) -> Iterator:
    with opener(path, "r", encoding="utf-8-sig", errors=_REPLACE) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            # ValueError covers JSONDecodeError and over-long integers; RecursionError deep nesting.
            except (ValueError, RecursionError) as e:
                msg = getattr(e, "msg", None) or type(e).__name__
                raise DatasetError(f"{path}:{lineno}: malformed JSON line ({msg}); fix or remove that line")


def _is_text(t) -> bool:
    """string, large_string, string_view (pyarrow >= 16 and Polars write it), or a dictionary of them."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _read_parquet(path: str, text_column: str | None, opener: Opener = open,
                  pair: tuple[str, str] | None = None) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path if opener is open else opener(path, "rb"))  # remote: ranged reads
    except DatasetError:
        raise
    except Exception as e:
        raise DatasetError(f"{path}: not a readable Parquet file ({first_line(e, 120)})")
    names = pf.schema_arrow.names
    strings = [n for n in names if _is_text(pf.schema_arrow.field(n).type)]
    if pair:
        check_pair_columns(names, pair, path)
    columns = list(pair) if pair else [pick_text_column(names, text_column, path, {n: "" for n in strings})]
    batches = pf.iter_batches(columns=columns, batch_size=1024)
    while True:
        try:  # a truncated or corrupt data page only shows when its batch is read
            batch = next(batches)
        except StopIteration:
            return
        except DatasetError:
            raise
        except Exception as e:
            raise DatasetError(f"{path}: corrupt Parquet data ({first_line(e, 120)}); re-export the file")
        if pair:
            yield from row_pairs(batch.to_pylist(), pair, path)
            continue
        for text in batch.column(0).to_pylist():
            if isinstance(text, str) and text.strip():
                yield text


def _read_csv(path: str, text_column: str | None, opener: Opener = open,
              pair: tuple[str, str] | None = None) -> Iterator[Document]:
    csv.field_size_limit(sys.maxsize)
    with opener(path, "r", encoding="utf-8-sig", errors=_REPLACE, newline="") as f:  # a BOM would rename column 1
        reader = csv.DictReader(f)
        try:
            yield from row_documents(reader, text_column, path, pair)
        except csv.Error as e:
            raise DatasetError(f"{path}:{reader.line_num}: malformed CSV ({e}); fix or remove that line")
