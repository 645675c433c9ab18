"""The GPUs and TPU slices `--plan-for` knows: one small JSON file each in target_specs/, with the device's
published facts and where they come from. Pure Python: a notebook can list them without jax.

A GPU name may end in `xN` (`a100-80gb x8` written `a100-80gbx8`): N such GPUs in one host. A TPU name is a
slice (`v5e-8`: eight v5e chips on one host). What a program may use of a device is what jax will give it:
on a GPU jax preallocates a fraction of the card (XLA_CLIENT_MEM_FRACTION, formerly
XLA_PYTHON_CLIENT_MEM_FRACTION; 0.75 by default), on a TPU the HBM libtpu's compiler offers a program
(hbm_available_gib: 15.75 of a v5e's 16 GiB, 30.75 of a v4's 32; measured, its spec file says how).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from slm.errors import ConfigError

SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "target_specs")
MB = 2**20
DEFAULT_GPU_FRACTION = 0.75  # jax's default preallocation (docs.jax.dev "GPU memory allocation")
FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


@dataclass(frozen=True)
class Target:
    """One target: `facts` is its spec file's dict; `count` devices (GPUs in the host, or the slice's chips)."""

    name: str
    platform: str  # "gpu" or "tpu"
    facts: dict
    count: int

    @property
    def device_mb(self) -> float:
        """One device's memory as its maker (or XLA's spec) gives it, MB."""
        if self.platform == "gpu":
            return self.facts["memory_bytes"] / MB
        return self.facts["memory_gib_per_device"] * 1024.0

    def usable_mb(self, environ: dict | None = None) -> tuple[float, str]:
        """(MB a program may use per device, what that figure is): on a GPU jax's preallocated fraction."""
        if self.platform == "tpu":  # what libtpu lets a program use: less than the chip's HBM (v5p's: more)
            gib = self.facts["hbm_available_gib"]
            chip = self.facts["memory_gib_per_device"]
            return gib * 1024.0, f"the HBM libtpu offers a program ({gib} GiB of the chip's {chip})"
        env = os.environ if environ is None else environ
        var = next((v for v in FRACTION_VARS if env.get(v)), None)
        try:
            fraction = float(env[var]) if var else DEFAULT_GPU_FRACTION
        except ValueError:
            raise ConfigError(f"{var}={env[var]!r}: not a fraction; set it to e.g. .90") from None
        if not 0 < fraction <= 1:
            raise ConfigError(f"{var}={env[var]}: must be in (0, 1]")
        why = f"{var}={env[var]}" if var else "jax's default preallocation"
        return self.device_mb * fraction, f"{fraction:.0%} of {self.device_mb:,.0f} MB ({why})"


def known_targets() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(SPECS) if f.endswith(".json"))


def load_target(name: str) -> Target:
    """The target called `name` (a known name, or a GPU's with `xN`); a name not known is a ConfigError
    listing the known ones."""
    m = re.fullmatch(r"(.+?)(?:x(\d+))?", name.strip().lower())
    base, count = m.group(1), int(m.group(2) or 1)
    path = os.path.join(SPECS, f"{base}.json")
    if not os.path.isfile(path) or count < 1:
        raise ConfigError(f"--plan-for {name}: not a target this trainer knows; choose one of "
                          f"{', '.join(known_targets())} (a GPU may end in xN for N in one host, e.g. a100-80gbx8)")
    with open(path) as f:
        facts = json.load(f)
    if facts["platform"] == "tpu":
        if m.group(2):
            raise ConfigError(f"--plan-for {name}: a TPU slice's size is in its name (e.g. v5e-8); drop x{count}")
        b = facts["chips_per_host_bounds"]
        count = b[0] * b[1] * b[2]
    return Target(base if count == 1 or facts["platform"] == "tpu" else f"{base}x{count}", facts["platform"], facts,
                  count)
