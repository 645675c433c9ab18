"""The trainer's optimizer: clipped AdamW (float32 or 8-bit moments), MultiSteps accumulation, a non-finite guard.

The learning rate is not part of it: the train step multiplies the update by a traced `lr`, so the
trainer can drive the rate by optimizer step *or* by the fraction of a --max-time budget spent
(slm.optim.schedule). The update applied is exactly AdamW's:
p <- p - lr * (adam_direction(clip(g)) + weight_decay * p).
"""

from __future__ import annotations

import jax
import optax

from slm.optim.adam8bit import scale_by_adam_8bit


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
    (slm.optim.adam8bit: ~2 bytes/param instead of 8). A step whose gradient has a NaN/Inf changes neither
    parameters nor optimizer state (optax.apply_if_finite); the trainer sees it in the step's
    `finite` metric and decides (stop, or skip a bounded number). With accumulation > 1, optax.MultiSteps
    averages `accumulation` micro-batch gradients and emits zero updates in between, so k micro-batches
    equal one batch k times as large; at 1 it is left out, saving its parameter-sized float32 buffer.
    """
    parts = []
    if grad_clip and grad_clip > 0:
        parts.append(optax.clip_by_global_norm(grad_clip))
    if use_8bit:
        parts.append(scale_by_adam_8bit(b1=b1, b2=b2, eps=eps))
    else:
        parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    tx = optax.apply_if_finite(optax.chain(*parts), max_consecutive_errors=2**30)
    return optax.MultiSteps(tx, every_k_schedule=accumulation) if accumulation > 1 else tx
