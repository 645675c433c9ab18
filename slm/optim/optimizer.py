"""The trainer's optimizer: clipped AdamW (float32 or 8-bit moments) or Muon + AdamW, MultiSteps accumulation, a non-finite guard.

The learning rate is not part of it: the train step multiplies the update by a traced `lr`, so the
trainer can drive the rate by optimizer step *or* by the fraction of a --max-time budget spent
(slm.optim.schedule). The update applied is exactly AdamW's:
p <- p - lr * (adam_direction(clip(g)) + weight_decay * p).
"""

from __future__ import annotations

from typing import Any

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
    """
    adam = [scale_by_adam_8bit(b1=b1, b2=b2, eps=eps) if use_8bit else optax.scale_by_adam(b1=b1, b2=b2, eps=eps)]
    if weight_decay:
        adam.append(optax.add_decayed_weights(weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    if optimizer == "muon":
        adam = [partition_muon(optax.chain(*adam), muon_lr_ratio, weight_decay, jnp.bfloat16 if use_8bit else None,
                               shard_over=muon_mesh)]
    elif optimizer != "adamw":
        raise ValueError(f"optimizer {optimizer!r}: choose adamw or muon")
    clip = [optax.clip_by_global_norm(grad_clip)] if grad_clip and grad_clip > 0 else []
    # one flat chain for AdamW: its state's structure is what every checkpoint so far holds
    tx = optax.apply_if_finite(optax.chain(*clip, *adam), max_consecutive_errors=2**30)
    return optax.MultiSteps(tx, every_k_schedule=accumulation) if accumulation > 1 else tx
