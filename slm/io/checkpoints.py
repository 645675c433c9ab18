"""Orbax checkpoints: the train state pytree plus a JSON record of the run (step, tokens, config).

Saves are asynchronous (orbax writes in a background thread and commits atomically by renaming a
temporary directory), so a crash mid-save leaves the previous checkpoint intact. With `sync=True` a save
waits for its commit before training goes on, so no step runs beside the save's host copy of the state
(what the memory planner turns on when that copy is what does not fit). Either way, once a save has
committed the heap's free pages go back to the OS (glibc keeps the copy's pages otherwise, and every later
step peaked higher by up to 1.5x the state: docs/memory.md).

Once committed, a save is read back: its record and tree are checked, its manifest (every file's size and
CRC-32, slm.io.manifest) is written, and only then are older checkpoints pruned, so the newest sound one is
never deleted. A checkpoint that fails a check is renamed `<step>.damaged`: orbax no longer sees it, so it
is neither loaded nor pruned. A save the disk has no room for is not started (or, when the space went
during the write, its partial files are removed): a DiskFullError names the step, the space needed and
free, and the newest complete checkpoint, which is kept.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import re
import shutil
import sys
import warnings
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from slm.errors import DiskFullError, RunError, first_line
from slm.io.manifest import check_manifest, has_manifest, write_manifest
from slm.memory.host import release_free_heap

DAMAGED = ".damaged"


class Checkpointer:
    """Keeps the newest `keep` checkpoints plus the one with the best eval loss; never the newest sound one."""

    def __init__(self, directory: str, keep: int | None = 3, log: Callable[[str], None] = print, sync: bool = False,
                 disk_usage: Callable[[str], Any] = shutil.disk_usage):
        self.directory = os.path.abspath(directory)
        self.keep, self.log, self.sync, self.disk_usage = keep, log, sync, disk_usage
        self.pending: int | None = None  # the last save, verified once it has been committed
        self.pending_tree: set[str] = set()  # its state's leaf paths, to compare with what was written
        self.eval_loss: dict[int, float] = {}  # step -> eval loss of the params saved there
        self.pinned: set[int] = set()  # never pruned (WSD's last stable step: a longer run branches from it)
        self.last_bytes: int | None = None  # the size of the newest checkpoint on disk: what the next needs
        self.failure: DiskFullError | None = None  # a save the disk had no room for (the run stops)
        self.failed_step: int | None = None
        self.quiet = _QuietDiskFull().install()  # orbax's threads log a full disk as pages of tracebacks
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                           "loader": ocp.JsonCheckpointHandler()},  # so a reopened dir can read its metadata
        )

    def _prune(self) -> None:
        steps = sorted(self.manager.all_steps())
        if self.keep is None or len(steps) <= self.keep:
            return
        keep = set(steps[-self.keep:]) | self.pinned
        scored = [s for s in steps if s in self.eval_loss]
        if scored:
            keep.add(min(scored, key=self.eval_loss.get))
        for s in steps:
            if s not in keep:
                self.manager.delete(s)

    def save(self, step: int, state: Any, meta: dict, loader: dict | None = None,
             eval_loss: float | None = None) -> None:
        """State arrays, the run's counters (`meta`) and the data loader's stream position, in one checkpoint.
        Raises DiskFullError (and saves nothing) when the disk lacks room for it."""
        if eval_loss is not None:
            self.eval_loss[step] = eval_loss
        self.verify_pending()
        self._check_space(step, state, loader)
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                                        loader=ocp.args.JsonSave(loader or {})),
                force=True,
            )
        except Exception as e:
            self._failed(step, e)
        self.pending, self.pending_tree = step, _leaf_paths(state)
        if self.sync:
            self.verify_pending()

    def _check_space(self, step: int, state: Any, loader: dict | None) -> None:
        """Refuse to start a save that cannot fit: needs the last checkpoint's size (or, for the first, the
        state's bytes and the loader's JSON) plus 10% and 1 MB; older checkpoints go only after it commits."""
        size = self.last_bytes
        if size is None:
            size = sum(x.nbytes for x in jax.tree.leaves(state)) + len(json.dumps(loader or {}))
        need, free = size * 1.1 + 2**20, self.disk_usage(self.directory).free
        if jax.process_count() > 1:  # process 0's reading for all: every process must take the same branch
            from jax.experimental import multihost_utils

            free = float(multihost_utils.broadcast_one_to_all(np.float64(free)))
        if free < need:
            self._raise_full(step, need, free)

    def _failed(self, step: int, e: BaseException) -> None:
        """A save that failed: a full disk becomes a DiskFullError (its partial files removed), else re-raised."""
        if not (is_disk_full(e) or self.quiet.seen):
            raise e
        self.quiet.seen = self.quiet.seen or first_line(e)  # from here on orbax's echoes of it are held back
        try:
            self.manager.wait_until_finished()  # orbax's other writer threads may still be going
        except Exception:
            pass
        self._remove_partial(step)
        self._raise_full(step, (self.last_bytes or 0) * 1.1 + 2**20, self.disk_usage(self.directory).free)

    def _remove_partial(self, step: int) -> None:
        """Delete orbax's temporary dir of a failed save (half written: it only takes space)."""
        for name in os.listdir(self.directory):
            if name.startswith(f"{step}.") and "tmp" in name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def _raise_full(self, step: int, need: float, free: float) -> None:
        self.failed_step = step
        kept = [s for s in self.manager.all_steps() if s != step]
        newest = f"step {max(kept)}, kept" if kept else "none yet"
        self.failure = DiskFullError(
            f"checkpoint {step} not saved: the disk of {self.directory} is full ({free / 2**20:,.1f} MB free, the "
            f"checkpoint needs ~{need / 2**20:,.1f} MB); newest complete checkpoint: {newest}. Free space, then "
            f"--resume {os.path.dirname(self.directory)}")
        raise self.failure

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
        path = self.path(step)  # orbax renames its temp dir to this on commit
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
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # failing to read it back is the finding
            return f"unreadable ({type(e).__name__}: {first_line(e) if str(e) else ''})"
        if not isinstance(meta, dict) or meta.get("step", step) != step:
            return f"records step {meta.get('step') if isinstance(meta, dict) else meta!r}"
        if tree and not tree <= written:  # (orbax may also list empty optimizer nodes, hence <=)
            return f"state tree on disk lacks {len(tree - written)} saved leaves, e.g. {sorted(tree - written)[:2]}"
        return None

    def check(self, step: int) -> str | None:
        """The full check before a restore: every file against the manifest (sizes, CRC-32), then the
        record; a checkpoint from before manifests gets the record check alone. None when sound."""
        path = self.path(step)
        if has_manifest(path) and (problem := check_manifest(path)):
            return problem
        return self.verify(step)

    def verify_pending(self) -> None:
        """Wait for the last async save, check it, record its manifest and prune. A checkpoint that fails the
        check is moved aside with a log line; a full disk raises DiskFullError."""
        if self.pending is None:
            return
        step, tree, self.pending = self.pending, self.pending_tree, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            self._failed(step, e)
        release_free_heap()  # the save's copy of the state, freed into the heap: back to the OS
        if jax.process_index() == 0:  # one process checks and reports
            problem = self.verify(step, tree)
            if problem and self.quiet.seen:  # the write failed for lack of space, orbax's commit said nothing
                self._failed(step, OSError(errno.ENOSPC, self.quiet.seen))
            if problem:
                self.log(f"[checkpoint] step {step} FAILED its check after writing ({problem}); moved aside to "
                         f"{self.set_aside(step)}; the previous checkpoints are kept")
                return
            try:
                self.last_bytes = write_manifest(self.path(step))
            except OSError as e:
                if not is_disk_full(e):
                    raise
                self.log(f"[checkpoint] step {step}: no room left for its manifest; the checkpoint is complete, and "
                         f"a resume will check its record only")
        self._prune()

    def set_aside(self, step: int, suffix: str = DAMAGED) -> str:
        """Rename a checkpoint `<step><suffix>` (`.damaged`: orbax then neither loads nor prunes it); its new name."""
        new = self.path(step) + suffix
        n = 1
        while os.path.exists(new):
            n += 1
            new = f"{self.path(step)}{suffix}-{n}"
        os.rename(self.path(step), new)
        self.manager.reload()
        return os.path.basename(new)

    def newest_sound(self, log: Callable[[str], None]) -> int | None:
        """The newest checkpoint that passes `check`; each newer damaged one is set aside, with a line."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            problem = self.check(step)
            if problem is None:
                return step
            self._set_aside_damaged(step, problem, log)
        return None

    def _set_aside_damaged(self, step: int, why: str, log: Callable[[str], None]) -> None:
        log(f"[resume] checkpoint {step} is damaged ({why}): moved aside to {self.set_aside(step)}; "
            f"trying the one before")

    def path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def disk_full(self, e: OSError, out: str) -> DiskFullError:
        """Another write of the run (metrics, TensorBoard, summary) that found the disk full, as one line;
        the failed save's own line when a save failed first."""
        if self.failure is not None:
            return self.failure
        steps = self.manager.all_steps() if self.manager is not None else []
        free = self.disk_usage(out).free / 2**20
        return DiskFullError(f"the disk of {out} is full ({free:,.1f} MB free; {first_line(e)}); newest complete "
                             f"checkpoint: {f'step {max(steps)}' if steps else 'none'}. Free space, then --resume {out}")

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, dict]:
        """(state, meta, loader state) restored into the structure/dtypes of `abstract_state` (jax.eval_shape)."""
        self.manager.reload()  # another process may have set a damaged checkpoint aside
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        try:
            out = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore(),
                                              loader=ocp.args.JsonRestore())
            )
        except Exception as e:  # orbax raises plain Exceptions around tensorstore's errors
            manifest = has_manifest(self.path(step))
            if not manifest and _damaged_data(e) and jax.process_count() == 1:
                self.quiet.failed_read()
                raise Unreadable(first_line(_chain(e)[-1], 160)) from None
            checked = "passed its manifest check" if manifest else "has no manifest to check"
            raise RunError(f"checkpoint {self.path(step)} could not be restored ({first_line(e)}); it {checked}. "
                           f"Move it aside (mv {step} {step}{DAMAGED}) to resume from the one before") from None
        return out["state"], out["meta"], out["loader"] or None

    def restore_sound(self, abstract_state: Any, log: Callable[[str], None],
                      decide: Callable[[Callable[[], Any]], Any] = lambda fn: fn()) -> tuple[Any, dict, dict] | None:
        """--resume: the newest checkpoint that passes `check` and restores, or None. Each damaged one on the
        way is set aside with a line: found by its manifest, or (a checkpoint without one, e.g. killed
        between its commit and its manifest) by its data failing to read. `decide`: process 0 checks."""
        while (step := decide(lambda: self.newest_sound(log))) is not None:
            try:
                return self.restore(abstract_state, step)
            except Unreadable as e:
                self._set_aside_damaged(step, f"{e}; it had no manifest", log)
        return None

    def wait(self) -> None:
        """Wait for the last save to commit, then check it, record its manifest and prune (verify_pending)."""
        self.verify_pending()

    def close(self) -> None:
        """Verify the last save and close the manager (safe to call twice). A full disk found here is kept
        in `failure` for the caller, who stops the run with it after writing the summary."""
        if self.manager is None:
            return
        try:
            self.verify_pending()
        except DiskFullError:
            pass  # in self.failure
        finally:
            self.manager.close()
            self.manager = None
            self.quiet.remove()
            if self.failed_step is not None:  # what orbax's threads wrote after the failure was reported
                self._remove_partial(self.failed_step)


