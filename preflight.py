"""Memory pre-flight: compile the train step before the first batch, read XLA's memory analysis, predict peaks.

The plan puts the pure-Python estimate (memory_estimate.py) beside XLA's own figure for the compiled
step, predicts the run's peak host RSS and device memory, and says whether it fits the device and
--memory-budget. The trainer runs the compiled executable it returns, so pre-flight costs no extra compile.
"""

from __future__ import annotations

import os
import time

import numpy as np

from memory_estimate import FRAMEWORK_MB, MB
from streaming_data_loader import estimate_memory_usage


def available_host_mb() -> float | None:
    """MemAvailable plus this process's RSS (what the run could grow into), or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 1024
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB
        return avail + rss
    except (OSError, StopIteration, ValueError):
        return None


def compile_plan(c, shape, data_mb: float, budget_bytes: int | None) -> dict:
    """Compile the step for config `c` (a train_optimized.Config) and return the memory plan."""
    import jax
    import jax.numpy as jnp

    from devices import data_mesh, shardings, state_shardings
    from model import Transformer, init_params
    from train_step import init_state, make_optimizer, make_train_step

    # The trainer makes up one host device per core for speed; any other device count is the user's.
    strict = jax.process_count() > 1 or jax.devices()[0].platform != "cpu" or bool(getattr(c, "cpu_devices", None))
    mesh = data_mesh(c.batch_size, strict=strict)
    _, batch_sharded = shardings(mesh)
    n_dev, platform = int(mesh.devices.size), mesh.devices.flat[0].platform
    model = Transformer(shape, dtype=jnp.bfloat16 if c.use_mixed_precision else jnp.float32, remat=c.gradient_checkpointing)
    tx = make_optimizer(c.weight_decay, c.grad_clip, c.gradient_accumulation_steps, use_8bit=c.use_8bit_optimizer)
    state = jax.eval_shape(lambda: init_state(init_params(model, c.seed, c.seq_len), tx))
    state_sharding = state_shardings(state, mesh, getattr(c, "sharding", "dp"))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, state_sharding)
    batch = {k: jax.ShapeDtypeStruct((c.batch_size, c.seq_len), jnp.int32, sharding=batch_sharded)
             for k in ("input_ids", "targets")}
    t0 = time.time()
    compiled = make_train_step(model, tx, state_sharding, batch_sharded).lower(state, batch, np.float32(0)).compile()
    compile_s = time.time() - t0
    m = compiled.memory_analysis()
    compiled_mb = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes) / MB

    est = estimate_memory_usage(0, c.seq_len, c.batch_size, c.shuffle_buffer_size, shape=shape,
                                mixed_precision=c.use_mixed_precision, use_8bit_optimizer=c.use_8bit_optimizer,
                                gradient_accumulation_steps=c.gradient_accumulation_steps,
                                gradient_checkpointing=c.gradient_checkpointing, streaming=c.use_streaming,
                                devices=n_dev, platform=platform, sharding=getattr(c, "sharding", "dp"))
    local = sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index())  # this host's share
    on_host = local * compiled_mb if platform == "cpu" else 0.0
    rss_mb = FRAMEWORK_MB + data_mb + on_host
    if platform == "cpu":
        predicted, what = rss_mb, "peak host RSS"
        limit = available_host_mb()
    else:
        predicted, what = compiled_mb, "device memory"
        stats = mesh.devices.flat[0].memory_stats() or {}
        limit = stats["bytes_limit"] / MB if "bytes_limit" in stats else None
    refusal = None
    if limit is not None and predicted > limit:
        refusal = (f"this run needs ~{predicted:,.0f} MB of {what} but the {platform} has {limit:,.0f} MB available; "
                   f"try --use-8bit-optimizer, a smaller --batch-size with more --gradient-accumulation-steps, "
                   f"or --memory-budget {limit * 0.9 / 1024:.1f}GB --auto-fit")
    elif budget_bytes is not None and predicted * MB > budget_bytes:
        refusal = (f"--memory-budget {budget_bytes / MB:,.0f} MB: this run needs ~{predicted:,.0f} MB of {what} "
                   f"(compiled step {compiled_mb:,.0f} MB/device x {n_dev}); add --auto-fit, or try "
                   f"--use-8bit-optimizer / a smaller --batch-size with more --gradient-accumulation-steps")
    est["data_pipeline_mb"] = round(data_mb, 3)
    return {"mesh": mesh, "compiled": compiled, "state_sharding": state_sharding, "model": model, "tx": tx, "compile_s": compile_s, "estimate": est, "platform": platform,
            "devices": n_dev, "compiled_device_mb": compiled_mb, "estimated_device_mb": est["device_total_mb"],
            "estimated_peak_rss_mb": rss_mb, "predicted_peak_mb": predicted, "limit_mb": limit,
            "what": what, "refusal": refusal}


def describe_plan(plan: dict) -> list[str]:
    """The plan as log lines: the breakdown, XLA's figure, the predicted peaks."""
    e = plan["estimate"]
    parts = ", ".join(f"{k[:-3].replace('_', ' ')} {e[k]:,.1f}" for k in
                      ("params_mb", "gradients_mb", "optimizer_state_mb", "accumulation_mb", "activations_mb", "logits_mb"))
    lines = [f"[memory] per device (MB, estimate): {parts}; total {e['device_total_mb']:,.1f} "
             f"| XLA's compiled step: {plan['compiled_device_mb']:,.1f} MB/device x {plan['devices']} "
             f"(compiled in {plan['compile_s']:.1f}s)",
             f"[memory] predicted peak host RSS {plan['estimated_peak_rss_mb']:,.0f} MB (framework {FRAMEWORK_MB:,.0f} "
             f"+ data {e['data_pipeline_mb']:,.1f}"
             + (f" + devices {plan['devices'] * plan['compiled_device_mb']:,.0f}" if plan["platform"] == "cpu" else "")
             + ")" + (f"; device memory {plan['compiled_device_mb']:,.0f} MB" if plan["platform"] != "cpu" else "")
             + (f"; available {plan['limit_mb']:,.0f} MB" if plan["limit_mb"] else "")]
    return lines
