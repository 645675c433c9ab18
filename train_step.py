"""Optimizer, train step, eval step and sampler: pure functions over explicit pytree state (jax/flax/optax only).

The learning rate is an argument of the jitted step rather than an optax schedule, so the trainer can
drive it by optimizer step *or* by the fraction of a --max-time budget spent; the update applied is
exactly AdamW's:  p <- p - lr * (adam_direction(clip(g)) + weight_decay * p).
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from model import Transformer, token_nll

PyTree = Any


@flax.struct.dataclass
class TrainState:
    micro_step: jax.Array  # micro-batches seen; optimizer step = micro_step // accumulation
    params: PyTree
    opt_state: PyTree


def make_optimizer(
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    accumulation: int = 1,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    use_8bit: bool = False,
) -> optax.GradientTransformation:
    """clip -> Adam direction -> decoupled weight decay (matrices only), skipped whole on a non-finite gradient.

    The learning rate is applied by the train step. `use_8bit` stores Adam's moments block-quantized
    (adam8bit.py: ~2 bytes/param instead of 8). A step whose gradient has a NaN/Inf changes neither
    parameters nor optimizer state (optax.apply_if_finite); the trainer sees it in the step's
    `finite` metric and decides (stop, or skip a bounded number). With accumulation > 1, optax.MultiSteps
    averages `accumulation` micro-batch gradients and emits zero updates in between, so k micro-batches
    equal one batch k times as large; at 1 it is left out, saving its parameter-sized float32 buffer.
    """
    parts = []
    if grad_clip and grad_clip > 0:
        parts.append(optax.clip_by_global_norm(grad_clip))
    if use_8bit:
        from adam8bit import scale_by_adam_8bit

        parts.append(scale_by_adam_8bit(b1=b1, b2=b2, eps=eps))
    else:
        parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    tx = optax.apply_if_finite(optax.chain(*parts), max_consecutive_errors=2**30)
    return optax.MultiSteps(tx, every_k_schedule=accumulation) if accumulation > 1 else tx


def lr_at(progress: float, step: int, peak: float, warmup_steps: int, final_frac: float = 0.1,
          warmup_end: float = 0.0) -> float:
    """Linear warmup over `warmup_steps` optimizer steps, then cosine from peak to final_frac * peak.

    `progress` in [0, 1] is the fraction of the run done (by steps, tokens or wall time); the cosine
    runs over what is left after `warmup_end`, the progress at which warmup finished, so the rate is
    continuous at the end of warmup.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    p = (progress - warmup_end) / max(1.0 - warmup_end, 1e-9)
    p = min(max(p, 0.0), 1.0)
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def init_state(params: PyTree, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(micro_step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def make_train_step(model: Transformer, tx: optax.GradientTransformation, state_sharding: PyTree = None,
                    batch_sharding: Any = None):
    """jit(state, batch, lr) -> (state, metrics); the old state's buffers are donated.

    With shardings (devices.state_shardings / the mesh's batch sharding) the step's inputs and outputs
    are pinned to them: the state leaves the step laid out as it came in (replicated for DP, split for
    FSDP) and the metrics are replicated scalars.
    """

    def loss_fn(params: PyTree, batch: dict) -> jax.Array:
        return token_nll(model, params, batch["input_ids"], batch["targets"]).mean()

    def step(state: TrainState, batch: dict, lr: jax.Array) -> tuple[TrainState, dict]:
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = jax.tree.map(lambda p, u: p - lr * u.astype(p.dtype), state.params, updates)
        new_state = TrainState(micro_step=state.micro_step + 1, params=params, opt_state=opt_state)
        grad_norm = optax.tree.norm(grads)
        return new_state, {"loss": loss, "grad_norm": grad_norm, "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm)}

    if state_sharding is None:
        return jax.jit(step, donate_argnums=0)
    replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
    return jax.jit(step, donate_argnums=0, in_shardings=(state_sharding, batch_sharding, replicated),
                   out_shardings=(state_sharding, replicated))


def make_eval_step(model: Transformer):
    """jit(params, ids, targets, mask) -> (sum of nats over mask, number of tokens)."""

    def step(params: PyTree, ids: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        nll = token_nll(model, params, ids, targets)
        return jnp.sum(nll * mask), jnp.sum(mask)

    return jax.jit(step)


def make_sampler(model: Transformer, seq_len: int, temperature: float = 0.8, top_k: int = 40):
    """jit(params, ids (1, seq_len), prompt_len, key) -> ids with positions >= prompt_len sampled.

    No KV cache: each new token reruns the fixed-length window (causal, so padding to the right is
    ignored). Cheap at the sizes this trainer samples at eval time.
    """

    def sample(params: PyTree, ids: jax.Array, prompt_len: jax.Array, key: jax.Array) -> jax.Array:
        def body(pos, carry):
            ids, key = carry
            key, sub = jax.random.split(key)
            logits = model.apply({"params": params}, ids)[0, pos - 1] / temperature
            kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][-1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
            token = jax.random.categorical(sub, logits).astype(ids.dtype)
            return ids.at[0, pos].set(token), key

        ids, _ = jax.lax.fori_loop(prompt_len, seq_len, body, (ids, key))
        return ids

    return jax.jit(sample)
