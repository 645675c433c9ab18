"""Dataset sources (Hugging Face hub, local files, a built-in offline corpus) and the original full-load path.

A source is anything with `documents(shuffle_seed=None, skip_head=0) -> Iterator[str]`: one pass over the
documents, leaving out the first `skip_head` of them in the source's natural (unshuffled) order, which is
how the trainer holds out an eval slice that shuffling can never bring back into training.
Local files are read incrementally (never whole into memory, except a `.json` array file), so the
streaming loader's memory does not grow with the dataset.

    .txt              documents separated by `<|endoftext|>` when the file contains it, else by blank
                      lines; newlines inside a document are kept. Memory: one document + one read chunk.
    .jsonl / .json    one JSON object per line (or a JSON array); the text column is auto-detected.
    .parquet / .csv   read in record batches; the text column is auto-detected.
    directory / glob  every supported file in it, in sorted order; files of other types are skipped,
                      with a count. A file named on its own must have one of LOCAL_EXTENSIONS.

Hostile input: invalid UTF-8 is replaced by U+FFFD (counted per file in `REPLACED_BYTES`, warned once
per file); empty or whitespace-only documents are skipped; anything unreadable (a malformed JSON line,
a missing text column, a corrupt Parquet file, an unreadable file) is a one-line DatasetError naming
the file (and line, for JSON Lines).

No jax here: numpy + tokenizers + datasets only.
"""

from __future__ import annotations

import ast
import codecs
import csv
import glob
import itertools
import json
import logging
import os
import random
import re
import sys
import threading
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

TEXT_COLUMNS = ("text", "content", "story", "document", "body", "sentence")
LOCAL_EXTENSIONS = (".txt", ".text", ".md", ".jsonl", ".json", ".parquet", ".csv")
DEFAULT_DATASET = "roneneldan/TinyStories"
BUILTIN_DATASET = "builtin:python-docs"
EOT_TEXT = "<|endoftext|>"
_BLANK_LINES = re.compile(r"\n[ \t\r]*\n")


class DatasetError(ValueError):
    """Bad dataset input; the message is one line naming the flag or file and the fix."""


_log = logging.getLogger(__name__)

# Invalid UTF-8 bytes replaced by U+FFFD, per file path, in the latest complete read of that file.
# A genuine U+FFFD in the file is not counted: the count comes from the decoder's error handler.
REPLACED_BYTES: dict[str, int] = {}
_warned_replaced: set[str] = set()
_decode_errors = threading.local()  # the handler has no idea which file it decodes: count per thread


def _replace_and_count(e: UnicodeError) -> tuple[str, int]:
    """Like errors="replace" (one U+FFFD per invalid sequence) but counts the invalid bytes."""
    _decode_errors.n = getattr(_decode_errors, "n", 0) + (e.end - e.start)
    return "\ufffd", e.end


_REPLACE = "hf_dataset_loader.replace_and_count"
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


# ----------------------------------------------------------------------------------------------
# Sources


@dataclass
class TextSource:
    name: str

    def documents(self, shuffle_seed: int | None = None, skip_head: int = 0,
                  shard: tuple[int, int] | None = None) -> Iterator[str]:
        """One pass; `shard=(index, count)`: only this process's disjoint part (every count-th document)."""
        raise NotImplementedError

    def validation(self) -> TextSource | None:
        """The source's own validation split, if it has one."""
        return None

    @property
    def size_bytes(self) -> int | None:
        return None


@dataclass
class ListSource(TextSource):
    """In-memory documents (tests, notebooks, the built-in corpus)."""

    docs: Sequence[str] = ()

    def documents(self, shuffle_seed: int | None = None, skip_head: int = 0,
                  shard: tuple[int, int] | None = None) -> Iterator[str]:
        return shard_of(iter(self.docs[skip_head:]), shard)

    @property
    def size_bytes(self) -> int:
        return sum(len(d.encode("utf-8")) for d in self.docs)


@dataclass
class LocalFiles(TextSource):
    paths: list[str] = field(default_factory=list)
    text_column: str | None = None

    def documents(self, shuffle_seed: int | None = None, skip_head: int = 0,
                  shard: tuple[int, int] | None = None) -> Iterator[str]:
        return shard_of(self._documents(shuffle_seed, skip_head), shard)

    def _documents(self, shuffle_seed: int | None, skip_head: int) -> Iterator[str]:
        skip = self._head_per_file(skip_head)
        paths = list(self.paths)
        if shuffle_seed is not None and len(paths) > 1:
            random.Random(shuffle_seed).shuffle(paths)
        for path in paths:
            yield from itertools.islice(read_file(path, self.text_column), skip.get(path, 0), None)

    def _head_per_file(self, n: int) -> dict[str, int]:
        """How many of the first `n` documents (in sorted file order) each file holds."""
        skip: dict[str, int] = {}
        for path in self.paths:
            if n <= 0:
                break
            count = sum(1 for _ in itertools.islice(read_file(path, self.text_column), n))
            skip[path], n = count, n - count
        return skip

    @property
    def size_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.paths)


