"""--use-8bit-optimizer in the trainer: checkpoints, MultiSteps + bf16, compiled memory, held-out loss."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fresh_state

import slm.optim.adam8bit as adam8bit
from slm.io.checkpoints import Checkpointer
from slm.model.sizing import choose_shape
from slm.model.transformer import Transformer, init_params
from slm.optim.optimizer import make_optimizer
from slm.train.builder import compiled_memory
from slm.train.step import init_state, make_train_step
from train_optimized import Config, train


def _batch(shape, batch=4, seq=32, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.integers(0, shape.vocab_size, (batch, seq), dtype=np.int32) for k in ("input_ids", "targets")}


@pytest.mark.slow
def test_checkpoint_round_trip_is_bit_exact(tmp_path):
    shape = choose_shape(200_000, 512)
    model, tx = Transformer(shape), make_optimizer(use_8bit=True)
    state = fresh_state(model, tx, 32)
    step = make_train_step(model, tx)
    for i in range(3):
        state, _ = step(state, _batch(shape, seed=i), np.float32(3e-3))
    ck = Checkpointer(str(tmp_path / "ckpt"))
    ck.save(3, state, {"step": 3})
    ck.wait()
    restored, meta, _ = ck.restore(jax.eval_shape(lambda: state))
    ck.close()
    assert meta["step"] == 3
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    codes = [x for x in jax.tree.leaves(restored.opt_state) if x.dtype == jnp.uint8]
    assert len(codes) > 0 and any(int(jnp.max(c)) > 0 for c in codes)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # A restored run continues exactly as the original would.
    s1, m1 = step(state, _batch(shape, seed=9), np.float32(3e-3))
    s2, m2 = step(restored, _batch(shape, seed=9), np.float32(3e-3))
    assert float(m1["loss"]) == float(m2["loss"])
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.slow
def test_composes_with_multisteps_bf16_clipping_and_decay():
    shape = choose_shape(200_000, 512)
    model, tx = Transformer(shape, dtype=jnp.bfloat16), make_optimizer(0.1, 1.0, accumulation=2, use_8bit=True)
    state = fresh_state(model, tx, 32)
    step = make_train_step(model, tx)
    before = jax.tree.map(np.asarray, state.params)
    state, m = step(state, _batch(shape, seed=0), np.float32(3e-3))  # micro-step 1 of 2: no update yet
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    state, m = step(state, _batch(shape, seed=1), np.float32(3e-3))
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)))
    adam_state = state.opt_state.inner_opt_state.inner_state[1]
    assert isinstance(adam_state, adam8bit.ScaleByAdam8bitState) and int(adam_state.count) == 1
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(state.params))  # float32 master weights
    assert bool(m["finite"]) and np.isfinite(float(m["loss"]))


@pytest.mark.slow
def test_compiled_step_peak_memory_is_below_fp32_adamw():
    """XLA's memory analysis of the trainer's step at the default 1M shape (seq 128, batch 32)."""
    shape = choose_shape(1_000_000, 1024)
    model = Transformer(shape)
    batch = jax.eval_shape(lambda: {k: jnp.zeros((32, 128), jnp.int32) for k in ("input_ids", "targets")})
    peaks = {}
    for use_8bit in (False, True):
        tx = make_optimizer(use_8bit=use_8bit)
        state = jax.eval_shape(lambda: init_state(init_params(model, 0, 128), tx))
        peaks[use_8bit] = compiled_memory(make_train_step(model, tx), state, batch, jnp.float32(1e-3))["peak"]
    saved = peaks[False] - peaks[True]
    assert saved > 0
    # At least the 6 bytes/param of state saved, minus a little: the update's temporaries are no larger.
    assert saved >= 0.9 * 6 * 996_480


def _run(tmp_path, data_dir, name, seed, use_8bit):
    c = Config(use_streaming=True, dataset_id=str(data_dir / "tinyshakespeare_train.txt"),
               eval_dataset_id=str(data_dir / "tinyshakespeare_val.txt"), target_params=200_000, seq_len=64,
               batch_size=16, max_steps=300, seed=seed, use_8bit_optimizer=use_8bit, eval_every=10**6, optimizer="adamw",
               log_every=50, checkpoint_every=10**6, output_dir=str(tmp_path / f"{name}-{seed}"))
    return train(c, log=lambda *_: None)


@pytest.mark.slow
def test_heldout_loss_matches_fp32_and_a_linear_map_does_not(tmp_path, data_dir, monkeypatch):
    """Issue 3's loss criterion at CI size, with its tighter arm only: |8-bit - fp32| <= 1% of fp32's loss
    (issue 3 allows max(1%, 2 x the fp32 seed spread); bench/optimizer_8bit.py --loss measures the spread over
    seeds). The same 8-bit code on linear maps fails it (a negative control)."""
    fp32 = _run(tmp_path, data_dir, "fp32", 0, False)["eval_loss"]
    q8 = _run(tmp_path, data_dir, "q8", 0, True)
    monkeypatch.setattr(adam8bit, "dynamic_map", lambda signed, zero_free=False: adam8bit.linear_map(signed))
    linear = _run(tmp_path, data_dir, "linear", 0, True)["eval_loss"]
    bound = 0.01 * fp32
    assert abs(q8["eval_loss"] - fp32) <= bound, (q8["eval_loss"], fp32, bound)
    assert linear - fp32 > bound, (linear, fp32, bound)
    assert q8["optimizer_state_bytes"] <= 0.30 * json.load(open(tmp_path / "fp32-0" / "summary.json"))["optimizer_state_bytes"]
