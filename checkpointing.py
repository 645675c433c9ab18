"""Orbax checkpoints: the train state pytree plus a JSON record of the run (step, tokens, config).

Saves are asynchronous (orbax writes in a background thread and commits atomically by renaming a
temporary directory), so a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int | None = 3):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def save(self, step: int, state: Any, meta: dict, loader: dict | None = None) -> None:
        """State arrays, the run's counters (`meta`) and the data loader's stream position, in one checkpoint."""
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                                    loader=ocp.args.JsonSave(loader or {})),
            force=True,
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, dict]:
        """(state, meta, loader state) restored into the structure/dtypes of `abstract_state` (jax.eval_shape)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        out = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore(),
                                          loader=ocp.args.JsonRestore())
        )
        return out["state"], out["meta"], out["loader"] or None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
