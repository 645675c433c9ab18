"""Scoring the held-out set and sampling from the model during training."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from slm.data.heldout import EvalSet
from slm.model.generate import Decoder, generate_ids
from slm.model.lora import LoraSpec, merge
from slm.model.transformer import Transformer
from slm.train.devices import Processes, replicated_batch
from slm.train.interrupts import SignalWatcher
from slm.train.step import make_eval_step


SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 0.8, 40  # the eval's sample


def sampler_ahead(built: Any, start_ids: list[int], seq_len: int) -> Decoder:
    """A decoder holding the eval sample's programs, compiled now at the params' abstract shapes and shardings
    with XLA's own options. The trainer calls it in pre-flight on a GPU, before anything is resident: XLA:GPU's
    autotuning then runs its candidate kernels on an empty card instead of beside the state, and the sample
    keeps the tuned kernels (on an H200, 2026-11-26: the untuned decode was 1.25x slower for Gemma-3-1B QLoRA,
    1.33x for Mistral-7B; bench/plan_for_xla.py device --trainer-order)."""
    params = built.abstract.params
    if built.base_abstract is not None:
        params = merge(built.base_abstract, params)
    decoder = Decoder(built.model)
    decoder.compiled(params, 1, len(start_ids), seq_len - len(start_ids), SAMPLE_TOP_K, options={})
    return decoder


class Evaluator:
    """Sums the held-out set's nats in fixed-size batches (padded, so the eval step compiles once), and
    samples a sequence from the tokens a document starts after (`start_ids`) with the KV-cache decoder."""

    def __init__(self, model: Transformer, eval_set: EvalSet, batch_size: int, batch_sharding: Any, tokenizer: Any,
                 start_ids: list[int], seq_len: int, seed: int, procs: Processes, signals: SignalWatcher,
                 samples_path: str | None, base: Any = None, lora: LoraSpec | None = None,
                 decoder: Decoder | None = None):
        self.model, self.eval_set, self.batch_size, self.batch_sharding = model, eval_set, batch_size, batch_sharding
        self.tokenizer, self.start_ids, self.seq_len, self.seed = tokenizer, start_ids, seq_len, seed
        self.procs, self.signals, self.samples_path = procs, signals, samples_path
        self.base, self.lora = base, lora  # LoRA: the trained params are the adapters of this frozen base
        self.eval_step = make_eval_step(model)
        self.decoder = decoder or Decoder(model)  # sampler_ahead's, where pre-flight compiled the sample
        self.ahead = decoder is not None

    def score(self, params: Any) -> tuple[float, float] | None:
        """(sum of nats, tokens scored); None when a signal arrives meanwhile (the run saves and stops)."""
        params = params if self.base is None else merge(self.base, params)
        nats, count = 0.0, 0.0
        B, es = self.batch_size, self.eval_set
        for i in range(0, len(es.inputs), B):
            x, y, m = es.inputs[i: i + B], es.targets[i: i + B], es.mask[i: i + B]
            if len(x) < B:  # pad the last batch so the eval step compiles once
                pad = ((0, B - len(x)), (0, 0))
                x, y, m = np.pad(x, pad), np.pad(y, pad), np.pad(m, pad)
            if self.procs.any(bool(self.signals.received)):  # all processes abort together
                return None
            s, n = self.eval_step(params, *(replicated_batch(a, self.batch_sharding) for a in (x, y, m)))
            nats, count = nats + float(s), count + float(n)
        return nats, count

    def sample(self, params: Any, step: int) -> str:
        """A seq_len-token sample (SAMPLE_TEMPERATURE, SAMPLE_TOP_K; key from seed + step), also appended to
        samples.txt. With LoRA the decoder applies the adapters beside the base as held (an NF4 base dequantised
        one kernel at a time in the program): no folded or float32 copy of the base, so sampling stays inside the
        run's plan."""
        if self.base is not None:
            params = merge(self.base, params)
        if not self.ahead:  # a decoder compiled ahead (pre-flight, accelerators) takes the mesh's layout
            params = one_cpu_device(params)
        ids = generate_ids(self.model, params, self.start_ids, self.seq_len - len(self.start_ids), decoder=self.decoder,
                           temperature=SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K,
                           key=jax.random.PRNGKey(self.seed + step))
        text = self.tokenizer.decode(ids[0].tolist())
        if self.samples_path is not None:
            with open(self.samples_path, "a") as f:
                f.write(f"=== step {step}\n{text}\n\n")
        return text


def one_cpu_device(params: Any) -> Any:
    """Params replicated over several CPU devices as device 0's copies (no copy made), so the sample's decoder
    runs once on all cores instead of once per device side by side: each device held its own temporaries and the
    devices shared the same cores (Gemma-3-1B QLoRA on the 2-core EPYC: 1.4 s a token on 2 devices against
    0.75 s on one). On an accelerator, over several processes, or a tree split over its devices (FSDP), `params`
    as they are."""
    leaves = jax.tree.leaves(params)
    one = all(isinstance(x, jax.Array) and x.is_fully_addressable and x.sharding.is_fully_replicated
              and len(x.sharding.device_set) > 1 and next(iter(x.sharding.device_set)).platform == "cpu"
              for x in leaves)  # one process's devices only: processes that share a run sample together
    if not (one and leaves):
        return params
    device = min(leaves[0].sharding.device_set, key=lambda d: d.id)
    return jax.tree.map(lambda x: next(s.data for s in x.addressable_shards if s.device == device), params)
