"""The trainer's optimizer: clipped AdamW (float32 or 8-bit moments) or Muon + AdamW, MultiSteps accumulation, a non-finite guard.

The learning rate is not part of it: the train step multiplies the update by a traced `lr`, so the
trainer can drive the rate by optimizer step *or* by the fraction of a --max-time budget spent
(slm.optim.schedule). The update applied is exactly AdamW's:
p <- p - lr * (adam_direction(clip(g)) + weight_decay * p).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from slm.optim.adam8bit import scale_by_adam_8bit
from slm.optim.muon import partition_muon


def make_optimizer(
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    accumulation: int = 1,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    use_8bit: bool = False,
    optimizer: str = "adamw",
    muon_lr_ratio: float = 1.0,
    muon_mesh: Any = None,
    skip_by: str = "cond",
    chunk_blocks: int | None = None,
) -> optax.GradientTransformation:
    """clip -> Adam direction -> decoupled weight decay (matrices only), skipped whole on a non-finite gradient.

    `optimizer="muon"` (slm.optim.muon) sends the hidden matrices to Muon instead, its direction scaled by
    `muon_lr_ratio` (Muon's peak rate / AdamW's); the rest keeps this AdamW. With `use_8bit` Muon's momentum
    is kept in bfloat16 (2 bytes/param instead of 4). `muon_mesh`: a data-parallel mesh (state replicated on
    each device) whose devices share Muon's Newton-Schulz work instead of each repeating all of it.

    The learning rate is applied by the train step. `use_8bit` stores Adam's moments block-quantized
    (slm.optim.adam8bit: ~2 bytes/param instead of 8). A step whose gradient has a NaN/Inf changes neither
    parameters nor optimizer state (optax.apply_if_finite); the trainer sees it in the step's
    `finite` metric and decides (stop, or skip a bounded number). With accumulation > 1, optax.MultiSteps
    averages `accumulation` micro-batch gradients and emits zero updates in between, so k micro-batches
    equal one batch k times as large; at 1 it is left out, saving its parameter-sized float32 buffer.
    `skip_by`: how the skip is made, "cond" (optax.apply_if_finite) or "where" (`apply_if_finite` below: the
    same state and arithmetic, less memory where XLA cannot fuse across a conditional; the trainer's choice per
    platform is slm.train.builder's). `chunk_blocks`: 8-bit moments updated that many blocks of a leaf at a
    time (slm.optim.adam8bit.in_chunks; None: whole leaves).
    """
    adam = [scale_by_adam_8bit(b1=b1, b2=b2, eps=eps, chunk_blocks=chunk_blocks) if use_8bit
            else optax.scale_by_adam(b1=b1, b2=b2, eps=eps)]
    if weight_decay:
        adam.append(optax.add_decayed_weights(weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    if optimizer == "muon":
        adam = [partition_muon(optax.chain(*adam), muon_lr_ratio, weight_decay, jnp.bfloat16 if use_8bit else None,
                               shard_over=muon_mesh)]
    elif optimizer != "adamw":
        raise ValueError(f"optimizer {optimizer!r}: choose adamw or muon")
    if skip_by not in ("cond", "where"):
        raise ValueError(f"skip_by {skip_by!r}: choose cond or where")
    clip = [optax.clip_by_global_norm(grad_clip)] if grad_clip and grad_clip > 0 else []
    # one flat chain for AdamW: its state's structure is what every checkpoint so far holds
    inner = optax.chain(*clip, *adam)
    tx = apply_if_finite(inner) if skip_by == "where" else optax.apply_if_finite(inner, max_consecutive_errors=2**30)
    if accumulation == 1:
        return tx
    return LazyMultiSteps(tx, every_k_schedule=accumulation)


def apply_if_finite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """optax.apply_if_finite (never giving up: its max_consecutive_errors unbounded), the same state, with the
    choice made by `where` on each leaf instead of a `lax.cond` around the whole inner update: a conditional's
    results are buffers of their own, so XLA could not fuse the update into the parameters' and held every
    parameter's update and new moments at once (8-bit Adam on an H100: 3.3 GB more for Qwen3-0.6B)."""

    def init(params: Any) -> optax.ApplyIfFiniteState:
        return optax.ApplyIfFiniteState(notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True),
                                        total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

    def update(updates: Any, state: optax.ApplyIfFiniteState, params: Any = None) -> tuple[Any, Any]:
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(updates)]))
        new_updates, new_inner = inner.update(updates, state.inner_state, params)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        return jax.tree.map(keep, new_updates, optax.tree.zeros_like(updates)), optax.ApplyIfFiniteState(
            notfinite_count=jnp.where(finite, 0, optax.safe_increment(state.notfinite_count)), last_finite=finite,
            total_notfinite=jnp.where(finite, state.total_notfinite, optax.safe_increment(state.total_notfinite)),
            inner_state=jax.tree.map(keep, new_inner, state.inner_state))

    return optax.GradientTransformation(init, update)


