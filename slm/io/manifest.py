"""A checkpoint's manifest: every file it holds, with its size and CRC-32, written once it has committed.

`--resume` checks the newest checkpoint against its manifest before restoring it, so a truncated or
bit-flipped file (a full disk, a bad copy, a dying drive) is found before it can fail a restore or,
worse, restore wrong numbers. CRC-32 (zlib, hardware-accelerated) detects every burst error up to 32
bits and all but 1 in 4 billion others, at ~4 GB/s: the cost is the read-back of the files, which the
page cache serves right after a save (figures in docs/resume.md). It is a check for damage, not for
tampering.
"""

from __future__ import annotations

import json
import os
import zlib

from slm.io.atomic import write_json

MANIFEST = "slm-manifest.json"
_CHUNK = 8 << 20  # read in 8 MB pieces: memory stays flat whatever the checkpoint's size


def file_crc32(path: str, buf: bytearray | None = None) -> int:
    """CRC-32 of a file's bytes, read in fixed-size pieces."""
    buf = buf if buf is not None else bytearray(_CHUNK)
    view, crc = memoryview(buf), 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def _files(folder: str) -> list[str]:
    """Paths (relative, '/'-separated, sorted) of the files under `folder`, the manifest itself left out."""
    out = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        rel = os.path.relpath(root, folder)
        out += [name if rel == "." else f"{rel}/{name}".replace(os.sep, "/") for name in sorted(names)
                if not (rel == "." and name.startswith((MANIFEST, f".{MANIFEST}")))]
    return out


def write_manifest(folder: str) -> int:
    """Record every file under `folder` (size, CRC-32) in its manifest, atomically; returns the bytes covered."""
    buf = bytearray(_CHUNK)
    files = {rel: [os.path.getsize(os.path.join(folder, rel)), file_crc32(os.path.join(folder, rel), buf)]
             for rel in _files(folder)}
    write_json(os.path.join(folder, MANIFEST), {"format": 1, "checksum": "crc32", "files": files}, indent=None)
    return sum(size for size, _ in files.values())


def has_manifest(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, MANIFEST))


def check_manifest(folder: str) -> str | None:
    """None when every file the manifest names is there with its size and CRC-32; else what differs."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest is unreadable ({type(e).__name__})"
    buf = bytearray(_CHUNK)
    for rel, (size, crc) in sorted(files.items()):
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if (actual := os.path.getsize(path)) != size:
            return f"{rel} is {actual:,} bytes, {size:,} when saved"
        if file_crc32(path, buf) != crc:
            return f"{rel} has changed since it was saved (CRC-32 differs)"
    return None
