"""Dataset sources: the Hugging Face hub, local files, directories and globs, a built-in offline corpus.

A source is anything with `documents(shuffle_seed=None, skip_head=0, shard=None) -> Iterator[Document]`
(texts, or Examples): one pass over the documents, leaving out the first `skip_head` of them in the
source's natural (unshuffled) order, which is how the trainer holds out an eval slice that shuffling can
never bring back into training. Local files are read incrementally (slm.data.readers), so the streaming loader's memory does
not grow with the dataset. A directory means every supported file in it, in sorted order; files of
other types (a hub snapshot's README, .gitattributes) are skipped, with a count. A file or glob must
name only files with one of LOCAL_EXTENSIONS: the others are refused, named, since the user asked for
them and reading e.g. a .gz as text would train on garbage. Given --prompt-column and --response-column,
the sources with columns (files of them, hub datasets) yield `Example(prompt, response)` pairs instead
(slm.data.instruction), the same way.

No jax here: numpy + tokenizers + datasets only.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import itertools
import os
import random
import re
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from slm.data.instruction import Document
from slm.data.readers import (
    LOCAL_EXTENSIONS,
    Opener,
    extension,
    read_file,
    row_documents,
)
from slm.data.remote import (
    RemoteFile,
    RetryPolicy,
    backoff,
    http_status,
    is_url,
    open_url,
    retry_after_of,
    transient,
)
from slm.errors import DatasetError, first_line

DEFAULT_DATASET = "roneneldan/TinyStories"
BUILTIN_DATASET = "builtin:python-docs"

@dataclass
class TextSource:
    name: str

    def documents(self, shuffle_seed: int | None = None, skip_head: int = 0,
                  shard: tuple[int, int] | None = None) -> Iterator[Document]:
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
    """In-memory documents (tests, notebooks, the built-in corpus): texts, or Examples of your own."""

    docs: Sequence[Document] = ()

    def documents(self, shuffle_seed: int | None = None, skip_head: int = 0,
                  shard: tuple[int, int] | None = None) -> Iterator[Document]:
        return shard_of(iter(self.docs[skip_head:]), shard)

    @property
    def size_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for d in self.docs for t in (d if isinstance(d, tuple) else (d,)))


@dataclass
class LocalFiles(TextSource):
    paths: list[str] = field(default_factory=list)
    text_column: str | None = None
    opener: Opener = open  # how read_file opens a path
    prompt_column: str | None = None  # with response_column: yield Examples
    response_column: str | None = None

    @property
    def pair(self) -> tuple[str, str] | None:
        return pair_of(self.prompt_column, self.response_column)

    def documents(self, shuffle_seed: int | None = None, skip_head: int = 0,
                  shard: tuple[int, int] | None = None) -> Iterator[Document]:
        return shard_of(self._documents(shuffle_seed, skip_head), shard)

    def _documents(self, shuffle_seed: int | None, skip_head: int) -> Iterator[Document]:
        skip = self._head_per_file(skip_head)
        paths = list(self.paths)
        if shuffle_seed is not None and len(paths) > 1:
            random.Random(shuffle_seed).shuffle(paths)
        for path in paths:
            yield from itertools.islice(read_file(path, self.text_column, self.opener, self.pair), skip.get(path, 0),
                                        None)

    def _head_per_file(self, n: int) -> dict[str, int]:
        """How many of the first `n` documents (in sorted file order) each file holds."""
        skip: dict[str, int] = {}
        for path in self.paths:
            if n <= 0:
                break
            count = sum(1 for _ in itertools.islice(read_file(path, self.text_column, self.opener, self.pair), n))
            skip[path], n = count, n - count
        return skip

    @property
    def size_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.paths)


@dataclass
class UrlFile(LocalFiles):
    """One http(s) file read as it streams, retrying transient failures from the byte it reached
    (slm.data.remote); `policy` sets the retries."""

    policy: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        self.paths = self.paths or [self.name]
        self.opener = functools.partial(open_url, policy=self.policy)

    @functools.cached_property
    def size_bytes(self) -> int | None:  # one HEAD request, not one per use (each may be retried)
        size = RemoteFile(self.paths[0], self.policy).length()
        return size if size >= 0 else None


@dataclass
class HubDataset(TextSource):
    config: str | None = None
    split: str = "train"
    streaming: bool = True
    text_column: str | None = None
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    prompt_column: str | None = None  # with response_column: yield Examples
    response_column: str | None = None

    @property
    def pair(self) -> tuple[str, str] | None:
        return pair_of(self.prompt_column, self.response_column)

    def _load(self, split: str):
        import datasets  # heavy import: only when the hub is used

        try:
            return datasets.load_dataset(self.name, self.config, split=split, streaming=self.streaming)
        except Exception as e:
            msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise DatasetError(f"--dataset-id {self.name} (split {split}): could not load it from the hub: {msg}")

    def documents(self, shuffle_seed: int | None = None, skip_head: int = 0,
                  shard: tuple[int, int] | None = None) -> Iterator[Document]:
        """The stream, reopened after a transient network failure (`datasets` streaming raises 429/5xx and
        connection resets mid-stream: its issues 7506, 7344, 6577) and continued at the exact document:
        the documents already yielded are skipped in the same deterministic order."""
        yielded, failures = 0, 0
        while True:
            try:
                for doc in itertools.islice(self._documents(shuffle_seed, skip_head, shard), yielded, None):
                    yield doc
                    yielded, failures = yielded + 1, 0
                return
            except DatasetError:
                raise
            except Exception as e:  # noqa: BLE001 - sorted into transient (retried) and permanent (one line)
                status = http_status(e)
                if not transient(e):
                    why = f"HTTP {status}" if status else f"{type(e).__name__}: {first_line(e, 160)}"
                    raise DatasetError(f"--dataset-id {self.name}: streaming failed after {yielded:,} documents "
                                       f"({why}); check the id, your access (HF_TOKEN) and the network") from None
                failures = backoff(self.policy, self.name, failures, f"{type(e).__name__} after {yielded:,} documents",
                                   retry_after_of(e))

    def _documents(self, shuffle_seed: int | None, skip_head: int, shard: tuple[int, int] | None) -> Iterator[Document]:
        ds = self._load(self.split)
        if shuffle_seed is not None and self.streaming and not skip_head:
            # Shard order only (our buffer shuffles documents). Not with a held-out head: reordering
            # shards would move held-out documents into training.
            ds = ds.shuffle(seed=shuffle_seed, buffer_size=1)
        texts = row_documents(ds, self.text_column, f"--dataset-id {self.name}", self.pair)
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
            texts = row_documents(split_dataset_by_node(ds, rank=shard[0], world_size=shard[1]), self.text_column,
                                  f"--dataset-id {self.name}", self.pair)
        yield from itertools.islice(texts, skip_head, None)

    def validation(self) -> TextSource | None:
        import datasets

        try:
            splits = datasets.get_dataset_split_names(self.name, self.config)
        except Exception:
            return None
        for s in ("validation", "valid", "val", "test"):
            if s in splits and s != self.split:
                return dataclasses.replace(self, split=s)
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
        found = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not found:
            raise DatasetError(f"{flag} {spec}: the glob matches no files")
        unsupported = [p for p in found if not _supported(p)]
        if unsupported:
            named = ", ".join(unsupported[:3]) + (f" and {len(unsupported) - 3} more" if len(unsupported) > 3 else "")
            raise DatasetError(f"{flag} {spec}: the glob matches {len(unsupported)} file(s) of unsupported type "
                               f"({named}); narrow it to {'/'.join(LOCAL_EXTENSIONS)} files")
        return found
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
    prompt_column: str | None = None,
    response_column: str | None = None,
) -> TextSource:
    """Turn a --dataset-id (hub id, file, directory, glob, or None for the default) into a source; given
    `prompt_column` and `response_column`, one that yields Example(prompt, response) pairs."""
    pair = {"prompt_column": prompt_column, "response_column": response_column}
    pair_of(prompt_column, response_column)  # both or neither
    if dataset_id is None:
        if hub_reachable(hub_timeout):
            return HubDataset(DEFAULT_DATASET, dataset_config, split, streaming, text_column, RetryPolicy(log=log),
                              **pair)
        if prompt_column:
            raise DatasetError("--prompt-column: the built-in offline corpus has no columns; pass --dataset-id")
        log(
            f"[data] The Hugging Face hub did not answer within {hub_timeout:g}s: training on the built-in "
            f"offline corpus (Python's own documentation, ~2 MB of English). Pass --dataset-id to choose data."
        )
        return builtin_corpus()
    if dataset_id == BUILTIN_DATASET:
        if prompt_column:
            raise DatasetError(f"--prompt-column: {BUILTIN_DATASET} has no columns; pass a dataset with them")
        return builtin_corpus()
    if is_url(dataset_id):
        if extension(dataset_id) not in LOCAL_EXTENSIONS:
            raise DatasetError(f"{flag} {dataset_id}: a URL must name a {'/'.join(LOCAL_EXTENSIONS)} file")
        return UrlFile(dataset_id, text_column=text_column, policy=RetryPolicy(log=log), **pair)
    paths = local_paths(dataset_id, flag, log)
    if paths is not None:
        return LocalFiles(dataset_id, paths, text_column, **pair)
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", dataset_id):
        raise DatasetError(f"{flag} {dataset_id}: not a file, directory, glob or hub id like 'owner/name'")
    if not hub_reachable(hub_timeout):
        raise DatasetError(
            f"{flag} {dataset_id}: the Hugging Face hub cannot be reached; check the network "
            f"(or HF_HUB_OFFLINE) or pass a local file, directory or glob"
        )
    return HubDataset(dataset_id, dataset_config, split, streaming, text_column, RetryPolicy(log=log), **pair)


def pair_of(prompt_column: str | None, response_column: str | None) -> tuple[str, str] | None:
    """(prompt, response) columns, or None for plain text; one of them alone is a one-line error."""
    if (prompt_column is None) != (response_column is None):
        raise DatasetError("--prompt-column and --response-column: give both (the loss is taken on the response)")
    return None if prompt_column is None else (prompt_column, response_column)


def with_columns(source: TextSource, prompt_column: str | None, response_column: str | None) -> TextSource:
    """`source` yielding Examples of these columns (a copy; a mixture's sources each). A source without
    columns of its own (a ListSource, yours) is returned as it is: it yields its own Examples."""
    if pair_of(prompt_column, response_column) is None:
        return source
    if isinstance(getattr(source, "sources", None), list):  # a Mixture (slm.data.mixture imports this module)
        return dataclasses.replace(source, sources=[with_columns(s, prompt_column, response_column)
                                                    for s in source.sources])
    if hasattr(source, "prompt_column"):
        return dataclasses.replace(source, prompt_column=prompt_column, response_column=response_column)
    return source


# ----------------------------------------------------------------------------------------------
# Built-in offline corpus: real English that every Python ships


@functools.lru_cache(maxsize=1)
def builtin_corpus(max_bytes: int = 2_200_000) -> ListSource:
    """Python's pydoc topics plus the docstrings of the standard library's modules (~2 MB), sorted.

    Parsing the standard library takes seconds, so the corpus is built once per process."""
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


def shard_of(docs: Iterator[Document], shard: tuple[int, int] | None) -> Iterator[Document]:
    """Documents index, index + count, ...: process `index` of `count` reads a disjoint 1/count of the stream."""
    if shard is None or shard[1] == 1:
        return docs
    return itertools.islice(docs, shard[0], None, shard[1])