class LazyMultiSteps(optax.MultiSteps):
    """optax.MultiSteps whose inner optimizer runs only on the micro-step that emits an update.

    optax's MultiSteps computes the inner update on every micro-step and keeps it with a `where`, so each
    micro-step paid for a whole optimizer update (Muon's Newton-Schulz, the 8-bit dequantize): at 20M params,
    micro-batch 1 x 64, 1.2 of its 1.5 s (bench/fit_speed.py). Here a `lax.cond` on the emitting micro-step
    runs it once per optimizer step. Same state (optax.MultiStepsState, so checkpoints are unchanged) and,
    on the emitting step, the same arithmetic; no `should_skip_update_fn` (the trainer uses none).

    The train step calls `step_params` instead, which applies the update too and keeps everything in place
    where XLA holds a cond's results apart (compile-only H100, Qwen3-0.6B full fine-tune, 2 micro-batches:
    13,043 -> 7,491 MB with 8-bit state, 11,012 -> 10,073 float32; v5e 20,224 -> 17,941 and 12,638 -> 12,108;
    XLA:CPU the same bytes and speed; 2026-11-30).
    """

    def update(self, updates: Any, state: optax.MultiStepsState, params: Any = None, **extra_args: Any
               ) -> tuple[Any, optax.MultiStepsState]:
        k_steps, acc_grads, emit = self._accumulate(updates, state)

        def apply(acc: Any, inner: Any, params: Any) -> tuple[Any, Any]:
            return self._opt.update(optax.tree.cast_like(acc, updates), inner, params=params, **extra_args)

        def hold(acc: Any, inner: Any, params: Any) -> tuple[Any, Any]:
            shapes = jax.eval_shape(apply, acc, inner, params)[0]
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), inner

        final_updates, inner = jax.lax.cond(emit, apply, hold, acc_grads, state.inner_opt_state, params)
        acc_grads = jax.tree.map(lambda ga: jnp.astype((1 - emit) * ga, self._accumulator_dtype), acc_grads)
        return final_updates, self._advance(state, k_steps, emit, inner, acc_grads)

    def _accumulate(self, grads: Any, state: optax.MultiStepsState) -> tuple[Any, Any, jax.Array]:
        """(this step's k, the running mean of the micro-batches' gradients with `grads` in it, whether it emits)."""
        k_steps = self._every_k_schedule(state.gradient_step)
        acc_grads = jax.tree.map(lambda g, acc: self._acc_update(g, acc, n_acc=state.mini_step), grads,
                                 state.acc_grads)
        return k_steps, acc_grads, state.mini_step == (k_steps - 1)

    @staticmethod
    def _advance(state: optax.MultiStepsState, k_steps: Any, emit: jax.Array, inner: Any, acc_grads: Any
                 ) -> optax.MultiStepsState:
        """The state after a micro-step: the counters moved on, the new inner state and accumulator."""
        return optax.MultiStepsState(
            mini_step=optax.safe_increment(state.mini_step) % k_steps,
            gradient_step=emit * optax.safe_increment(state.gradient_step) + (1 - emit) * state.gradient_step,
            inner_opt_state=inner, acc_grads=acc_grads, skip_state=state.skip_state)

    def step_params(self, grads: Any, state: optax.MultiStepsState, params: Any,
                    apply: Callable[[Any, Any], Any]) -> tuple[Any, optax.MultiStepsState]:
        """(new params, new state): `update` and `apply(params, updates)` in one, the inner optimizer run in a
        while loop of one trip on the emitting micro-step and none otherwise. A loop's carry is one buffer
        from start to end, so the parameters, the inner state and the accumulator are updated where they lie;
        a cond's results would be buffers of their own. The accumulator rides in the carry and is zeroed by
        the trip, so the running mean is written into its own buffer too."""
        k_steps, acc_grads, emit = self._accumulate(grads, state)
        acc_grads = jax.tree.map(lambda a: jnp.astype(a, self._accumulator_dtype), acc_grads)  # the carry's dtype

        def trip(_: Any, carry: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
            params, inner, acc = carry
            updates, inner = self._opt.update(optax.tree.cast_like(acc, grads), inner, params=params)
            return apply(params, updates), inner, jax.tree.map(jnp.zeros_like, acc)

        params, inner, acc_grads = jax.lax.fori_loop(0, emit.astype(jnp.int32), trip,
                                                     (params, state.inner_opt_state, acc_grads))
        return params, self._advance(state, k_steps, emit, inner, acc_grads)
