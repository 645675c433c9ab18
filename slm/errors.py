"""Every mistake a user can make, as one family of exceptions (the bottom layer: imports nothing).

A `UserError` is a problem with what the user gave (a flag, a file, a dataset, a run directory), not a
bug: its message is one line that names the flag or file and the fix. The command-line tools print it
as `error: <message>` and exit 2 with no traceback (slm.cli.common.run_main), and nothing already
saved is touched. Catch `UserError` to catch them all; each subclass says where the problem lies.
"""

from __future__ import annotations


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, at most `limit` characters (its type when empty):
    how a library's multi-line error becomes part of a one-line UserError."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__


class UserError(ValueError):
    """A bad flag value, file or dataset; the message is one line naming it and the fix."""


class ConfigError(UserError):
    """A bad flag value or combination of flags."""


class ConfigFileError(UserError):
    """A --config file that cannot be used (unreadable, bad syntax, unknown key, wrong type)."""


class DatasetError(UserError):
    """Bad dataset input: a missing file, an unreadable row, too little text."""


class TokenizerError(UserError):
    """A tokenizer file that cannot be used, or a vocabulary too small to train."""


class SizingError(UserError):
    """A parameter target or shape that no transformer of this family can meet."""


class ShardingError(UserError):
    """A batch, device or process layout that cannot work."""


class TrackingError(UserError):
    """A tracker that was asked for cannot start (e.g. --wandb without the wandb package)."""


class RunError(UserError):
    """A run directory that cannot be loaded (missing files, unknown --step, a corrupt checkpoint)."""


class GenerateError(UserError):
    """A bad generate.py argument."""


class ExportError(UserError):
    """A bad export_hf.py argument, or a run that cannot be exported."""


class DiskFullError(RunError):
    """A save that the output dir's disk has no room for; the last complete checkpoint is kept."""
