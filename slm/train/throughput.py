"""Throughput: the tokens/s window between log lines, and the device's peak FLOP/s that MFU divides by."""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass

from slm.io.atomic import write_json

# Dense bf16 peak FLOP/s per device from vendor datasheets (no sparsity).
PUBLISHED_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "V100": 125e12,
    "T4": 65e12,
    "TPU v6": 918e12,
    "TPU v5p": 459e12,
    "TPU v5": 197e12,  # v5e / v5 lite
    "TPU v4": 275e12,
    "TPU v3": 123e12,
}


def device_peak_flops(device, matmul: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from) for one jax device.

    Accelerators: the table above. CPU: measured here with a large jitted matmul (~0.5 s) with the run's
    operand dtype (`matmul`, --matmul-precision), since CPUs vary too much for a table.
    """
    kind = getattr(device, "device_kind", "") or ""
    for name, flops in PUBLISHED_PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops, f"published bf16 peak of {name}"
    if device.platform == "cpu":
        return cpu_peak_flops(matmul=matmul)
    return float("nan"), f"unknown device kind {kind!r}"


def cpu_peak_flops(cache: str = os.path.join(os.path.expanduser("~"), ".cache", "slm-trainer", "cpu_peak.json"),
                   matmul: str = "float32") -> tuple[float, str]:
    """Measured CPU peak, remembered per CPU model and core count as the best seen so far.

    A single measurement reads low while other processes share the cores, which would inflate MFU;
    keeping the best across runs makes MFU comparable between runs on the same machine.
    """
    key = f"{cpu_model()} x{os.cpu_count()}" + ("" if matmul == "float32" else f" {matmul}")
    measured = measure_matmul_flops(dtype=matmul)
    try:
        with open(cache) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    entry = known.get(key, 0.0)
    best, when = (entry, "an earlier run") if isinstance(entry, (int, float)) else (entry["flops"], entry["when"])
    if measured > best:
        best, when = measured, time.strftime("%Y-%m-%d %H:%M")
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            write_json(cache, {**known, key: {"flops": best, "when": when}}, indent=None)  # read whole or not at all
        except OSError:
            pass
    return best, (f"best measured 2048^3 {matmul} matmul on this machine, {when} ({cache}; "
                  f"{measured / 1e9:.0f} GFLOP/s this run)")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=4)
def measure_matmul_flops(n: int = 2048, reps: int = 3, dtype: str = "float32") -> float:
    """FLOP/s of the best of `reps` jitted n x n matmuls with `dtype` operands, summed in float32 (measured
    once per process and dtype)."""
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    a = jnp.ones((n, n), jnp.dtype(dtype))
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


@dataclass
class Throughput:
    """Tokens and data-wait seconds since the last log line; eval and start-up time are kept out.

    `start(now, tokens)` opens a window (tokens < 0 when a micro-batch already counted ran before it),
    `rate(now)` gives (tokens/s, data-wait fraction) of the window so far, and `pause(seconds)` moves the
    window's start past time spent outside training (an eval).
    """

    started: float = 0.0
    tokens: int = 0
    wait_s: float = 0.0

    def start(self, now: float, tokens: int = 0) -> None:
        self.started, self.tokens, self.wait_s = now, tokens, 0.0

    def add(self, tokens: int = 0, wait_s: float = 0.0) -> None:
        self.tokens += tokens
        self.wait_s += wait_s

    def pause(self, seconds: float) -> None:
        self.started += seconds

    def rate(self, now: float) -> tuple[float, float]:
        elapsed = max(now - self.started, 1e-9)
        return self.tokens / elapsed, self.wait_s / elapsed