class _QuietDiskFull(logging.Filter):
    """Holds back what orbax's threads print about a failure the Checkpointer reports in one line: a full
    disk's log records (absl) and asyncio tasks' (each with a traceback), the "Event loop is closed" errors
    that tensorstore's callbacks raise into orbax's closed event loop (unraisable, so printed by
    sys.unraisablehook), and the abandoned coroutines of a restore that failed on damaged data. It keeps
    the full disk's first message."""

    LOGGERS = ("absl", "asyncio")

    def __init__(self):
        super().__init__()
        self.seen: str | None = None
        self.read_failed = False
        self.previous = sys.unraisablehook

    def filter(self, record: logging.LogRecord) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        text = record.getMessage() + (f" {e!r} {e}" if e else "")  # str: an OSError's filename (repr omits it)
        if self.seen and "orbax-checkpoint-tmp" in text:  # a writer thread that lost the failed save's
            return False  # temporary dir, which the Checkpointer removed: an echo of the same full disk
        if not _is_disk_full_text(text):
            return True
        self.seen = self.seen or first_line(Exception(text))
        return False

    def unraisable(self, u: Any) -> None:
        text = f"{type(u.exc_value).__name__}: {u.exc_value}"
        if _is_disk_full_text(text):
            self.seen = self.seen or first_line(u.exc_value)
        elif not ("Event loop is closed" in text or (self.seen and ("sys.meta_path is None" in text
                                                                    or "orbax-checkpoint-tmp" in text))
                  or (self.read_failed and "error while reading" in text)):
            self.previous(u)

    def failed_read(self) -> None:
        """A restore failed on damaged data (reported in one line): its reading coroutines, abandoned, would
        print a warning and a traceback each when garbage-collected. Collect them now, quietly."""
        self.read_failed = True
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
            gc.collect()

    def install(self) -> "_QuietDiskFull":
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        self.previous, sys.unraisablehook = sys.unraisablehook, self.unraisable
        return self

    def remove(self) -> None:
        """Uninstall, leaving the process's loggers, hook and warning filters as found. A failure's abandoned
        tasks are collected first, quietly; what orbax reports later still (at the interpreter's exit) the CLI
        holds back with quiet_until_exit."""
        if self.seen or self.read_failed:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
                gc.collect()
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)
        if sys.unraisablehook == self.unraisable:
            sys.unraisablehook = self.previous


