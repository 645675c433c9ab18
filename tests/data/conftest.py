"""Fixtures of the data tests: a 512-token byte-level BPE trained once per module on real TinyStories text."""

from __future__ import annotations

import itertools

import pytest
from helpers import DATA

from slm.data.readers import read_file
from slm.data.tokenizer import eot_id, train_bpe


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
