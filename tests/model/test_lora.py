"""LoRA adapters (slm.model.lora): step 0 is the base model, only adapters get gradients, folding equals applying,
and each Hugging Face target adds to its own columns only; masked targets carry no gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slm.model.lora import LoraSpec, fold, merge, split
from slm.model.sizing import ModelShape, lora_params
from slm.model.transformer import Transformer, init_params, mean_nll, token_nll
from slm.optim.optimizer import make_optimizer
from slm.train.step import init_state, make_train_step

SHAPE = ModelShape(n_layers=2, d_model=32, n_heads=4, d_ff=48, vocab_size=64, n_kv_heads=2, head_size=8, qkv_bias=True,
                   tie_embeddings=False)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _ids(seed: int = 0, shape=(2, 16)) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 0, SHAPE.vocab_size)


def _randomised_b(adapters: dict, seed: int = 1) -> dict:
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ALL])
def test_adapters_start_at_the_base_and_fold_exactly(targets):
    lora = LoraSpec(rank=4, alpha=8.0, targets=targets)
    plain, tuned = Transformer(SHAPE), Transformer(SHAPE, lora=lora)
    params = init_params(tuned, 0, 16)
    base, adapters = split(params)
    assert sum(x.size for x in jax.tree.leaves(adapters)) == lora_params(SHAPE, 4, targets)
    ids = _ids()
    want = plain.apply({"params": base}, ids)
    np.testing.assert_allclose(tuned.apply({"params": params}, ids), want, atol=1e-6)  # B = 0: the base exactly
    moved = merge(base, _randomised_b(adapters))
    got = tuned.apply({"params": moved}, ids)
    assert float(jnp.abs(got - want).max()) > 1e-3  # the adapters do something
    np.testing.assert_allclose(plain.apply({"params": fold(moved, SHAPE, lora)}, ids), got, atol=2e-5)
    np_folded = fold(jax.tree.map(np.asarray, moved), SHAPE, lora)  # the numpy path export uses
    np.testing.assert_allclose(plain.apply({"params": np_folded}, ids), got, atol=2e-5)


def test_each_target_changes_only_its_own_columns():
    lora = LoraSpec(rank=2, targets=("k_proj",))
    params = init_params(Transformer(SHAPE, lora=lora), 0, 16)
    base, adapters = split(params)
    folded = fold(merge(base, _randomised_b(adapters)), SHAPE, lora)
    diff = np.abs(np.asarray(folded["block_0"]["attn"]["qkv"]["kernel"] - base["block_0"]["attn"]["qkv"]["kernel"]))
    H, G, K = SHAPE.n_heads, SHAPE.kv_heads, SHAPE.head_dim
    assert diff[:, :H * K].max() == 0 and diff[:, (H + G) * K:].max() == 0 and diff[:, H * K:(H + G) * K].max() > 0


def test_lora_step_trains_adapters_only_and_dropout_is_seeded():
    lora = LoraSpec(rank=4, alpha=8.0, dropout=0.1)
    model = Transformer(SHAPE, lora=lora)
    base, adapters = split(init_params(model, 0, 16))
    base = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)  # a low-precision frozen base
    tx = make_optimizer(0.0, 1.0)
    state = init_state(jax.tree.map(jnp.copy, adapters), tx)  # the step donates its state
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(tx.init(adapters))  # no state for the base
    step = make_train_step(model, tx, seed=3)
    ids = _ids(2, (4, 17))
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    losses = []
    for _ in range(8):
        state, m = step(state, batch, jnp.float32(5e-2), base)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 0.05  # the adapters learn
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    again = init_state(jax.tree.map(jnp.copy, adapters), tx)
    for _ in range(8):
        again, _ = make_train_step(model, tx, seed=3)(again, batch, jnp.float32(5e-2), base)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(again.params)):
        np.testing.assert_array_equal(a, b)  # dropout masks come from (seed, micro_step): a resume repeats them


def test_masked_targets_get_zero_gradient():
    model = Transformer(SHAPE)
    params = init_params(model, 0, 16)
    ids = _ids(4, (2, 17))
    x, y = ids[:, :-1], ids[:, 1:]
    keep = jnp.arange(16)[None, :] >= 6  # the first 6 targets are the prompt's
    masked = jnp.where(keep, y, -1)

    def loss(p, targets):
        return mean_nll(token_nll(model, p, x, targets), targets)

    g = jax.grad(loss)(params, masked)
    other = jnp.where(keep, y, (y + 7) % SHAPE.vocab_size)  # change what the masked positions would have asked
    g_other = jax.grad(loss)(params, jnp.where(keep, other, -1))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_other)):
        np.testing.assert_array_equal(a, b)
    # the masked loss is the mean over response tokens only
    nll = token_nll(model, params, x, y)
    assert float(loss(params, masked)) == pytest.approx(float(nll[:, 6:].mean()), rel=1e-6)


def test_bf16_products_give_the_adapters_the_float32_gradients_within_bf16_rounding():
    """Under --matmul-precision bfloat16 the adapters' products take bf16 operands (slm.model.matmul.linear):
    their output and gradients equal the float32 model's (float32 operands) within bf16 rounding."""
    lora = LoraSpec(rank=4, alpha=8.0, targets=ALL)
    f32, bf16 = Transformer(SHAPE, lora=lora), Transformer(SHAPE, lora=lora, matmul="bfloat16")
    base, adapters = split(init_params(f32, 0, 16))
    adapters = _randomised_b(adapters)
    ids = _ids(5, (2, 17))

    def loss(model):
        return lambda a: mean_nll(token_nll(model, merge(base, a), ids[:, :-1], ids[:, 1:]), ids[:, 1:])

    want, got = jax.grad(loss(f32))(adapters), jax.grad(loss(bf16))(adapters)
    assert float(loss(bf16)(adapters)) == pytest.approx(float(loss(f32)(adapters)), rel=1e-2)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert float(jnp.abs(w).max()) > 0
        np.testing.assert_allclose(g, w, atol=3e-2 * float(jnp.abs(w).max()))
