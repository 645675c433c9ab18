"""slm.train.aot.compile_only: a compile-only program never goes through jax's persistent compilation cache, even
after a train() in the same process turned the cache on, and the cache works again after it."""

import jax
import jax.numpy as jnp
from jax.experimental.compilation_cache import compilation_cache

from slm.train.aot import compile_only


def test_compile_only_keeps_the_persistent_cache_out_and_gives_it_back(tmp_path):
    keys = ("jax_compilation_cache_dir", "jax_enable_compilation_cache", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    saved = {k: getattr(jax.config, k) for k in keys}
    try:
        for k, v in zip(keys, (str(tmp_path), True, 0.0, 0)):
            jax.config.update(k, v)
        compilation_cache.reset_cache()

        def entries() -> int:
            return len([p for p in tmp_path.iterdir() if not p.name.startswith(".")])

        def compile_new(n: int) -> None:  # a program the cache has not seen (its shape differs each time)
            jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones((n, 3))).compile()

        compile_new(5)  # as a train() before the plan: jax has now decided that this process uses the cache
        before = entries()
        assert before > 0
        with compile_only():
            compile_new(6)
            assert entries() == before  # nothing written (nor read) while compiling for compile-only devices
        compile_new(7)
        assert entries() > before  # and the cache is back in use
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()
