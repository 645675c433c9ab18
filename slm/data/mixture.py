"""Weighted mixtures of sources (stories + instructions + code): one batch stream, shares of tokens by weight.

Each source has its own StreamingDataLoader (its own shuffle buffer, packing and held-out head) yielding one
row at a time; for every row of a batch a seeded sampler draws the source with probability = its weight, so
weights are shares of training tokens (every row is seq_len tokens). A source that runs out is reported
and either restarted on its next epoch ("restart": a mixture epoch ends once every source has run out at
least once) or dropped, the others' weights renormalised ("drop": the epoch ends when all are dropped).
The whole position (sampler RNG, each source's stream state, epoch and counters) is in `state` after each
batch, so a resumed run draws exactly the batches that would have followed. No jax here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from slm.data.sources import TextSource
from slm.data.stream import Batch, StreamingDataLoader, _prefetched, json_state, tracked
from slm.errors import DatasetError

_log = logging.getLogger(__name__)
POLICIES = ("restart", "drop")


def normalized(weights: Sequence[float], n: int, flag: str = "--dataset-weights") -> list[float]:
    """Weights as shares summing to 1 (equal shares when none are given); bad ones are a one-line error."""
    if not weights:
        return [1.0 / n] * n
    if len(weights) != n:
        raise DatasetError(f"{flag}: {len(weights)} weights for {n} datasets; give one per --dataset-id")
    if any(not w > 0 for w in weights):
        raise DatasetError(f"{flag}: weights must be positive, got {','.join(map(str, weights))}")
    total = float(sum(weights))
    return [w / total for w in weights]


@dataclass
class Mixture(TextSource):
    """Several sources with weights; as a plain source, `documents()` interleaves them by weight (seeded),
    which is what the tokenizer is trained on."""

    sources: list[TextSource] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)  # each source's first documents, held out for eval

    def documents(self, shuffle_seed: int | None = None, skip_head: int = 0,
                  shard: tuple[int, int] | None = None) -> Iterator[str]:
        """The training documents (each source's held-out head left out: `skip_head` is not used)."""
        rng = np.random.default_rng([shuffle_seed or 0, 99])
        heads = self.heads or [0] * len(self.sources)
        its = [iter(s.documents(skip_head=h)) for s, h in zip(self.sources, heads)]
        live = list(range(len(its)))
        while live:
            p = np.array([self.weights[i] for i in live])
            i = live[int(rng.choice(len(live), p=p / p.sum()))]
            doc = next(its[i], None)
            if doc is None:
                live.remove(i)
            else:
                yield doc

    @property
    def size_bytes(self) -> int | None:
        sizes = [s.size_bytes for s in self.sources]
        return None if any(s is None for s in sizes) else sum(sizes)


class MixtureLoader:
    """Batches drawn from several sources by weight; the StreamingDataLoader interface (`iter_epoch`,
    `state`, `state_json`), plus `counts()` for the realised shares."""

    def __init__(self, mixture: Mixture, tokenizer, seq_len: int, batch_size: int, seed: int = 0,
                 on_exhausted: str = "restart", skip_documents: Sequence[int] = (), prefetch: int = 2,
                 log: Callable[[str], None] | None = None, **loader_kwargs):
        if on_exhausted not in POLICIES:
            raise DatasetError(f"--mixture-exhausted {on_exhausted}: choose one of {', '.join(POLICIES)}")
        self.mixture, self.weights = mixture, normalized(mixture.weights, len(mixture.sources))
        skips = list(skip_documents) or mixture.heads or [0] * len(mixture.sources)
        self.loaders = [StreamingDataLoader(s, tokenizer, seq_len=seq_len, batch_size=1, seed=seed * 7919 + i,
                                            skip_documents=skip, prefetch=0, **loader_kwargs)
                        for i, (s, skip) in enumerate(zip(mixture.sources, skips))]
        self.seq_len, self.batch_size, self.seed, self.on_exhausted = seq_len, batch_size, seed, on_exhausted
        self.prefetch, self.log = prefetch, log or (lambda msg: _log.warning("%s", msg))
        self.state: dict | None = None
        self.epoch = 0

    # -- the StreamingDataLoader interface -------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_epoch(self.epoch)

    def iter_epoch(self, epoch: int, state: dict | None = None) -> Iterator[Batch]:
        """Batches of mixture epoch `epoch`, from `state` when given; a later epoch of the same loader
        continues each source where the previous epoch left it."""
        if state is not None and state["epoch"] != epoch:
            raise ValueError(f"loader state is for epoch {state['epoch']}, not {epoch}")
        start = state or (self._next_epoch(epoch) if epoch > 0 and self.state else self._fresh(epoch))
        self.epoch = epoch
        gen = self._batches(start)
        pairs = _prefetched(gen, self.prefetch) if self.prefetch > 0 else gen
        return tracked(self, pairs)

    def state_json(self) -> dict | None:
        if self.state is None:
            return None
        sources = [{**s, "stream": None if s["stream"] is None else json_state(s["stream"])} for s in self.state["sources"]]
        return {**self.state, "sources": sources}

    def counts(self) -> list[dict]:
        """Per source: id, weight, documents read and tokens trained on so far (the realised shares)."""
        if self.state is None:
            return [{"id": s.name, "weight": w, "documents": 0, "tokens": 0}
                    for s, w in zip(self.mixture.sources, self.weights)]
        return [{"id": src.name, "weight": w, "documents": s["documents"] + s["epoch_documents"],
                 "tokens": s["rows"] * self.seq_len}
                for src, w, s in zip(self.mixture.sources, self.weights, self.state["sources"])]

    # -- internals -------------------------------------------------------------------------------

    def _fresh(self, epoch: int) -> dict:
        rng = np.random.default_rng([self.seed, epoch, 424242])
        return {"epoch": epoch, "rng": rng.bit_generator.state,
                "sources": [{"epoch": 0, "stream": None, "active": True, "ran_out": False, "rows": 0,
                             "documents": 0, "epoch_documents": 0} for _ in self.loaders]}

    def _next_epoch(self, epoch: int) -> dict:
        """Continue every source where it is; the run-out marks start over (dropped sources come back)."""
        prev = self.state
        sources = [{**s, "active": True, "ran_out": False} for s in prev["sources"]]
        return {"epoch": epoch, "rng": prev["rng"], "sources": sources}

    def _batches(self, start: dict) -> Iterator[tuple[Batch, dict]]:
        st = {**start, "sources": [dict(s) for s in start["sources"]]}
        rng = np.random.default_rng()
        rng.bit_generator.state = st["rng"]
        streams: list[Iterator | None] = [None] * len(self.loaders)
        try:
            while True:
                rows: list[Batch] = []
                while len(rows) < self.batch_size:  # draws again after a source drops out mid-batch
                    live = [i for i, s in enumerate(st["sources"]) if s["active"]]
                    if self._epoch_over(st):
                        return  # a partial last batch is dropped, as the single-source loader does
                    p = np.array([self.weights[i] for i in live])
                    for j in rng.choice(len(live), size=self.batch_size - len(rows), p=p / p.sum()):
                        row = self._row(live[int(j)], st, streams)
                        if row is None:
                            break
                        rows.append(row)
                st["rng"] = rng.bit_generator.state
                snapshot = {**st, "sources": [dict(s) for s in st["sources"]]}
                yield {k: np.concatenate([r[k] for r in rows]) for k in ("input_ids", "targets")}, snapshot
        finally:
            for it in streams:
                if it is not None:
                    it.close()  # the sources' open files, now

    def _epoch_over(self, st: dict) -> bool:
        sources = st["sources"]
        if self.on_exhausted == "restart":
            return all(s["ran_out"] for s in sources)
        return not any(s["active"] for s in sources)

    def _row(self, i: int, st: dict, streams: list) -> Batch | None:
        """The next row of source i; None when it ran out and the batch must be drawn again."""
        s, loader = st["sources"][i], self.loaders[i]
        for _attempt in range(2):
            if streams[i] is None:
                streams[i] = loader.iter_epoch(s["epoch"], s["stream"])
            row = next(streams[i], None)
            if row is not None:
                s["stream"], s["rows"] = loader.state, s["rows"] + 1
                s["epoch_documents"] = loader.documents_read
                return row
            self._ran_out(i, st)
            streams[i] = None
            if not s["active"] or self._epoch_over(st):
                return None
        raise DatasetError(f"{self.mixture.sources[i].name}: yields no row of {self.seq_len + 1} tokens even "
                           f"right after a restart; use more data or a smaller --seq-len")

    def _ran_out(self, i: int, st: dict) -> None:
        s = st["sources"][i]
        s["documents"] += s["epoch_documents"]
        s["epoch"], s["stream"], s["epoch_documents"], s["ran_out"] = s["epoch"] + 1, None, 0, True
        name = self.mixture.sources[i].name
        if self.on_exhausted == "drop":
            s["active"] = False
            left = [j for j, x in enumerate(st["sources"]) if x["active"]]
            shares = ", ".join(f"{self.mixture.sources[j].name} {self.weights[j] / sum(self.weights[k] for k in left):.2f}"
                               for j in left)
            self.log(f"[data] mixture: {name} ran out after {s['rows'] * self.seq_len:,} tokens; dropped"
                     + (f", the rest renormalised: {shares}" if left else "; no source left: end of the epoch"))
        else:
            self.log(f"[data] mixture: {name} ran out after {s['rows'] * self.seq_len:,} tokens; restarting it "
                     f"(its epoch {s['epoch']})")


def mixture_summary(counts: list[dict]) -> str:
    """One log line: each source's realised share of tokens beside its weight."""
    total = sum(c["tokens"] for c in counts) or 1
    return "[data] mixture shares: " + ", ".join(
        f"{c['id']} {c['tokens'] / total:.3f} (weight {c['weight']:.3f})" for c in counts)

