"""slm.train.process_state: `train()` leaves the process as it found it, called twice and after a failed save
(a notebook's view): jax's compilation cache setting, sys.unraisablehook, the warning filters, the filters on
the loggers orbax's threads write to."""

import logging
import sys
import warnings

import jax
import orbax.checkpoint as ocp
import pytest
from jax.experimental.compilation_cache import compilation_cache

from slm.errors import DiskFullError
from train_optimized import Config, train


def _state() -> tuple:
    return (jax.config.jax_compilation_cache_dir, sys.unraisablehook, list(warnings.filters),
            {name: list(logging.getLogger(name).filters) for name in ("absl", "asyncio")})


@pytest.fixture
def no_cache_dir(tmp_path, monkeypatch):
    """A process with no compilation cache of its own (the suite's conftest gives one): the run sets one."""
    given = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLM_COMPILE_CACHE", raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", given)
    compilation_cache.reset_cache()


@pytest.mark.slow
def test_train_twice_and_after_a_failed_save_leaves_the_process_as_found(tmp_path, data_dir, no_cache_dir,
                                                                         monkeypatch):
    def run(name: str, **kw) -> dict:
        return train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True,
                            target_params=100_000, seq_len=32, batch_size=8, max_steps=2, eval_tokens=2048,
                            checkpoint_sync="on", output_dir=str(tmp_path / name), **kw), log=lambda line: None)

    found = _state()
    assert found[0] is None
    assert run("first")["steps"] == 2
    assert (tmp_path / "home" / ".cache" / "slm-trainer" / "xla").is_dir()  # the run did use its cache
    assert _state() == found
    assert run("second")["steps"] == 2
    assert _state() == found

    def out_of_space(*args, **kwargs):  # tensorstore's words for a full disk, as orbax's save raises them
        raise ValueError('RESOURCE_EXHAUSTED: Error writing "params/0" in OCDBT database at local file '
                         f'"{tmp_path}": No space left on device [os_error_code=\'28\']')

    monkeypatch.setattr(ocp.CheckpointManager, "save", out_of_space)
    with pytest.raises(DiskFullError):
        run("full")
    assert _state() == found
