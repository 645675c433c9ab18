"""slm.io.checkpoints: the keep policy (newest N plus the best by eval loss) and the check of every save."""


def test_keep_policy_keeps_newest_and_best_by_eval(tmp_path):
    import jax.numpy as jnp

    from slm.io.checkpoints import Checkpointer

    ck = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    losses = {2: 1.5, 5: 2.0}  # step 2 has the best eval loss
    for step in range(1, 7):
        ck.save(step, {"w": jnp.full((4,), step)}, {"step": step}, eval_loss=losses.get(step))
    ck.wait()
    assert sorted(ck.manager.all_steps()) == [2, 5, 6]
    ck.close()


def test_each_save_is_verified_and_a_broken_one_is_loud(tmp_path):
    import jax.numpy as jnp

    from slm.io.checkpoints import Checkpointer

    logs = []
    ck = Checkpointer(str(tmp_path / "ckpt"), keep=3, log=logs.append)
    ck.save(1, {"w": jnp.ones(4)}, {"step": 1})
    ck.save(2, {"w": jnp.ones(4)}, {"step": 2})  # verifies step 1 first
    ck.close()  # verifies step 2
    assert logs == [] and ck.verify(1) is None and ck.verify(2) is None
    ck = Checkpointer(str(tmp_path / "ckpt"), keep=3, log=logs.append)
    ck.save(3, {"w": jnp.ones(4)}, {"step": 99})  # a record that does not match its step
    ck.close()
    assert len(logs) == 1 and "VERIFY FAILED for step 3" in logs[0] and "records step 99" in logs[0]
    # The state tree is compared too: a checkpoint whose state lacks a saved leaf is reported.
    ck = Checkpointer(str(tmp_path / "ckpt"), keep=None, log=logs.append)
    assert ck.verify(2, {"w"}) is None
    assert "lacks 1 saved leaves" in ck.verify(2, {"w", "b"})
    ck.close()


def test_checkpoint_round_trip_is_bit_exact(tmp_path):
    """A trained state with MultiSteps accumulators comes back bit for bit, with its record."""
    import jax
    import numpy as np
    from helpers import fresh_state

    from slm.io.checkpoints import Checkpointer
    from slm.model.sizing import ModelShape
    from slm.model.transformer import Transformer
    from slm.optim.optimizer import make_optimizer
    from slm.train.step import make_train_step

    shape, L = ModelShape(vocab_size=64, n_layers=2, d_model=32, n_heads=1, d_ff=96), 12
    model, tx = Transformer(shape), make_optimizer(accumulation=2)
    state, step = fresh_state(model, tx, L), make_train_step(model, tx)
    ids = np.random.default_rng(0).integers(0, 64, (3, 2, L + 1)).astype(np.int32)
    for b in ids:
        state, _ = step(state, {"input_ids": b[:, :-1], "targets": b[:, 1:]}, np.float32(1e-2))
    ck = Checkpointer(str(tmp_path / "ck"))
    ck.save(3, state, {"step": 3, "tokens": 72})
    ck.wait()
    restored, meta, _ = ck.restore(jax.eval_shape(lambda: state))
    ck.close()
    assert meta == {"step": 3, "tokens": 72}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(state) == jax.tree.structure(restored)