@dataclass
class HubDataset(TextSource):
    config: str | None = None
    split: str = "train"
    streaming: bool = True
    text_column: str | None = None

    def _load(self, split: str):
        import datasets  # heavy import: only when the hub is used

        try:
            return datasets.load_dataset(self.name, self.config, split=split, streaming=self.streaming)
        except Exception as e:
            msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise DatasetError(f"--dataset-id {self.name} (split {split}): could not load it from the hub: {msg}")

    def documents(self, shuffle_seed: int | None = None, skip_head: int = 0,
                  shard: tuple[int, int] | None = None) -> Iterator[str]:
        ds = self._load(self.split)
        if shuffle_seed is not None and self.streaming and not skip_head:
            # Shard order only (our buffer shuffles documents). Not with a held-out head: reordering
            # shards would move held-out documents into training.
            ds = ds.shuffle(seed=shuffle_seed, buffer_size=1)
        texts = _texts(ds, self.text_column, f"--dataset-id {self.name}")
        if shard is not None and shard[1] > 1 and skip_head:
            # The held-out head is the head of the whole stream: skip it, then keep every count-th document
            # (a file-level split would skip part of the head inside each process's files instead).
            yield from shard_of(itertools.islice(texts, skip_head, None), shard)
            return
        if shard is not None and shard[1] > 1:  # files split between processes where they divide evenly
            from datasets.distributed import split_dataset_by_node

            shards = getattr(ds, "num_shards", None) or getattr(ds, "n_shards", None)
            if self.streaming and shards is not None and shards % shard[1] and shard[0] == 0:
                print(f"[data] warning: {self.name} has {shards} file shards for {shard[1]} processes; each "
                      f"process reads every shard and keeps 1 document in {shard[1]}", file=sys.stderr)
            texts = _texts(split_dataset_by_node(ds, rank=shard[0], world_size=shard[1]), self.text_column,
                           f"--dataset-id {self.name}")
        yield from itertools.islice(texts, skip_head, None)

    def validation(self) -> TextSource | None:
        import datasets

        try:
            splits = datasets.get_dataset_split_names(self.name, self.config)
        except Exception:
            return None
        for s in ("validation", "valid", "val", "test"):
            if s in splits and s != self.split:
                return HubDataset(self.name, self.config, s, self.streaming, self.text_column)
        return None


