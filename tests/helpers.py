"""What several test files share: where the repository and the shared corpora are, and small readers."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from slm.data.readers import read_file

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def read_docs(path, **kw) -> list[str]:
    """Every document of one local file, as the trainer's reader yields them."""
    return list(read_file(str(path), **kw))


def token_stream(tok, docs, eot) -> np.ndarray:
    """The reference packed stream, built without encode_documents: each doc's ids then EOT."""
    out: list[int] = []
    for d in docs:
        out += tok.encode(d, add_special_tokens=False).ids
        out.append(eot)
    return np.array(out, dtype=np.int32)


def collect(loader, epoch: int | None = None) -> list[dict]:
    it = loader if epoch is None else loader.iter_epoch(epoch)
    return [{k: v.copy() for k, v in b.items()} for b in it]


def rows_of(batches) -> np.ndarray:
    return np.concatenate([b["input_ids"] for b in batches])


def fresh_state(model, tx, seq_len: int, seed: int = 0):
    """The step-0 train state built in one jitted call, as the trainer builds it (slm.train.builder.init_state):
    one compile instead of one per optimizer-state leaf in eager mode."""
    import jax

    from slm.model.transformer import init_params
    from slm.train.step import init_state

    return jax.jit(lambda: init_state(init_params(model, seed, seq_len), tx))()
