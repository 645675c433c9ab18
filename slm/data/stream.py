"""StreamingDataLoader: documents -> shuffle buffer -> batched tokenization -> packed fixed-length batches.

    from streaming_data_loader import StreamingDataLoader     # or: from slm.data.stream import ...
    loader = StreamingDataLoader(dataset_id="data.txt", tokenizer=tok, seq_len=128, batch_size=32)
    for batch in loader:            # one epoch
        batch["input_ids"], batch["targets"]   # numpy int32, (batch_size, seq_len)

Instruction data (`prompt_column=`, `response_column=`, optionally `chat_template=`): the same batches, with
target -1 wherever the target token is not a response token (slm.data.instruction, slm.data.packing).

Memory is bounded by the shuffle buffer (documents), one tokenization chunk, the packing carry-over
(< one batch of tokens) and the prefetch queue; none of it grows with the dataset. Tokenization runs in
a background thread that stays at most `prefetch` batches ahead, so it neither stalls the train step
nor competes with it for the cores when training is the bottleneck.

No jax here: numpy + tokenizers + datasets only.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from slm.data.instruction import (
    Document,
    as_document,
    compile_template,
    doc_chars,
    plain_documents,
)
from slm.data.packing import encode_documents, pack_rows, split_rows
from slm.data.sources import TextSource, resolve_source, with_columns
from slm.data.tokenizer import SpecialIds, load_tokenizer, special_ids
from slm.errors import DatasetError

Batch = dict[str, np.ndarray]
_log = logging.getLogger(__name__)
_END = object()


class StreamingDataLoader:
    """Iterate packed batches of one epoch; `iter_epoch(e)` reshuffles with seed (seed, e)."""

    def __init__(
        self,
        dataset_id: str | TextSource | None = None,
        tokenizer=None,
        seq_len: int = 128,
        batch_size: int = 32,
        streaming: bool = True,
        shuffle_buffer_size: int = 10_000,
        seed: int = 0,
        stride: int | None = None,
        max_examples: int | None = None,
        text_column: str | None = None,
        split: str = "train",
        dataset_config: str | None = None,
        skip_documents: int = 0,
        prefetch: int = 2,
        chunk_chars: int = 256_000,
        shard: tuple[int, int] | None = None,
        special: SpecialIds | None = None,
        prompt_column: str | None = None,
        response_column: str | None = None,
        chat_template: str | None = None,
    ):
        """`prompt_column` + `response_column`: instruction data, the loss on response tokens only (a source
        object given as `dataset_id` gets these columns too); `chat_template`: the template string (e.g.
        slm.data.instruction.load_chat_template(tokenizer_path)) that formats each example."""
        if tokenizer is None:
            raise ValueError("StreamingDataLoader needs a tokenizer (a tokenizers.Tokenizer or a tokenizer.json path)")
        if seq_len < 2:
            raise DatasetError(f"--seq-len {seq_len}: must be at least 2")
        if batch_size < 1:
            raise DatasetError(f"--batch-size {batch_size}: must be positive")
        stride = seq_len if stride is None else stride
        if not 1 <= stride <= seq_len:
            raise DatasetError(f"--stride {stride}: must be between 1 and --seq-len ({seq_len})")
        if shuffle_buffer_size < 0:
            raise DatasetError(f"--shuffle-buffer-size {shuffle_buffer_size}: must be >= 0")
        if max_examples is not None and max_examples < 1:
            raise DatasetError(f"--max-examples {max_examples}: must be positive")
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        if special is None:  # given by the trainer, which logs it; found here for a notebook user, who is told
            special = special_ids(self.tokenizer, tokenizer if isinstance(tokenizer, str) else None)
            if special.eos is None:
                _log.warning("[data] %s", special.describe(self.tokenizer))
        self.special = special
        if isinstance(dataset_id, TextSource):
            self.source = with_columns(dataset_id, prompt_column, response_column)
        else:
            if chat_template is not None and prompt_column is None:
                raise DatasetError("--chat-template: needs --prompt-column and --response-column")
            self.source = resolve_source(
                dataset_id, dataset_config=dataset_config, split=split, text_column=text_column, streaming=streaming,
                prompt_column=prompt_column, response_column=response_column,
            )
        if chat_template is not None:
            compile_template(chat_template)  # a template that does not compile fails here, not in the thread
        self.chat_template = chat_template
        self.seq_len, self.batch_size, self.stride = seq_len, batch_size, stride
        self.shuffle_buffer_size, self.seed = shuffle_buffer_size, seed
        self.max_examples, self.skip_documents = max_examples, skip_documents
        self.prefetch, self.chunk_chars = prefetch, chunk_chars
        if shard is not None and not (shard[1] >= 1 and 0 <= shard[0] < shard[1]):
            raise DatasetError(f"shard {shard}: must be (index, count) with 0 <= index < count")
        self.shard = shard  # (process, processes): read only every count-th document, from the index-th
        self.epoch = 0
        self.state: dict | None = None  # after each batch: where the stream is (see iter_epoch)
        # Counters for the current epoch (read by the trainer and the memory-bound test).
        self.documents_read = 0
        self.tokens_read = 0
        self.max_buffered_documents = 0
        self.max_carry_tokens = 0

    # -- public ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_epoch(self.epoch)

    def iter_epoch(self, epoch: int, state: dict | None = None) -> Iterator[Batch]:
        """Batches of epoch `epoch`; from `state` (a `loader.state` saved earlier) on, when given.

        After each batch `self.state` describes the stream just after it: the epoch, documents read
        from the source, the shuffle buffer's documents, its pre-drawn indices and RNG, and the tokens
        encoded but not yet packed. Resuming from it yields exactly the batches that would have followed.
        """
        if state is not None and state["epoch"] != epoch:
            raise ValueError(f"loader state is for epoch {state['epoch']}, not {epoch}")
        self.epoch = epoch
        self._resume = state
        gen = self._batches(epoch)
        return tracked(self, _prefetched(gen, self.prefetch) if self.prefetch > 0 else gen)

    def state_json(self) -> dict | None:
        """`state` as plain JSON types (what a checkpoint stores); iter_epoch accepts it back."""
        return None if self.state is None else json_state(self.state)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    # -- pipeline -------------------------------------------------------------------------------

    def _documents(self, epoch: int) -> Iterator[Document]:
        shuffle = self.shuffle_buffer_size > 1
        seed = (self.seed * 1_000_003 + epoch) if shuffle else None
        sharded = {"shard": self.shard} if self.shard else {}  # sources of your own need not know shards
        docs = self.source.documents(shuffle_seed=seed, skip_head=self.skip_documents, **sharded)
        yield from itertools.islice(docs, self.max_examples)

    def _batches(self, epoch: int) -> Iterator[tuple[Batch, dict]]:
        """(batch, state after it) pairs; the shuffle buffer and packing state are explicit so they can be saved."""
        resume, self._resume = getattr(self, "_resume", None), None
        self.documents_read = self.tokens_read = 0
        self.max_buffered_documents = self.max_carry_tokens = 0
        rng = np.random.default_rng([self.seed, epoch])
        L, B, stride, size = self.seq_len, self.batch_size, self.stride, self.shuffle_buffer_size
        carry = np.zeros(0, np.int32)
        buf: list[Document] = []
        picks: list[int] = []  # indices drawn in blocks: one numpy call per 4096 documents
        pos = 0
        drain: list[int] | None = None  # the order the buffer empties in at the end of the source
        if resume is not None:
            self.documents_read, self.tokens_read = resume["documents_read"], resume["tokens_read"]
            buf = [as_document(d) for d in resume["buffer"]]
            picks, pos, drain = list(resume["picks"]), resume["pick_pos"], resume["drain"]
            rng.bit_generator.state = resume["rng"]
            carry = np.asarray(resume["carry"], np.int32)
        source = itertools.islice(self._documents(epoch), self.documents_read, None)

        def shuffled() -> Iterator[Document]:
            nonlocal picks, pos, drain
            if drain is None:
                for doc in source:
                    self.documents_read += 1
                    if size <= 1:
                        yield doc
                    elif len(buf) < size:
                        buf.append(doc)
                        self.max_buffered_documents = max(self.max_buffered_documents, len(buf))
                    else:
                        if pos == len(picks):
                            picks, pos = rng.integers(0, size, 4096).tolist(), 0
                        i, pos = picks[pos], pos + 1
                        out, buf[i] = buf[i], doc
                        yield out
                drain, pos = rng.permutation(len(buf)).tolist(), 0
            while pos < len(drain):
                pos += 1
                yield buf[drain[pos - 1]]

        def snapshot() -> dict:
            return {"epoch": epoch, "documents_read": self.documents_read, "tokens_read": self.tokens_read,
                    "buffer": list(buf), "picks": picks[pos:] if drain is None else [], "pick_pos": 0 if drain is None else pos,
                    "drain": drain, "rng": rng.bit_generator.state, "carry": carry.copy()}

        chunk: list[Document] = []
        chunk_len = 0
        yielded = resume is not None

        def flush() -> Iterator[tuple[Batch, dict]]:
            nonlocal carry
            if chunk:
                tokens = encode_documents(self.tokenizer, chunk, self.special, self.chat_template)
                self.tokens_read += len(tokens)
                carry = np.concatenate([carry, tokens]) if len(carry) else tokens
                self.max_carry_tokens = max(self.max_carry_tokens, len(carry))
            while len(rows := pack_rows(carry, L, stride, B)[0]) == B:
                carry = carry[B * stride:]
                inputs, targets = split_rows(rows)
                yield {"input_ids": inputs, "targets": targets}, snapshot()

        if resume is not None:  # rows the restored carry holds come first, as in the uninterrupted stream
            yield from flush()
        for doc in shuffled():
            chunk.append(doc)
            chunk_len += doc_chars(doc)
            if chunk_len >= self.chunk_chars:
                for item in flush():
                    yielded = True
                    yield item
                chunk, chunk_len = [], 0
        if chunk or len(carry):
            for item in flush():
                yielded = True
                yield item
        if not yielded:
            raise DatasetError(f"{self.source.name}: dataset is smaller than one batch ({self.tokens_read} tokens, "
                               f"need {(B - 1) * stride + L + 1}); use a smaller --batch-size or --seq-len, or more data")


def json_state(state: dict) -> dict:
    """A stream state as plain JSON types (what a checkpoint stores): the carry as a list, Examples as lists."""
    return {**state, "carry": np.asarray(state["carry"]).tolist(), "buffer": plain_documents(state["buffer"])}


def tracked(owner: Any, pairs: Iterator[tuple[Batch, dict]]) -> Iterator[Batch]:
    """The batches of (batch, state) pairs; `owner.state` becomes each batch's state as it is handed out (not
    when a prefetch thread made it), so it is always the position just after what the consumer has."""
    try:
        for batch, state in pairs:
            owner.state = state
            yield batch
    finally:
        pairs.close()


def _prefetched(gen: Iterator[Batch], depth: int) -> Iterator[Batch]:
    """Run `gen` in a daemon thread at most `depth` items ahead; errors re-raise in the consumer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        """Queue `item` unless the consumer has gone away (then a blocking put would never return)."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def worker() -> None:
        try:
            for item in gen:
                if not put(item):
                    return
            put(_END)
        except BaseException as e:  # handed to the consumer, which re-raises it
            put(e)
        finally:
            gen.close()  # release the source (open files, hub streams) now, in this thread

    thread = threading.Thread(target=worker, name="data-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        # Wait for the worker to see it (at most one item in progress plus 0.1 s) and close the source, so a
        # run that ends, even by an error, leaves no reader behind; a stalled remote read does not hold us long.
        thread.join(timeout=5.0)