def hub_reachable(timeout: float = 3.0) -> bool:
    """True when the Hugging Face hub answers within `timeout` seconds (and offline mode is off)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout)
        return True
    except Exception as e:
        # An HTTP error status still means the hub answered.
        return hasattr(e, "code")


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith((".", "/", "~"))
        or spec.lower().endswith(LOCAL_EXTENSIONS)
        or any(ch in spec for ch in "*?[")
        or os.sep + os.sep in spec
    )


def _supported(path: str) -> bool:
    return path.lower().endswith(LOCAL_EXTENSIONS)


def _skip_unsupported(found: list[str], flag: str, spec: str, log) -> list[str]:
    """The supported files of a directory or glob; the others are skipped, and said so (with a count)."""
    paths = sorted(p for p in found if _supported(p))
    skipped = sorted({os.path.splitext(p)[1].lower() or "(none)" for p in found if not _supported(p)})
    if skipped and paths:
        log(f"[data] {flag} {spec}: skipped {len(found) - len(paths)} file(s) of unsupported type "
            f"({', '.join(skipped)}); supported: {' '.join(LOCAL_EXTENSIONS)}")
    return paths


def local_paths(spec: str, flag: str = "--dataset-id", log=print) -> list[str] | None:
    """Files named by a path, directory or glob; None when `spec` is not a local path at all."""
    spec = os.path.expanduser(spec)
    if os.path.isdir(spec):
        found = [os.path.join(root, f) for root, _, files in os.walk(spec) for f in files]
        paths = _skip_unsupported(found, flag, spec, log)
        if not paths:
            raise DatasetError(f"{flag} {spec}: directory has no {'/'.join(LOCAL_EXTENSIONS)} files")
        return paths
    if os.path.isfile(spec):
        if not _supported(spec):  # reading e.g. a .gz or .bin as text would train on garbage
            ext = os.path.splitext(spec)[1] or "(no extension)"
            raise DatasetError(f"{flag} {spec}: unsupported file type {ext}; "
                               f"rename or convert it to one of {' '.join(LOCAL_EXTENSIONS)}")
        return [spec]
    if any(ch in spec for ch in "*?["):
        found = [p for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
        if not found:
            raise DatasetError(f"{flag} {spec}: the glob matches no files")
        paths = _skip_unsupported(found, flag, spec, log)
        if not paths:
            raise DatasetError(f"{flag} {spec}: the glob matches only unsupported files; "
                               f"supported: {' '.join(LOCAL_EXTENSIONS)}")
        return paths
    if _looks_like_path(spec):
        raise DatasetError(f"{flag} {spec}: no such file or directory; check the path")
    return None


def resolve_source(
    dataset_id: str | None,
    *,
    dataset_config: str | None = None,
    split: str = "train",
    text_column: str | None = None,
    streaming: bool = True,
    hub_timeout: float = 3.0,
    flag: str = "--dataset-id",
    log=print,
) -> TextSource:
    """Turn a --dataset-id (hub id, file, directory, glob, or None for the default) into a source."""
    if dataset_id is None:
        if hub_reachable(hub_timeout):
            return HubDataset(DEFAULT_DATASET, dataset_config, split, streaming, text_column)
        log(
            f"[data] The Hugging Face hub did not answer within {hub_timeout:g}s: training on the built-in "
            f"offline corpus (Python's own documentation, ~2 MB of English). Pass --dataset-id to choose data."
        )
        return builtin_corpus()
    if dataset_id == BUILTIN_DATASET:
        return builtin_corpus()
    paths = local_paths(dataset_id, flag, log)
    if paths is not None:
        return LocalFiles(dataset_id, paths, text_column)
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", dataset_id):
        raise DatasetError(f"{flag} {dataset_id}: not a file, directory, glob or hub id like 'owner/name'")
    if not hub_reachable(hub_timeout):
        raise DatasetError(
            f"{flag} {dataset_id}: the Hugging Face hub cannot be reached; check the network "
            f"(or HF_HUB_OFFLINE) or pass a local file, directory or glob"
        )
    return HubDataset(dataset_id, dataset_config, split, streaming, text_column)


# ----------------------------------------------------------------------------------------------
# Local file readers


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


def read_file(path: str, text_column: str | None = None) -> Iterator[str]:
    """The documents of one local file; any problem with the file is a DatasetError naming it."""
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".json"):
        docs = _read_json(path, text_column)
    elif ext == ".parquet":
        docs = _read_parquet(path, text_column)
    elif ext == ".csv":
        docs = _read_csv(path, text_column)
    else:
        docs = _read_txt(path)
    return _os_errors_named(path, _counting_replacements(path, docs))


def _os_errors_named(path: str, docs: Iterator[str]) -> Iterator[str]:
    # A file that vanishes or is unreadable mid-run: one line naming it, not a traceback.
    try:
        yield from docs
    except OSError as e:
        raise DatasetError(f"{path}: cannot read it ({e.strerror or type(e).__name__}); check the file and its permissions")


def _file_contains(path: str, needle: bytes, chunk: int = 1 << 20) -> bool:
    with open(path, "rb") as f:
        tail = b""
        while block := f.read(chunk):
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


def _read_txt(path: str, chunk_bytes: int = 1 << 20) -> Iterator[str]:
    """Documents of a text file, split on `<|endoftext|>` if the file has one, else on blank lines.

    Invalid UTF-8 is decoded with replacement characters (one U+FFFD per invalid sequence); the
    number of replaced bytes is in REPLACED_BYTES[path] after a full read (see read_file).

    Linear time, memory ~ one document + one chunk, even for a huge document without separators:
    each chunk is scanned once, plus only the short end of the pending document that could begin
    a separator (the last len(EOT)-1 characters, or a trailing newline + blanks, scanned as "\n").
    The result equals splitting the whole file's text at once.
    """
    separator = EOT_TEXT if _file_contains(path, EOT_TEXT.encode()) else None
    decoder = codecs.getincrementaldecoder("utf-8")(errors=_REPLACE)
    pending: list[str] = []  # pieces of the document not yet ended by a separator
    pending_len = 0
    tail = 0  # length of the end of `pending` that may begin a separator (see _blank_tail)
    eot_tail = ""  # with a separator: the last len(separator)-1 characters of `pending`, kept as text

    def finish(doc: str) -> Iterator[str]:
        doc = doc.strip("\r\n")
        if doc and not doc.isspace():  # == doc.strip() != "", without copying a huge document
            yield doc

    with open(path, "rb") as f:
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


def _texts(rows: Iterable, text_column: str | None, where: str) -> Iterator[str]:
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


def _read_json(path: str, text_column: str | None) -> Iterator[str]:
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    if head[:1] == b"[":  # a JSON array: cannot be streamed with the standard library
        with open(path, encoding="utf-8-sig", errors=_REPLACE) as f:  # -sig: drop a byte-order mark
            try:
                rows = json.load(f)
            except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, huge ints
                msg = getattr(e, "msg", None) or type(e).__name__
                raise DatasetError(f"{path}: invalid JSON ({msg}); fix the file or convert it to JSON Lines")
        yield from _texts(rows, text_column, path)
        return
    yield from _texts(_jsonl_rows(path), text_column, path)


def _jsonl_rows(path: str) -> Iterator:
    with open(path, encoding="utf-8-sig", errors=_REPLACE) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            # ValueError covers JSONDecodeError and over-long integers; RecursionError deep nesting.
            except (ValueError, RecursionError) as e:
                msg = getattr(e, "msg", None) or type(e).__name__
                raise DatasetError(f"{path}:{lineno}: malformed JSON line ({msg}); fix or remove that line")


def _read_parquet(path: str, text_column: str | None) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DatasetError(f"{path}: not a readable Parquet file ({_first_line(e)})")
    names = pf.schema_arrow.names
    strings = [n for n in names if str(pf.schema_arrow.field(n).type) in ("string", "large_string")]
    column = pick_text_column(names, text_column, path, {n: "" for n in strings})
    batches = pf.iter_batches(columns=[column], batch_size=1024)
    while True:
        try:  # a truncated or corrupt data page only shows when its batch is read
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:
            raise DatasetError(f"{path}: corrupt Parquet data ({_first_line(e)}); re-export the file")
        for text in batch.column(0).to_pylist():
            if isinstance(text, str) and text.strip():
                yield text


def _read_csv(path: str, text_column: str | None) -> Iterator[str]:
    csv.field_size_limit(sys.maxsize)
    with open(path, encoding="utf-8-sig", errors=_REPLACE, newline="") as f:  # a BOM would rename column 1
        reader = csv.DictReader(f)
        try:
            yield from _texts(reader, text_column, path)
        except csv.Error as e:
            raise DatasetError(f"{path}:{reader.line_num}: malformed CSV ({e}); fix or remove that line")


def _first_line(e: BaseException, limit: int = 120) -> str:
    """First line of an exception's message (its type when the message is empty), for a one-line error."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__


