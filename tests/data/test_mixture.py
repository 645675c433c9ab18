"""slm.data.mixture: weighted mixtures (issue 14). Realised token shares within ±0.03 of the weights over
>= 100K tokens, exact resume through a JSON round trip, a source that runs out restarted or dropped."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import DATA, read_docs

from slm.data.mixture import Mixture, MixtureLoader, mixture_summary, normalized
from slm.data.sources import ListSource
from slm.errors import DatasetError


@pytest.fixture(scope="module")
def corpora():
    return (ListSource("stories", read_docs(DATA / "tinystories_valid.txt")),
            ListSource("shakespeare", read_docs(DATA / "tinyshakespeare_val.txt")))


def loader(corpora, tok, weights, policy="restart", logs=None, **kw):
    mix = Mixture("mix", list(corpora), list(weights))
    return MixtureLoader(mix, tok, seq_len=kw.pop("seq_len", 64), batch_size=kw.pop("batch_size", 16), seed=3,
                         on_exhausted=policy, log=(logs.append if logs is not None else None),
                         shuffle_buffer_size=kw.pop("buffer", 32), prefetch=kw.pop("prefetch", 0), **kw)


def test_realised_shares_match_the_weights(corpora, tok):
    ml = loader(corpora, tok, [0.7, 0.3])
    n = 0
    for n, batch in enumerate(ml, 1):
        assert batch["input_ids"].shape == (16, 64) and batch["targets"].shape == (16, 64)
        if n * 16 * 64 >= 120_000:
            break
    counts = ml.counts()
    total = sum(c["tokens"] for c in counts)
    assert total == n * 16 * 64 >= 100_000
    shares = [c["tokens"] / total for c in counts]
    assert abs(shares[0] - 0.7) <= 0.03 and abs(shares[1] - 0.3) <= 0.03, shares
    assert [c["id"] for c in counts] == ["stories", "shakespeare"] and all(c["documents"] > 0 for c in counts)
    assert mixture_summary(counts).startswith("[data] mixture shares: stories 0.")


def test_rows_come_from_their_sources_streams(corpora, tok):
    """Each source's rows, in order, are exactly what its own loader alone would give."""
    ml = loader(corpora, tok, [0.5, 0.5], batch_size=4)
    rows = np.concatenate([b["input_ids"] for _, b in zip(range(30), ml)])
    alone = [list(ml.loaders[i].iter_epoch(0)) for i in range(2)]
    streams = [np.concatenate([b["input_ids"] for b in a]) for a in alone]
    taken = [0, 0]
    for row in rows:  # each row is the next one of one of the two streams
        hit = [i for i in (0, 1) if taken[i] < len(streams[i]) and (streams[i][taken[i]] == row).all()]
        assert hit, "a row from neither source"
        taken[hit[0]] += 1
    assert min(taken) > 10


@pytest.mark.parametrize("policy", ["restart", "drop"])
def test_exact_resume_from_any_batch_through_json(corpora, tok, policy):
    small = (corpora[0], ListSource("tiny", corpora[1].docs[:40]))  # runs out within the test
    ml = loader(small, tok, [0.5, 0.5], policy=policy, logs=[], batch_size=8)
    whole = [b["input_ids"].copy() for b in ml.iter_epoch(0)][:60]
    for cut in (1, 17, 45):
        ml = loader(small, tok, [0.5, 0.5], policy=policy, logs=[], batch_size=8)
        it = ml.iter_epoch(0)
        for _ in range(cut):
            next(it)
        state = json.loads(json.dumps(ml.state_json()))
        it.close()
        again = loader(small, tok, [0.5, 0.5], policy=policy, logs=[], batch_size=8, prefetch=2)
        rest = [b["input_ids"] for _, b in zip(range(60 - cut), again.iter_epoch(0, state))]
        assert all((a == b).all() for a, b in zip(whole[cut:], rest)) and len(rest) == len(whole[cut:]), cut


def test_a_source_that_runs_out_is_restarted_or_dropped(corpora, tok):
    tiny = ListSource("tiny", corpora[1].docs[:30])
    logs: list[str] = []
    ml = loader((corpora[0], tiny), tok, [0.5, 0.5], policy="restart", logs=logs, batch_size=8)
    batches = list(ml.iter_epoch(0))  # restart: the epoch ends once both sources have run out
    assert any("tiny ran out after" in line and "restarting it (its epoch 1)" in line for line in logs)
    assert any("stories ran out" in line for line in logs)
    assert ml.state["sources"][1]["epoch"] > 1  # the tiny one went round several times meanwhile
    shares = [c["tokens"] for c in ml.counts()]
    assert abs(shares[0] / sum(shares) - 0.5) < 0.05 and len(batches) > 20

    logs.clear()
    ml = loader((corpora[0], tiny), tok, [0.5, 0.5], policy="drop", logs=logs, batch_size=8)
    batches = list(ml.iter_epoch(0))
    assert logs[0].startswith("[data] mixture: tiny ran out after") and "dropped, the rest renormalised: stories 1.00" in logs[0]
    assert logs[-1].endswith("no source left: end of the epoch")
    counts = ml.counts()
    assert counts[0]["tokens"] > 3 * counts[1]["tokens"]  # stories alone after tiny was dropped


def test_weights_are_checked(corpora):
    assert normalized([7, 3], 2) == [0.7, 0.3] and normalized([], 3) == [1 / 3] * 3
    with pytest.raises(DatasetError, match="--dataset-weights: 1 weights for 2 datasets"):
        normalized([1.0], 2)
    with pytest.raises(DatasetError, match="must be positive"):
        normalized([1.0, 0.0], 2)
