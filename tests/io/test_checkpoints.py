"""slm.io.checkpoints: the keep policy (newest N plus the best by eval loss), the check of every save, the
manifest that finds a damaged checkpoint before a resume loads it, and a full disk in one line."""

import pytest


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


def test_each_save_is_verified_and_a_broken_one_is_set_aside_with_a_line(tmp_path):
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
    assert len(logs) == 1 and "step 3 FAILED its check after writing (records step 99)" in logs[0]
    assert "moved aside to 3.damaged" in logs[0]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1", "2", "3.damaged"]
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


def _state(step):
    import jax.numpy as jnp

    return {"w": jnp.arange(4096, dtype=jnp.float32) * step, "b": jnp.full((16,), step, jnp.bfloat16)}


def _save_three(directory, **kw):
    """Checkpoints 1, 2, 3 of a small state, each with a loader record, committed and closed."""
    from slm.io.checkpoints import Checkpointer

    ck = Checkpointer(str(directory), keep=3, **kw)
    for step in (1, 2, 3):
        ck.save(step, _state(step), {"step": step, "tokens": 10 * step}, loader={"buffer": ["some text"] * 50 * step})
    ck.close()


def _largest_state_file(ckpt):
    files = [p for p in (ckpt / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {  # what a full disk, a bad copy or a dying drive leaves in a checkpoint
    "truncated state array": lambda c: _truncate(_largest_state_file(c)),
    "bit-flipped state array": lambda c: _flip_a_bit(_largest_state_file(c)),
    "truncated loader JSON": lambda c: _truncate(c / "loader" / "metadata"),
    "bit-flipped loader JSON": lambda c: _flip_a_bit(c / "loader" / "metadata"),
    "bit-flipped meta record": lambda c: _flip_a_bit(c / "meta" / "metadata"),
    "a file gone": lambda c: (c / "state" / "_METADATA").unlink(),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_restored(tmp_path, damage):
    """--resume's choice: the newest checkpoint that matches its manifest. The damaged one is renamed in one
    line, so it is neither loaded nor pruned later; the one before comes back bit for bit."""
    import jax
    import numpy as np

    from slm.io.checkpoints import Checkpointer

    directory = tmp_path / "ckpt"
    _save_three(directory)
    DAMAGE[damage](directory / "3")
    logs = []
    ck = Checkpointer(str(directory), keep=3, log=logs.append)
    assert ck.newest_sound(logs.append) == 2
    assert len(logs) == 1 and logs[0].startswith("[resume] checkpoint 3 is damaged (")
    assert "moved aside to 3.damaged" in logs[0]
    state, meta, loader = ck.restore(jax.eval_shape(lambda: _state(0)), 2)
    assert meta == {"step": 2, "tokens": 20} and len(loader["buffer"]) == 100
    for a, b in zip(jax.tree.leaves(_state(2)), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for step in (3, 4, 5, 6):  # the resumed run saves on; pruning keeps 3 and never touches the damaged one
        ck.save(step, _state(step), {"step": step})
    ck.close()
    assert sorted(p.name for p in directory.iterdir()) == ["3.damaged", "4", "5", "6"]


def test_every_checkpoint_has_a_manifest_and_one_from_before_manifests_is_still_accepted(tmp_path):
    import json

    from slm.io.checkpoints import Checkpointer
    from slm.io.manifest import MANIFEST, check_manifest

    directory = tmp_path / "ckpt"
    _save_three(directory)
    for step in (1, 2, 3):
        files = json.loads((directory / str(step) / MANIFEST).read_text())["files"]
        assert {"meta/metadata", "loader/metadata", "state/_METADATA"} <= set(files)
        assert any(name.startswith("state/ocdbt.process_0/d/") for name in files)
        assert check_manifest(str(directory / str(step))) is None
    (directory / "3" / MANIFEST).unlink()  # as a checkpoint of an older version (or killed right after commit)
    ck = Checkpointer(str(directory), keep=3)
    assert ck.newest_sound(print) == 3
    _truncate(directory / "3" / "meta" / "metadata")  # without a manifest the record is still read back
    assert ck.newest_sound(lambda line: None) == 2
    ck.close()


def test_a_checkpoint_without_a_manifest_whose_data_fails_to_read_is_set_aside_on_restore(tmp_path):
    """A run killed between a commit and its manifest: the restore itself finds the damage."""
    import jax
    import numpy as np

    from slm.io.checkpoints import Checkpointer
    from slm.io.manifest import MANIFEST

    directory = tmp_path / "ckpt"
    _save_three(directory)
    (directory / "3" / MANIFEST).unlink()
    _truncate(_largest_state_file(directory / "3"))
    logs = []
    ck = Checkpointer(str(directory), keep=3)
    state, meta, _ = ck.restore_sound(jax.eval_shape(lambda: _state(0)), logs.append)
    ck.close()
    assert meta["step"] == 2 and np.asarray(state["w"])[1] == 2.0
    assert len(logs) == 1 and logs[0].startswith("[resume] checkpoint 3 is damaged (")
    assert "it had no manifest): moved aside to 3.damaged" in logs[0]


def _disk(free):
    from types import SimpleNamespace

    return lambda path: SimpleNamespace(total=10**12, used=0, free=free[0])


def test_a_save_the_disk_has_no_room_for_is_not_started_and_the_last_checkpoint_is_kept(tmp_path):
    from slm.errors import DiskFullError
    from slm.io.checkpoints import Checkpointer

    free = [10**12]
    ck = Checkpointer(str(tmp_path / "run" / "checkpoints"), keep=1, disk_usage=_disk(free))
    ck.save(1, _state(1), {"step": 1})
    ck.save(2, _state(2), {"step": 2})
    assert sorted(ck.manager.all_steps()) == [1, 2]  # step 1 goes only once step 2 has committed
    ck.wait()
    assert sorted(ck.manager.all_steps()) == [2]
    free[0] = 300_000
    with pytest.raises(DiskFullError, match=r"^checkpoint 3 not saved: the disk of .*/run/checkpoints is full "
                                            r"\(0.3 MB free, the checkpoint needs ~1.0 MB\); newest complete "
                                            r"checkpoint: step 2, kept. Free space, then --resume .*/run$"):
        ck.save(3, _state(3), {"step": 3})
    ck.close()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]


def test_a_write_that_runs_out_of_space_is_removed_and_reported_in_one_line(tmp_path, monkeypatch):
    """The space went after the check (another program): orbax's write fails with tensorstore's error."""
    import os

    from slm.errors import DiskFullError
    from slm.io.checkpoints import Checkpointer

    directory = tmp_path / "ckpt"
    ck = Checkpointer(str(directory), keep=1)
    ck.save(1, _state(1), {"step": 1})
    ck.wait()

    def out_of_space(step, args, force):
        os.makedirs(directory / f"{step}.orbax-checkpoint-tmp" / "state")  # half written
        raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database at local file "{directory}": '
                         f"Failed to write 4096 bytes to file 11: No space left on device [os_error_code='28']")

    monkeypatch.setattr(ck.manager, "save", out_of_space)
    with pytest.raises(DiskFullError, match="^checkpoint 2 not saved: .*newest complete checkpoint: step 1, kept"):
        ck.save(2, _state(2), {"step": 2})
    assert ck.failure is not None
    ck.close()  # no second error: the caller raises ck.failure after the run's summary
    assert sorted(p.name for p in directory.iterdir()) == ["1"]


def test_after_a_full_disk_orbax_echoes_about_its_temporary_dir_are_held_back():
    """asyncio logs an orbax writer's unretrieved FileNotFoundError (the failed save's temporary dir, which the
    Checkpointer removed) after the one-line error; the path is only in the exception's str, not its repr."""
    import logging
    import sys

    from slm.io.checkpoints import _QuietDiskFull

    def record(e: BaseException) -> logging.LogRecord:
        try:
            raise e
        except type(e):
            info = sys.exc_info()
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Future exception was never retrieved\n"
                                 f"future: <Future finished exception={e!r}>", None, info)

    gone = FileNotFoundError(2, "No such file or directory", "/run/checkpoints/10.orbax-checkpoint-tmp/state/x")
    other = FileNotFoundError(2, "No such file or directory", "/somewhere/else")
    quiet = _QuietDiskFull()
    assert quiet.filter(record(gone))  # no full disk seen yet: nothing is held back
    quiet.seen = "No space left on device"
    assert not quiet.filter(record(gone)) and quiet.filter(record(other))