def quiet_until_exit() -> None:
    """For a process about to exit after a checkpoint failure it reported in one line (the CLI's error path):
    hold back orbax's echoes of it that its tasks print when collected at the interpreter's exit."""
    quiet = _QuietDiskFull()
    quiet.seen, quiet.read_failed = "the failure already reported", True
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    quiet.install()


class Unreadable(Exception):
    """A checkpoint without a manifest whose data failed to read back (Checkpointer.restore_sound's cue)."""


def _chain(e: BaseException | None) -> list[BaseException]:
    """An exception and the ones it was raised from or during, outermost first."""
    out = []
    while e is not None:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


# tensorstore raises ValueError("<absl status code>: ..."), its only structured part; a failed system call's
# errno rides in its payload as [os_error_code='N'].
_STATUS = re.compile(r"([A-Z_]+): ")
_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")
DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE", "FAILED_PRECONDITION")  # bytes short, garbled or missing


def status_code(x: BaseException) -> str | None:
    """The absl status code a tensorstore error starts with (OUT_OF_RANGE, DATA_LOSS, ...), else None."""
    m = _STATUS.match(str(x)) if isinstance(x, ValueError) else None
    return m.group(1) if m else None


def error_number(x: BaseException) -> int | None:
    """An exception's errno: an OSError's own, or the os_error_code tensorstore attaches to its status."""
    if isinstance(x, OSError):
        return x.errno
    m = _OS_ERROR_CODE.search(str(x))
    return int(m.group(1)) if m else None


def _damaged_data(e: BaseException | None) -> bool:
    """Whether a restore failed on the bytes it read (truncated, garbled, missing: a JSON record that does not
    parse, or tensorstore's data-loss codes), not on a mismatch of code and tree."""
    return any(isinstance(x, (json.JSONDecodeError, UnicodeDecodeError)) or status_code(x) in DAMAGE_CODES
               for x in _chain(e))


def _is_disk_full_text(text: str) -> bool:
    """A log record's or unraisable's words for ENOSPC (text is all a record of orbax's threads carries)."""
    return (os.strerror(errno.ENOSPC) in text or f"os_error_code='{errno.ENOSPC}'" in text
            or f"[Errno {errno.ENOSPC}]" in text)


def is_disk_full(e: BaseException | None) -> bool:
    """ENOSPC anywhere in an exception's chain (orbax wraps tensorstore's as ValueError: RESOURCE_EXHAUSTED)."""
    return any(error_number(x) == errno.ENOSPC for x in _chain(e))


def _leaf_paths(tree: Any) -> set[str]:
    """'/'-joined key paths of a pytree's leaves (live arrays or orbax's metadata tree)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
            for path, _ in leaves}
