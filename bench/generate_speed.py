"""Generation speed: KV-cache decoding (slm.model.generate.Decoder) vs a sampler without a cache (make_sampler,
defined here as the baseline: the trainer's eval-time sampler before it used the Decoder).

Random-init models of ~1M and ~10M params (vocab 4096), one sequence, 256 new tokens after a one-token
prompt, temperature 0.8 / top-k 40 in both. Compile time is excluded from both (each is warmed up first);
the cached figure is decode tokens/s with a host fetch per token (what streaming costs), the no-cache
figure is the whole jitted fori_loop. Best of --reps.
Run: .venv/bin/python bench/generate_speed.py [--targets 1000000 10000000] [--new-tokens 256]
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from slm.model.generate import Decoder
from slm.model.sizing import choose_shape, count_params
from slm.model.transformer import Transformer, init_params


def make_sampler(model, seq_len: int, temperature: float = 0.8, top_k: int = 40):
    """jit(params, ids (1, seq_len), prompt_len, key): every new token reruns the whole fixed window."""
    def sample(params, ids, prompt_len, key):
        def body(pos, carry):
            ids, key = carry
            key, sub = jax.random.split(key)
            logits = model.apply({"params": params}, ids)[0, pos - 1] / temperature
            kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][-1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
            return ids.at[0, pos].set(jax.random.categorical(sub, logits).astype(ids.dtype)), key

        return jax.lax.fori_loop(prompt_len, seq_len, body, (ids, key))[0]

    return jax.jit(sample)

def cached_tokens_per_s(model, params, new_tokens: int, reps: int) -> float:
    decoder = Decoder(model)
    decoder.compiled(params, 1, 1, new_tokens)
    best = 0.0
    for r in range(reps + 1):  # the first pass warms up (first execution, allocator)
        timings: dict = {}
        for _ in decoder.stream(params, [0], new_tokens, temperature=0.8, top_k=40, seed=r, timings=timings):
            pass
        # the first token comes from the prefill; count it and its time too, as the no-cache figure does
        rate = new_tokens / (timings["prefill_s"] + timings["decode_s"])
        best = max(best, rate) if r else best
    return best


def nocache_tokens_per_s(model, params, new_tokens: int, reps: int) -> float:
    seq_len = 1 + new_tokens
    sampler = make_sampler(model, seq_len, temperature=0.8, top_k=40)
    ids = np.zeros((1, seq_len), np.int32)
    sampler(params, ids, 1, jax.random.PRNGKey(0)).block_until_ready()  # compile + warm up
    best = 0.0
    for r in range(reps):
        t = time.perf_counter()
        sampler(params, ids, 1, jax.random.PRNGKey(r + 1)).block_until_ready()
        best = max(best, new_tokens / (time.perf_counter() - t))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    print(f"{jax.devices()[0].platform}, {os.cpu_count()} cores, {args.new_tokens} new tokens, best of {args.reps}")
    for target in args.targets:
        shape = choose_shape(target, 4096)
        model = Transformer(shape)
        params = init_params(model, 0, 8)
        cached = cached_tokens_per_s(model, params, args.new_tokens, args.reps)
        nocache = nocache_tokens_per_s(model, params, args.new_tokens, args.reps)
        print(f"{count_params(shape) / 1e6:5.2f}M params ({shape.n_layers}x{shape.d_model}): "
              f"KV cache {cached:8,.1f} tokens/s | no cache (make_sampler) {nocache:8,.1f} tokens/s | "
              f"ratio {cached / nocache:5.1f}x", flush=True)


if __name__ == "__main__":
    main()