# ----------------------------------------------------------------------------------------------
# Built-in offline corpus: real English that every Python ships


def builtin_corpus(max_bytes: int = 2_200_000) -> ListSource:
    """Python's pydoc topics plus the docstrings of the standard library's modules (~2 MB), sorted."""
    import pydoc_data.topics

    docs = [pydoc_data.topics.topics[k].strip() for k in sorted(pydoc_data.topics.topics)]
    total = sum(len(d) for d in docs)
    stdlib = os.path.dirname(os.__file__)
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "idlelib", "site-packages", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py") or total >= max_bytes:
                continue
            try:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            for node in [tree, *ast.walk(tree)]:
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 200:
                        docs.append(doc)
                        total += len(doc)
    return ListSource(BUILTIN_DATASET, docs)


# ----------------------------------------------------------------------------------------------
# Tokenize and pack (shared by the streaming loader and the full-load path)


def shard_of(docs: Iterator[str], shard: tuple[int, int] | None) -> Iterator[str]:
    """Documents index, index + count, ...: process `index` of `count` reads a disjoint 1/count of the stream."""
    if shard is None or shard[1] == 1:
        return docs
    return itertools.islice(docs, shard[0], None, shard[1])


def encode_documents(tokenizer, docs: Sequence[str], eot: int) -> np.ndarray:
    """Tokenize documents with one `encode_batch` call; each document is followed by `eot`."""
    encodings = tokenizer.encode_batch(list(docs), add_special_tokens=False)
    flat: list[int] = []
    for e in encodings:  # `e.ids` builds a new Python list on every access: read it once
        flat.extend(e.ids)
        flat.append(eot)
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
) -> tuple[np.ndarray, np.ndarray]:
    """The original full-load path: tokenize everything up front into (inputs, targets) arrays.

    Memory grows with the dataset (that is the point of comparing it with StreamingDataLoader).
    """
    from tokenizer_utils import eot_id

    eot = eot_id(tokenizer)
    stride = stride or seq_len
    parts, batch = [], []
    for i, doc in enumerate(source.documents(skip_head=skip_documents)):
        if max_examples is not None and i >= max_examples:
            break
        batch.append(doc)
        if len(batch) >= chunk_docs:
            parts.append(encode_documents(tokenizer, batch, eot))
            batch = []
    if batch:
        parts.append(encode_documents(tokenizer, batch, eot))
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    rows, _ = pack_rows(tokens, seq_len, stride)
    if len(rows) == 0:
        raise DatasetError(f"{source.name}: too little text for one sequence of {seq_len + 1} tokens")
    return rows[:, :-1].copy(), rows[:, 1:].copy()
