"""Sampling with a KV cache: a jitted prefill and a jitted single-token step (`Decoder`), top-k/top-p/temperature.

Used by the trainer for its eval-time samples and by `generate.py` (slm.cli.generate) for streamed text.

Why a KV cache and one compile per shape. A sampler without a cache reruns the whole fixed window for
every new token: O(L) forward passes of L positions each, quadratic in the length. Here the prompt is run
once (prefill, with training's blocked causal attention, slm.model.attention) and every layer's rotated
keys and values are kept in a fixed-size cache of `prompt + --max-new-tokens` positions (rounded up to a
multiple of 64); each new token is then one forward pass of a single position that writes its
K/V into the cache at its position and attends to the cache under the causal mask (`slm.model.decode.decode`).
Both functions are jitted with the cache donated (updated in place) and the position, key, temperature
and top-p traced arguments, so one generation compiles exactly two programs, the prefill (prompt padded
to a power-of-two bucket) and the single-token step, both before timing starts, and the step is reused
for every token. Top-k alone is static, so that `lax.top_k` replaces a sort of the whole vocabulary
(on CPU a 4096-way sort costs more than a 1M-param model's decode step); top-p without top-k sorts.
Per token the only host work is dispatching the step and fetching one int per sequence to print it; the
next step is dispatched before that fetch so the device does not wait on the terminal.

The prompt always follows an end-of-text token, as documents do in training (an empty prompt is just
that token), and generation stops at the next end-of-text unless --ignore-eot.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from slm.model.decode import decode, init_cache
from slm.model.transformer import Transformer

CACHE_ROUND = 64  # cache length is rounded up to a multiple of this: fewer distinct compiled shapes
MIN_BUCKET = 8  # smallest padded prompt length for the prefill


# --- sampling ----------------------------------------------------------------------------------------


def _candidates(logits_BxV: jax.Array, top_k: int, top_p: jax.Array | float) -> tuple[jax.Array, jax.Array]:
    """(logits, ids) of the top-k tokens (all V when top_k is 0) in descending order, with those outside
    the top-p nucleus at -inf. top_k is static: lax.top_k of 40 out of 4096 costs ~20 us on CPU where a
    full sort costs ~700 us, more than a whole decode step of a 1M-param model."""
    V = logits_BxV.shape[-1]
    if 0 < top_k < V:
        cand_BxC, ids_BxC = jax.lax.top_k(logits_BxV, top_k)  # equal logits: the lower id first
    else:
        ids_BxC = jnp.argsort(-logits_BxV, axis=-1, stable=True)
        cand_BxC = jnp.take_along_axis(logits_BxV, ids_BxC, axis=-1)
    probs_BxC = jax.nn.softmax(cand_BxC.astype(jnp.float32), axis=-1)
    mass_before_BxC = jnp.cumsum(probs_BxC, axis=-1) - probs_BxC
    keep_BxC = (top_p >= 1) | (mass_before_BxC < top_p)
    keep_BxC = keep_BxC.at[:, 0].set(True)  # the most likely token always stays
    return jnp.where(keep_BxC, cand_BxC, -jnp.inf), ids_BxC


def filter_logits(logits_BxV: jax.Array, top_k: int, top_p: jax.Array | float) -> jax.Array:
    """Logits with every token outside the top-k / top-p (nucleus) set at -inf, in vocabulary order.

    top_k = 0 (or >= V) and top_p >= 1 switch that filter off; top_k is static, top_p may be traced.
    Top-k keeps the k highest logits (equal logits: the lower id first). Top-p, applied after top-k
    (probabilities renormalised over the k), keeps the smallest set of most likely tokens whose
    probability reaches top_p: a token stays when the tokens ranked above it sum to less than top_p.
    The most likely token always stays.
    """
    cand_BxC, ids_BxC = _candidates(logits_BxV, top_k, top_p)
    rows_Bx1 = jnp.arange(logits_BxV.shape[0])[:, None]
    return jnp.full_like(logits_BxV, -jnp.inf).at[rows_Bx1, ids_BxC].set(cand_BxC)


def sample_token(logits_BxV: jax.Array, key: jax.Array, temperature: jax.Array | float, top_k: int,
                 top_p: jax.Array | float) -> jax.Array:
    """One token id per row (int32): argmax when temperature == 0, else a draw from softmax(logits / T)
    restricted to the top-k / top-p set (`filter_logits`). Greedy and unfiltered draws skip the sort
    (lax.cond runs only the branch taken)."""

    def greedy(logits_BxV: jax.Array) -> jax.Array:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)

    def draw_filtered(scaled_BxV: jax.Array) -> jax.Array:
        cand_BxC, ids_BxC = _candidates(scaled_BxV, top_k, top_p)
        pick_B = jax.random.categorical(key, cand_BxC, axis=-1)
        return jnp.take_along_axis(ids_BxC, pick_B[:, None], axis=-1)[:, 0].astype(jnp.int32)

    def draw_all(scaled_BxV: jax.Array) -> jax.Array:
        return jax.random.categorical(key, scaled_BxV, axis=-1).astype(jnp.int32)

    def draw(logits_BxV: jax.Array) -> jax.Array:
        scaled_BxV = logits_BxV / temperature
        if 0 < top_k < logits_BxV.shape[-1]:
            return draw_filtered(scaled_BxV)
        return jax.lax.cond(top_p < 1, draw_filtered, draw_all, scaled_BxV)

    return jax.lax.cond(temperature > 0, draw, greedy, logits_BxV)


# --- the cached decoder ------------------------------------------------------------------------------


def cache_length(prompt_len: int, max_new_tokens: int) -> int:
    return -(-(prompt_len + max_new_tokens) // CACHE_ROUND) * CACHE_ROUND


def prompt_bucket(prompt_len: int, cache_len: int) -> int:
    return min(max(MIN_BUCKET, 1 << (prompt_len - 1).bit_length()), cache_len)


def sampler_compile_options(platform: str | None) -> dict:
    """XLA options for the sampler's programs. On a GPU, no autotuning: XLA:GPU tunes a product by running its
    candidate kernels on scratch copies of the operands, on the card, beside the run's resident state (it is
    compiled at the first eval). Measured on an H100 (2026-11-26, bench/plan_for_xla.py device --trainer-order):
    compiling Gemma-3-1B's batch-1 prefill and decode step held 1,826 MB of such scratch beside a 968 MB QLoRA
    state, 2.5x the largest program the plan had compiled; Mistral-7B's 846 MB, +10% over it. Untuned, the
    decode ran 1.25x and 1.33x slower on an H200, so the trainer compiles its eval sample tuned in pre-flight,
    on the empty card (slm.train.evaluate.sampler_ahead); this is for samplers compiled later."""
    return {"xla_gpu_autotune_level": 0} if (platform or jax.default_backend()) == "gpu" else {}


class Decoder:
    """Jitted prefill + single-token step for one model, compiled once per (batch, prompt bucket, cache
    length, top-k); temperature, top-p, positions and keys are traced.

    `stream` yields the new tokens one step at a time as numpy int32 arrays of shape (B,); the token at
    position p is drawn with key fold_in(PRNGKey(seed), p), so a seed fixes the whole output.
    """

    def __init__(self, model: Transformer):
        self.model = model
        self._prefill = jax.jit(self._prefill_fn, static_argnums=(2, 6))
        self._step = jax.jit(self._step_fn, static_argnums=(6,), donate_argnums=(2,))
        self._compiled: dict[tuple, tuple[Any, Any]] = {}
        self.compile_s = 0.0  # time spent compiling, kept out of the prefill/decode timings

    def _prefill_fn(self, params: Any, ids_BxT: jax.Array, cache_len: int, prompt_len: jax.Array, key: jax.Array,
                    temperature: jax.Array, top_k: int, top_p: jax.Array) -> tuple[jax.Array, list]:
        """A fresh cache of cache_len positions holding the prompt, and the token drawn for position prompt_len."""
        cache = init_cache(self.model.shape, ids_BxT.shape[0], cache_len, self.model.dtype)
        logits_Bx1xV, cache = decode(self.model, params, ids_BxT, cache, jnp.int32(0), last=prompt_len - 1,
                                     fresh=True)
        key = jax.random.fold_in(key, prompt_len)
        return sample_token(logits_Bx1xV[:, 0], key, temperature, top_k, top_p), cache

    def _step_fn(self, params: Any, token_B: jax.Array, cache: list, pos: jax.Array, key: jax.Array,
                 temperature: jax.Array, top_k: int, top_p: jax.Array) -> tuple[jax.Array, list]:
        """token_B sits at position pos; returns the token drawn for pos + 1."""
        logits_Bx1xV, cache = decode(self.model, params, token_B[:, None], cache, pos)
        key = jax.random.fold_in(key, pos + 1)
        return sample_token(logits_Bx1xV[:, 0], key, temperature, top_k, top_p), cache

    def compiled(self, params: Any, batch: int, prompt_len: int, max_new_tokens: int,
                 top_k: int = 0, options: dict | None = None) -> tuple[Any, Any]:
        """The (prefill, step) executables for this shape and top-k, compiled ahead of time on first use (`params`
        may be abstract, with shardings); `options`: XLA's, instead of sampler_compile_options'."""
        S = cache_length(prompt_len, max_new_tokens)
        T = prompt_bucket(prompt_len, S)
        top_k = self._static_top_k(top_k)
        shape_key = (batch, T, S, top_k)
        if shape_key not in self._compiled:
            t0 = time.perf_counter()
            cache = jax.eval_shape(lambda: init_cache(self.model.shape, batch, S, self.model.dtype))
            i32, f32 = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32)
            key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
            options = sampler_compile_options(self.model.platform) if options is None else options
            prefill = self._prefill.lower(params, jax.ShapeDtypeStruct((batch, T), jnp.int32), S, i32, key,
                                          f32, top_k, f32).compile(compiler_options=options)
            step = self._step.lower(params, jax.ShapeDtypeStruct((batch,), jnp.int32), cache, i32, key,
                                    f32, top_k, f32).compile(compiler_options=options)
            self._compiled[shape_key] = (prefill, step)
            self.compile_s += time.perf_counter() - t0
        return self._compiled[shape_key]

    def _static_top_k(self, top_k: int) -> int:
        return 0 if top_k >= self.model.shape.vocab_size else int(top_k)  # k >= V keeps everything: off

    def stream(self, params: Any, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.8,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0, batch: int = 1,
               key: jax.Array | None = None, timings: dict | None = None) -> Iterator[np.ndarray]:
        """Yield max_new_tokens steps of (batch,) int32 token ids continuing `prompt_ids` (non-empty).

        `timings`, when given, gets "prefill_s" (start to the first new token on host) and "decode_s" (first
        to last token on host), accumulated across calls, plus "prompt_tokens" and "decode_tokens" counts.
        """
        P = len(prompt_ids)
        if P < 1:
            raise ValueError("prompt_ids must hold at least one token (start from the end-of-text token)")
        if max_new_tokens < 1:
            return
        prefill, step = self.compiled(params, batch, P, max_new_tokens, top_k)
        S = cache_length(P, max_new_tokens)
        T = prompt_bucket(P, S)
        ids_BxT = np.zeros((batch, T), np.int32)
        ids_BxT[:, :P] = np.asarray(prompt_ids, np.int32)
        key = jax.random.PRNGKey(seed) if key is None else key
        knobs = (np.float32(temperature), np.float32(top_p))  # top-k is baked into the executables
        timings = {} if timings is None else timings
        for name in ("prefill_s", "decode_s", "prompt_tokens", "decode_tokens"):
            timings.setdefault(name, 0)

        t0 = time.perf_counter()
        token_B, cache = prefill(params, ids_BxT, np.int32(P), key, *knobs)  # (static args dropped)
        for i in range(max_new_tokens):
            if i + 1 < max_new_tokens:  # dispatch the next step before waiting for this token on host
                next_B, cache = step(params, token_B, cache, np.int32(P + i), key, *knobs)
            out = np.asarray(token_B)
            now = time.perf_counter()
            if i == 0:
                timings["prefill_s"] += now - t0
                timings["prompt_tokens"] += P
            else:
                timings["decode_s"] += now - t0
                timings["decode_tokens"] += 1
            t0 = now  # decode time is wall time between tokens on host, the consumer's printing included
            yield out
            if i + 1 < max_new_tokens:
                token_B = next_B


def generate_ids(model: Transformer, params: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                 decoder: Decoder | None = None, **kwargs: Any) -> np.ndarray:
    """All new tokens at once, (batch, max_new_tokens) int32; kwargs as Decoder.stream. Pass a `decoder`
    to reuse its compiled executables across calls."""
    decoder = decoder or Decoder(model)
    steps = list(decoder.stream(params, prompt_ids, max_new_tokens, **kwargs))
    return np.stack(steps, axis=1) if steps else np.zeros((kwargs.get("batch", 1), 0), np.int32)
