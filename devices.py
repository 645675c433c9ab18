"""Device setup: one host device per CPU core, and a 1-D data-parallel mesh over the devices.

Why several CPU devices: XLA runs a CPU program one kernel at a time, each kernel split over all
cores, and the small kernels of a small transformer split badly (2 cores give ~1.5x one core). Two
host devices each running half the batch keep both cores busy: 1.4-1.5x the tokens/s of one device at
the default and nanoGPT-baby shapes on this 2-core machine (bench/train_speed.py).

Why one step in flight on multi-device CPU: with several steps dispatched ahead, XLA's CPU client
can deadlock in the in-process all-reduce: one device's program holds a client worker while it waits
in the rendezvous, and the other device's launch waits on the client's execution semaphore behind
a later step (gdb stacks: AllReduce / Semaphore::Acquire / BlockUntilReady). Seen here within
100-300 steps when a tokenizer thread shared the cores; with a block on each step's result it never
recurred in 6,000 steps under the same load, and the sync costs nothing measurable.
"""

from __future__ import annotations

import os

MAX_CPU_DEVICES = 8


def configure_cpu_devices(n: int | None = None) -> int:
    """Ask for `n` host CPU devices (default: cores, at most 8); call before jax's backend starts.

    Returns the number requested; a no-op when the backend is already running (the devices stay as
    they are) or when the user set --xla_force_host_platform_device_count themselves.
    """
    import jax

    n = n or min(os.cpu_count() or 1, MAX_CPU_DEVICES)
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return n
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backend already initialised (e.g. in a notebook after other jax work)
        pass
    return n


def data_mesh(batch_size: int, max_devices: int | None = None):
    """A 1-D mesh named 'data' over the most devices that divide `batch_size` evenly."""
    import jax
    from jax.sharding import AxisType

    devices = jax.devices()
    k = min(len(devices), max_devices or len(devices))
    while batch_size % k:
        k -= 1
    return jax.make_mesh((k,), ("data",), axis_types=(AxisType.Auto,), devices=devices[:k])


def shardings(mesh):
    """(replicated, batch-sharded) NamedShardings for state and data."""
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))


def needs_step_sync(mesh) -> bool:
    """True where each step must finish before the next is dispatched (multi-device CPU)."""
    return mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"
