"""What a run changes in its process, put back when it ends: a notebook that calls `train()` twice, or after a
failed run, finds the process as it was (issue 41, item 8).

A run points jax's persistent compilation cache at its directory (slm.train.devices.enable_compile_cache) and,
while orbax saves, holds back its threads' echoes of a full disk (slm.io.checkpoints): logging filters on the
absl and asyncio loggers and `sys.unraisablehook` (its warning filters are scoped by catch_warnings there).
What cannot be undone once jax's backend has started (the number of CPU devices, the platform) is left, and
docs/api.md says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

LOGGERS = ("absl", "asyncio")  # the loggers a run filters (slm.io.checkpoints._QuietDiskFull.LOGGERS)


@dataclass
class ProcessState:
    """The process-wide settings a run may change, as found."""

    cache_dir: str | None
    unraisablehook: Any
    logger_filters: dict[str, list] = field(default_factory=dict)

    @classmethod
    def now(cls) -> ProcessState:
        return cls(_cache_dir(), sys.unraisablehook, {name: list(logging.getLogger(name).filters) for name in LOGGERS})

    def restore(self) -> None:
        sys.unraisablehook = self.unraisablehook
        for name, filters in self.logger_filters.items():
            logging.getLogger(name).filters[:] = filters
        if "jax" in sys.modules and _cache_dir() != self.cache_dir:
            import jax
            from jax.experimental.compilation_cache import compilation_cache

            jax.config.update("jax_compilation_cache_dir", self.cache_dir)
            compilation_cache.reset_cache()  # jax keeps the opened cache object: drop it, or it stays in use


def _cache_dir() -> str | None:
    """jax's compilation cache directory: its config's value, or (jax not imported yet) what that value will be."""
    if "jax" in sys.modules:
        return sys.modules["jax"].config.jax_compilation_cache_dir
    return os.environ.get("JAX_COMPILATION_CACHE_DIR")


@contextlib.contextmanager
def as_found() -> Iterator[ProcessState]:
    """Run the body; afterwards (returned, raised or interrupted) put back what ProcessState records."""
    state = ProcessState.now()
    try:
        yield state
    finally:
        state.restore()
