"""The train state and the jitted train and eval steps: pure functions over explicit pytree state.

The learning rate is an argument of the jitted step rather than an optax schedule, so the trainer can
drive it by optimizer step *or* by the fraction of a --max-time budget spent (slm.optim.schedule).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from slm.model.lora import merge
from slm.model.transformer import Transformer, mean_nll, token_nll
from slm.optim.optimizer import LazyMultiSteps

PyTree = Any


@flax.struct.dataclass
class TrainState:
    micro_step: jax.Array  # micro-batches seen; optimizer step = micro_step // accumulation
    params: PyTree
    opt_state: PyTree


def init_state(params: PyTree, tx: optax.GradientTransformation) -> TrainState:
    """Step 0: the parameters and the optimizer's fresh state."""
    return TrainState(micro_step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def make_train_step(model: Transformer, tx: optax.GradientTransformation, state_sharding: PyTree = None,
                    batch_sharding: Any = None, base_sharding: PyTree = None, seed: int = 0):
    """jit(state, batch, lr) -> (state, metrics); the old state's buffers are donated.

    With shardings (slm.train.devices.state_shardings / the mesh's batch sharding) the step's inputs and outputs
    are pinned to them: the state leaves the step laid out as it came in (replicated for DP, split for
    FSDP) and the metrics are replicated scalars.

    With LoRA (`model.lora`) it is jit(state, batch, lr, base): `state.params` are the adapters, the only
    thing differentiated and updated; the frozen `base` is an input (never donated, no gradient, no
    optimizer state). Dropout (--dropout, LoRA's) draws its masks from (seed, micro_step), so a resumed run
    repeats them.
    """
    dropout = model.dropout > 0 or (model.lora is not None and model.lora.dropout > 0)

    def loss_fn(trainable: PyTree, batch: dict, base: PyTree, rng: Any) -> jax.Array:
        params = trainable if base is None else merge(base, trainable)
        return mean_nll(token_nll(model, params, batch["input_ids"], batch["targets"], rng), batch["targets"])

    def step(state: TrainState, batch: dict, lr: jax.Array, base: PyTree = None) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(jax.random.PRNGKey(seed), state.micro_step) if dropout else None
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, base, rng)

        def apply(params: PyTree, updates: PyTree) -> PyTree:
            return jax.tree.map(lambda p, u: p - lr * u.astype(p.dtype), params, updates)

        if isinstance(tx, LazyMultiSteps):  # accumulating: the update applied where the parameters lie
            params, opt_state = tx.step_params(grads, state.opt_state, state.params, apply)
        else:
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = apply(state.params, updates)
        new_state = TrainState(micro_step=state.micro_step + 1, params=params, opt_state=opt_state)
        grad_norm = optax.tree.norm(grads)
        return new_state, {"loss": loss, "grad_norm": grad_norm, "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm)}

    if state_sharding is None:
        return jax.jit(step, donate_argnums=0)
    replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
    ins = (state_sharding, batch_sharding, replicated) + ((base_sharding,) if model.lora is not None else ())
    return jax.jit(step, donate_argnums=0, in_shardings=ins, out_shardings=(state_sharding, replicated))


def make_flush_step(tx: optax.MultiSteps, state_sharding: PyTree = None, batch_sharding: Any = None):
    """jit(state, lr) -> state: apply a partial accumulation (the data ran out after m < k micro-batches).

    MultiSteps holds the running mean of the m gradients; this takes the optimizer step on that mean (a
    step on a batch m/k as large) and resets the accumulator, instead of dropping those micro-batches.
    """

    def flush(state: TrainState, lr: jax.Array) -> TrainState:
        ms = state.opt_state
        updates, inner = tx.inner_opt.update(ms.acc_grads, ms.inner_opt_state, state.params)
        params = jax.tree.map(lambda p, u: p - lr * u.astype(p.dtype), state.params, updates)
        opt_state = ms._replace(mini_step=jnp.zeros_like(ms.mini_step), gradient_step=ms.gradient_step + 1,
                                inner_opt_state=inner, acc_grads=jax.tree.map(jnp.zeros_like, ms.acc_grads))
        return TrainState(micro_step=state.micro_step, params=params, opt_state=opt_state)

    if state_sharding is None:
        return jax.jit(flush, donate_argnums=0)
    replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
    return jax.jit(flush, donate_argnums=0, in_shardings=(state_sharding, replicated), out_shardings=state_sharding)


def make_eval_step(model: Transformer):
    """jit(params, ids, targets, mask) -> (sum of nats over mask, number of tokens); targets < 0 (prompt
    tokens of instruction data) are not scored. With LoRA, `params` is base and adapters merged."""

    def step(params: PyTree, ids: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        nll = token_nll(model, params, ids, targets)
        mask = mask * (targets >= 0)
        return jnp.sum(nll * mask), jnp.sum(mask)

    return jax.jit(step)
