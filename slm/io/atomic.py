"""Writes that a crash cannot tear: whole files by rename, logs by whole lines.

A run directory is the user's work, so its files follow a database's rules. A file that is rewritten
(config.json, summary.json, tokenizer files, checkpoint manifests) is written to a temporary file beside
it, flushed to disk and renamed over the old one: a reader sees the old file or the new, never half of
either. A log (metrics.jsonl) is appended one whole line per write() call on an O_APPEND descriptor, and
a reader or a resumed run drops a torn last line that a power cut can still leave.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """Have `write(tmp_path)` make the file, then fsync it and rename it over `path` (and fsync the folder).

    The temporary file is removed if `write` fails (a full disk, say): `path` is left as it was.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    sync_folder(folder)


def write_text(path: str, text: str) -> None:
    """`text` as the whole of `path`, atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    write_atomically(path, write)


def write_json(path: str, obj: Any, indent: int | None = 2) -> None:
    """`obj` as JSON (with a final newline) as the whole of `path`, atomically."""
    write_text(path, json.dumps(obj, indent=indent) + "\n")


def sync_folder(folder: str) -> None:
    """fsync a folder, so the renames and new files in it survive a power cut (a no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def append_line(fd: int, line: str) -> None:
    """One line appended with one write() on an O_APPEND descriptor (looping only on a short write)."""
    data = (line.rstrip("\n") + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def whole_lines(path: str) -> list[str]:
    """The complete lines of a text file: a torn last line (no newline) is left out."""
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    return data[:end].decode(errors="replace").splitlines()
