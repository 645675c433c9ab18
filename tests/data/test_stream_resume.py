"""Exact resume of the stream: the loader restored from its state anywhere in a stream replays the rest
byte for byte (the trainer saves this state in every checkpoint)."""

import hashlib
import itertools
import json

import pytest
from helpers import DATA

from slm.data.readers import read_file
from slm.data.sources import ListSource
from slm.data.stream import StreamingDataLoader
from slm.data.tokenizer import train_bpe


@pytest.fixture(scope="module")
def stories() -> list[str]:
    return list(itertools.islice(read_file(str(DATA / "tinystories_train.txt")), 60))


@pytest.fixture(scope="module")
def tok(stories):
    return train_bpe(stories, vocab_size=512)


def _digest(batch) -> str:
    return hashlib.sha256(batch["input_ids"].tobytes() + batch["targets"].tobytes()).hexdigest()


@pytest.mark.parametrize("buffer,prefetch", [(16, 2), (0, 0), (1000, 1)])
def test_restoring_at_every_batch_replays_the_rest_exactly(stories, tok, buffer, prefetch):
    """Every batch boundary of two epochs, through a JSON round trip as a checkpoint stores it.

    buffer 16: the buffer is mid-stream most of the time; 0: no shuffling; 1000 (> the 60 documents):
    the whole epoch is read into the buffer and drained, so states land inside the drain.
    """
    def make():
        return StreamingDataLoader(ListSource("stories", stories), tok, seq_len=32, batch_size=8,
                                   shuffle_buffer_size=buffer, seed=7, prefetch=prefetch, chunk_chars=3000)

    loader = make()
    for epoch in (0, 1):
        digests, states = [], []
        for batch in loader.iter_epoch(epoch):
            digests.append(_digest(batch))
            states.append(json.loads(json.dumps(loader.state_json())))
        assert len(digests) >= 20 and len(set(digests)) == len(digests)
        for k, state in enumerate(states):
            rest = [_digest(b) for b in make().iter_epoch(epoch, state)]
            assert rest == digests[k + 1:], f"epoch {epoch}: resumed after batch {k} diverged"


def test_state_for_another_epoch_is_refused(stories, tok):
    loader = StreamingDataLoader(ListSource("stories", stories), tok, seq_len=32, batch_size=4, shuffle_buffer_size=16)
    next(iter(loader.iter_epoch(0)))
    with pytest.raises(ValueError, match="epoch 0, not 1"):
        loader.iter_epoch(1, loader.state_json())
