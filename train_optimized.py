"""Streaming small-LM trainer: `python train_optimized.py --use-streaming [flags]`, or `train(Config(...))`.

    python train_optimized.py --use-streaming --dataset-id data.txt --target-params 1000000 --max-time 120

A thin entry point: the trainer lives in the `slm` package (slm/__init__.py maps its layers; the loop
is slm/train/loop.py). `--help` lists every flag; docs/flags.md has them as a table.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # Ctrl-C while the imports run (jax takes ~1 s): one line and exit 130, no traceback
    import os
    import signal

    _stderr = os.dup(2)  # the imports point fd 2 at /dev/null while jax's plugins load (quiet_native_stderr)

    def _interrupted(*_: object) -> None:
        os.write(_stderr, b"\ninterrupted\n")
        os._exit(130)

    signal.signal(signal.SIGINT, _interrupted)

if __name__ == "__main__":  # before jax is imported: restart once under huge-page malloc (slm/cli/malloc.py)
    from slm.cli.malloc import process_start, reexec_with_huge_pages

    reexec_with_huge_pages(process_start())  # --max-time counts from the first start (handed on)

from slm.cli.train import main

from slm.train.config import PRESETS, Config, apply_preset, auto_preset, validate
from slm.train.run import train

__all__ = ["Config", "train", "main", "PRESETS", "apply_preset", "auto_preset", "validate"]

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on run_main and the trainer handle it
    sys.exit(main())
