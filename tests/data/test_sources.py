"""slm.data.sources: directories and globs, missing paths, the offline fallback to the built-in corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from slm.data.sources import BUILTIN_DATASET, ListSource, LocalFiles, resolve_source
from slm.errors import DatasetError


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
