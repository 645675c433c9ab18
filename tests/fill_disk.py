"""Train as the CLI does, and take the disk away mid-run: the full-disk tests' driver (a subprocess).

    python tests/fill_disk.py CONFIG_JSON STEP fill     # fill the real disk (a small tmpfs) at STEP; the
                                                        # trainer is told the disk is roomy, so orbax's
                                                        # write itself runs out of space
    python tests/fill_disk.py CONFIG_JSON STEP inject   # where no tmpfs can be mounted: from STEP on,
                                                        # orbax's save raises tensorstore's ENOSPC error

Exits as train_optimized.py does (2 with one `error:` line on a full disk).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slm.cli.common import run_main  # noqa: E402
from slm.train.config import Config  # noqa: E402
from slm.train.loop import Callback  # noqa: E402


class TakeTheDisk(Callback):
    """At optimizer step `at`, after the last checkpoint has committed, takes the free space away."""

    def __init__(self, out: str, at: int, mode: str):
        self.out, self.at, self.mode = out, at, mode

    def on_step(self, run) -> None:
        if run.step != self.at:
            return None
        if self.mode == "fill":  # leave 100 KB: metrics rows still fit, a checkpoint does not (saves are
            # synchronous in these tests, so the last checkpoint and its manifest are on disk already)
            fd = os.open(os.path.join(os.path.dirname(self.out), "filler"), os.O_CREAT | os.O_WRONLY)
            os.posix_fallocate(fd, 0, os.statvfs(self.out).f_bavail * os.statvfs(self.out).f_frsize - 100_000)
            os.close(fd)
        else:
            import orbax.checkpoint as ocp

            def out_of_space(manager, step, *args, **kwargs):
                raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "params/0" in OCDBT database at local file '
                                 f'"{self.out}": No space left on device [os_error_code=\'28\']')

            ocp.CheckpointManager.save = out_of_space
        return None


def main() -> int:
    values, at, mode = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    roomy = lambda path: SimpleNamespace(total=10**12, used=0, free=10**12)  # noqa: E731

    def body() -> None:
        from slm.train.run import train

        train(Config(**values), callbacks=[TakeTheDisk(values["output_dir"], at, mode)], disk_usage=roomy)

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
