"""What every command-line tool here shares: one-line usage errors and the exit codes.

    0    done (a run stopped by a signal or a STOP file also exits 0: it saved and can be resumed)
    2    a UserError (bad flag, file, dataset or run dir): `error: <one line>` on stderr, no traceback
    130  interrupted (a second Ctrl-C)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from slm.errors import ConfigError, UserError


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one-line UserErrors (`error_class`, exit 2 via run_main), not a usage dump."""

    def __init__(self, *args: object, error_class: type[UserError] = ConfigError, **kwargs: object):
        super().__init__(*args, **kwargs)
        self.error_class = error_class

    def error(self, message: str) -> None:  # type: ignore[override]
        raise self.error_class(message)


@contextmanager
def plain_package_logs() -> Iterator[None]:
    """The package's own log records (a reader's warning about replaced bytes, say) print as the run's other
    lines do, the message alone on stdout, not as `WARNING:slm.data.readers:...`; put back as found after."""
    logger = logging.getLogger("slm")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def run_main(body: Callable[[], object]) -> int:
    """Run a tool's body and turn its outcome into an exit code (see the module docstring)."""
    try:
        with plain_package_logs():
            body()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        if "slm.io.checkpoints" in sys.modules:  # a failed save's or read's echoes, printed as the process exits
            sys.modules["slm.io.checkpoints"].quiet_until_exit()
        jax = sys.modules.get("jax")
        if jax is not None and jax.distributed.is_initialized():  # don't wait at exit for processes that go on
            sys.stderr.flush()
            os._exit(2)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `generate.py ... | head`: the reader left; stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    return 0
