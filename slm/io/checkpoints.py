"""Orbax checkpoints: the train state pytree plus a JSON record of the run (step, tokens, config).

Saves are asynchronous (orbax writes in a background thread and commits atomically by renaming a
temporary directory), so a crash mid-save leaves the previous checkpoint intact. With `sync=True` a save
waits for its commit before training goes on, so no step runs beside the save's host copy of the state
(what the memory planner turns on when that copy is what does not fit). Either way, once a save has
committed the heap's free pages go back to the OS (glibc keeps the copy's pages otherwise, and every later
step peaked higher by up to 1.5x the state: docs/memory.md).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from slm.memory.host import release_free_heap


class Checkpointer:
    """Keeps the newest `keep` checkpoints plus the one with the best eval loss; never the last one deleted."""

    def __init__(self, directory: str, keep: int | None = 3, log=print, sync: bool = False):
        self.directory = os.path.abspath(directory)
        self.keep, self.log, self.sync = keep, log, sync
        self.pending: int | None = None  # the last save, verified once it has been committed
        self.pending_tree: set[str] = set()  # its state's leaf paths, to compare with what was written
        self.eval_loss: dict[int, float] = {}  # step -> eval loss of the params saved there
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                           "loader": ocp.JsonCheckpointHandler()},  # so a reopened dir can read its metadata
        )

    def _prune(self) -> None:
        steps = sorted(self.manager.all_steps())
        if self.keep is None or len(steps) <= self.keep:
            return
        keep = set(steps[-self.keep:])
        scored = [s for s in steps if s in self.eval_loss]
        if scored:
            keep.add(min(scored, key=self.eval_loss.get))
        for s in steps:
            if s not in keep:
                self.manager.delete(s)

    def save(self, step: int, state: Any, meta: dict, loader: dict | None = None,
             eval_loss: float | None = None) -> None:
        """State arrays, the run's counters (`meta`) and the data loader's stream position, in one checkpoint."""
        if eval_loss is not None:
            self.eval_loss[step] = eval_loss
        self.verify_pending()
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                                    loader=ocp.args.JsonSave(loader or {})),
            force=True,
        )
        self.pending, self.pending_tree = step, _leaf_paths(state)
        self._prune()
        if self.sync:
            self.verify_pending()

    def poll(self) -> None:
        """Between steps: verify the last async save (and free its copy) as soon as it has committed."""
        if self.pending is not None and jax.process_count() == 1 and not self.manager.is_saving_in_progress():
            self.verify_pending()

    def verify(self, step: int, tree: set[str] | None = None) -> str | None:
        """Reopen a committed checkpoint from its files: there, its record readable and for this step,
        and (given the saved state's leaf paths) every leaf in the state's tree on disk. None when sound.

        Plain file reads, no orbax restore: a restore ends in a barrier across processes, which one
        process's failed check must not leave the others waiting in.
        """
        path = os.path.join(self.directory, str(step))  # orbax renames its temp dir to this on commit
        if not os.path.isdir(path):
            return "not among the committed checkpoints"
        try:
            with open(os.path.join(path, "meta", "metadata")) as f:
                meta = json.load(f)
            written = None
            if tree:
                with open(os.path.join(path, "state", "_METADATA")) as f:
                    written = {"/".join(str(k["key"]) for k in leaf["key_metadata"])
                               for leaf in json.load(f)["tree_metadata"].values()}
        except (OSError, ValueError, KeyError, TypeError) as e:  # any failure to read it back is the finding
            return f"unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        if meta.get("step", step) != step:
            return f"records step {meta.get('step')}"
        if tree and not tree <= written:  # (orbax may also list empty optimizer nodes, hence <=)
            return f"state tree on disk lacks {len(tree - written)} saved leaves, e.g. {sorted(tree - written)[:2]}"
        return None

    def verify_pending(self) -> None:
        """Wait for the last async save and verify it; loud (a log line per failure) but never fatal."""
        if self.pending is None:
            return
        self.manager.wait_until_finished()
        release_free_heap()  # the save's copy of the state, freed into the heap: back to the OS
        step, tree, self.pending = self.pending, self.pending_tree, None
        problem = self.verify(step, tree) if jax.process_index() == 0 else None  # one process reports
        if problem:
            self.log(f"[checkpoint] VERIFY FAILED for step {step} in {self.directory}: {problem}; "
                     f"the previous checkpoint is still there")

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
        """Verify the last save and close the manager (safe to call twice)."""
        if self.manager is None:
            return
        self.verify_pending()
        self.manager.close()
        self.manager = None


def _leaf_paths(tree: Any) -> set[str]:
    """'/'-joined key paths of a pytree's leaves (live arrays or orbax's metadata tree)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
            for path, _ in leaves}
