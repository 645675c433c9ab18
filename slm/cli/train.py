"""`python train_optimized.py --use-streaming [flags]` (or `slm-train`): parse the flags, train, exit 0 or 2."""

from __future__ import annotations

import time

from slm.cli.malloc import process_start, reexec_with_huge_pages
from slm.train.devices import import_jax_quietly

import_jax_quietly()  # before anything imports jax: a --plan-for GPU plugin's native noise held back

from slm.cli.common import run_main  # noqa: E402
from slm.cli.flags import parse_flags
from slm.train.config import Config


def main(argv: list[str] | None = None) -> int:
    def body() -> None:
        values, explicit, notes = parse_flags(argv)
        for note in notes:
            print(note)
        if values.get("plan_for"):  # plan only: nothing is trained, read or tokenized
            from slm.train.config import validate
            from slm.train.plan_for import plan_main

            config = Config(**values)
            validate(config)
            plan_main(config)
            return
        from slm.train.run import (
            train,  # jax and the rest only once the flags are known to be good
        )

        # --max-time counts from the process start on the command line; from this call when called with argv
        # (a notebook or a test that imported this module long before)
        train(Config(**values), start_time=process_start() if argv is None else time.time(), explicit=explicit)

    return run_main(body)


def cli() -> int:
    """The `slm-train` command: `main` under huge-page malloc (slm.cli.malloc re-executes once)."""
    reexec_with_huge_pages(process_start())
    return main()
