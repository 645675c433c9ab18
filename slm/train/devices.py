"""Device setup: processes (jax.distributed), one host device per CPU core, the 1-D 'data' mesh and the
state's sharding on it (data-parallel replicas or FSDP shards).

Sharding (`--sharding`): the batch is always split over the mesh's one axis, 'data'. With "dp" every
device holds the whole train state (params, optimizer state, accumulators) and the gradients are
all-reduced; with "fsdp" each state leaf is split over the same axis along its largest dimension that
the device count divides (leaves too small or indivisible stay replicated), and XLA all-gathers a
layer's weights where it needs them and reduce-scatters the gradients. Both compute the same step.

Processes: with `jax.distributed` every process runs this same program on its own devices; each reads
its own part of the data and contributes its rows of the global batch
(`jax.make_array_from_process_local_data`). On CPU the processes talk through gloo.

Why several CPU devices: XLA runs a CPU program one kernel at a time, each kernel split over all
cores, and the small kernels of a small transformer split badly (2 cores give ~1.5x one core). Two
host devices each running half the batch keep both cores busy: 1.4-1.5x the tokens/s of one device at
the default and nanoGPT-baby shapes on this 2-core machine (bench/train_speed.py@1a39af2).

Why one step in flight on multi-device CPU: with several steps dispatched ahead, XLA's CPU client
can deadlock in the in-process all-reduce: one device's program holds a client worker while it waits
in the rendezvous, and the other device's launch waits on the client's execution semaphore behind
a later step (gdb stacks: AllReduce / Semaphore::Acquire / BlockUntilReady). Seen here within
100-300 steps when a tokenizer thread shared the cores; with a block on each step's result it never
recurred in 6,000 steps under the same load, and the sync costs nothing measurable.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from slm.errors import ShardingError, UserError, first_line

MAX_CPU_DEVICES = 8


def enable_compile_cache(directory: str | None = None) -> str | None:
    """Keep compiled XLA programs on disk, so a rerun, a resume or a second run of the same shapes loads the
    step instead of compiling it (a 2-step run of a 150K model: 16 s -> 9 s here). The directory is
    JAX_COMPILATION_CACHE_DIR when set, else ~/.cache/slm-trainer/xla; SLM_COMPILE_CACHE=0 turns it off.
    Returns the directory in use, or None."""
    import jax

    if os.environ.get("SLM_COMPILE_CACHE", "1") == "0":
        return None
    if jax.config.jax_compilation_cache_dir:  # the user's own (e.g. JAX_COMPILATION_CACHE_DIR)
        return jax.config.jax_compilation_cache_dir
    directory = directory or os.path.join(os.path.expanduser("~"), ".cache", "slm-trainer", "xla")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    return directory


def configure_cpu_devices(n: int | None = None, start: bool = True) -> int:
    """Ask for `n` host CPU devices (default: cores, at most 8); call before jax's backend starts. With `start`
    the backend starts here (start_backend); jax.distributed must start first, so it passes False.

    Returns the number requested; a no-op when the backend is already running (the devices stay as
    they are) or when the user set --xla_force_host_platform_device_count themselves.
    """
    import jax

    n = n or min(os.cpu_count() or 1, MAX_CPU_DEVICES)
    unstaged_gpu_transfers()  # here too: a distributed start calls this with start=False
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # backend already initialised (e.g. in a notebook after other jax work)
            pass
    if start:
        start_backend()
    return n


# Device files of a GPU or TPU driver: where none exists, no jax backend but the CPU's can start.
NVIDIA_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia")
ACCELERATOR_FILES = NVIDIA_FILES + ("/dev/kfd", "/dev/accel0", "/dev/vfio/0")


def no_accelerator() -> bool:
    """No GPU or TPU driver here, and JAX_PLATFORMS unset or "cpu": the CPU is the only backend to start."""
    return os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and not any(map(os.path.exists, ACCELERATOR_FILES))


def import_jax_quietly() -> None:
    """Import jax, holding back what jax's CUDA plugin (the --plan-for extra) writes natively at import on a
    machine without a GPU: six lines of "Could not find cuda drivers". The entry points call this first."""
    if "jax" in sys.modules or not no_accelerator():
        return
    with quiet_native_stderr():
        import jax  # noqa: F401


def unstaged_gpu_transfers() -> None:
    """On an NVIDIA machine, before jax's backend starts: host-to-device copies straight from the numpy array,
    not through the CUDA client's pinned staging pool, which keeps every byte it ever staged. Measured on an
    H100 (jax 0.11.2): placing ~1 GB of weights left the host 1,062 MB larger for the rest of the run (a pinned
    /dev/zero mapping) and 6 MB without; the same values, no slower. An option the user gave
    (jax_pjrt_client_create_options / JAX_PJRT_CLIENT_CREATE_OPTIONS) is left as it is."""
    import jax
    from jax._src import xla_bridge

    if (xla_bridge.backends_are_initialized() or jax.config.jax_pjrt_client_create_options
            or not any(map(os.path.exists, NVIDIA_FILES)) or "cuda" not in (jax.config.jax_platforms or "cuda")):
        return
    jax.config.update("jax_pjrt_client_create_options", {"should_stage_host_to_device_transfers": False})


def open_device_pools(devices: Any) -> None:
    """Make each accelerator's memory pool now, with one byte. XLA's GPU allocator (BFC) makes its pool at the
    first allocation, and with it a host table of one 8-byte handle per 256 bytes of pool: 1/32 of
    XLA_PYTHON_CLIENT_MEM_FRACTION x the card, in host RSS for the rest of the run (H200, jax 0.11.2,
    2026-11-27: 1,116 MB at fraction 0.25, 3,355 MB at 0.75). Pre-flight reads the RSS after this, so its
    runtime holds the table whether or not the compile allocated (autotuning does, a compile-cache hit not)."""
    import jax
    import numpy as np

    for d in devices:
        if d.platform != "cpu" and d.process_index == jax.process_index():
            jax.device_put(np.zeros((), np.int8), d).block_until_ready()


def start_backend() -> None:
    """Start jax's backend. On a machine with no GPU or TPU and no JAX_PLATFORMS of the user's, ask for the CPU
    alone: with jax's CUDA plugin or libtpu installed (the --plan-for extras) jax would otherwise try each at
    start and print pages of warnings, and the plugin's native greeting ("Could not find cuda drivers") is held
    back. A backend already running, or one the user chose, is left as it is."""
    import_jax_quietly()
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return
    if jax.config.jax_platforms or not no_accelerator():
        unstaged_gpu_transfers()
        jax.devices()
        return
    jax.config.update("jax_platforms", "cpu")
    with quiet_native_stderr():
        jax.devices()


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Hold back what native code writes to stderr meanwhile (file descriptor 2; Python's exceptions still
    rise): the installed plugins' C++ logging, expected on a machine without their device."""
    sys.stderr.flush()
    try:
        fd = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, cpu_devices: int | None = None) -> Processes:
    """Start jax.distributed when asked (any argument given, or a cluster JAX detects); this process's place.

    Call before anything touches jax's backend; `cpu_devices` host devices per process on CPU (see
    configure_cpu_devices). On CPU the processes' collectives go through gloo. Not asked, or
    `num_processes` 1: Processes(0, 1) without importing jax.
    """
    asked = any(v is not None for v in (coordinator_address, num_processes, process_id))
    if num_processes == 1 or (not asked and not cluster_detected()):
        return Processes()
    import jax

    configure_cpu_devices(cpu_devices, start=False)
    if jax.distributed.is_initialized():
        return Processes(jax.process_index(), jax.process_count())
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    except Exception as e:  # noqa: BLE001 - bad addresses, timeouts: a user error, not a traceback
        raise ShardingError(f"--coordinator-address {coordinator_address}: jax.distributed could not start "
                            f"({first_line(e)}); check the address, --num-processes and --process-id") from None
    return Processes(jax.process_index(), jax.process_count())


def cluster_detected() -> bool:
    """Environments where jax.distributed.initialize() finds its own settings (SLURM, Open MPI, JAX_* vars)."""
    env = os.environ
    slurm = all(k in env for k in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST"))
    return bool(env.get("JAX_COORDINATOR_ADDRESS")) or (slurm and int(env.get("SLURM_NTASKS", "1") or 1) > 1) or int(
        env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1


def data_mesh(batch_size: int, max_devices: int | None = None, strict: bool = False):
    """A 1-D mesh named 'data' over the devices, splitting `batch_size` (the global batch) evenly.

    `strict` (several processes, an accelerator, or a device count the user chose): every device, and
    a batch that does not divide is a ShardingError. Otherwise (host CPU devices the trainer made up
    for speed) the most devices that divide the batch.
    """
    import jax
    from jax.sharding import AxisType

    devices = jax.devices()
    k = min(len(devices), max_devices or len(devices))
    if strict and batch_size % k:
        raise ShardingError(f"--batch-size {batch_size} does not split evenly over {k} devices"
                            f"{f' in {jax.process_count()} processes' if jax.process_count() > 1 else ''}; "
                            f"use a multiple of {k}")
    while batch_size % k:
        k -= 1
    return jax.make_mesh((k,), ("data",), axis_types=(AxisType.Auto,), devices=devices[:k])


def state_shardings(abstract_state, mesh, mode: str = "dp"):
    """A NamedSharding per state leaf: replicated ("dp"), or split over 'data' along the largest
    dimension the device count divides ("fsdp"; scalars and indivisible leaves stay replicated)."""
    import jax

    return jax.tree.map(lambda x: leaf_sharding(tuple(x.shape), mesh, mode), abstract_state)


def leaf_sharding(shape: tuple[int, ...], mesh, mode: str = "dp"):
    """state_shardings' rule for one array of `shape`: it depends on the shape alone, so weights can be
    placed where they will live as they are read, before the state exists."""
    from jax.sharding import NamedSharding, PartitionSpec

    n = mesh.shape["data"]
    if mode == "fsdp" and n > 1:
        for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
            if shape[d] % n == 0 and shape[d] >= n:
                return NamedSharding(mesh, PartitionSpec(*([None] * d), "data"))
    return NamedSharding(mesh, PartitionSpec())


def device_bytes(tree) -> int:
    """Bytes of a pytree of jax.Arrays held by one device (the first): what sharding saves."""
    import jax

    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.addressable_shards[0]
        total += shard.data.size * shard.data.dtype.itemsize
    return total


def put_frozen(x, sharding):
    """jax.device_put(x, sharding) for an array no step donates or writes (a frozen LoRA base). Replicated over
    several host CPU devices it is one 64-byte-aligned host buffer that every device aliases (PJRT's CPU
    client takes such a buffer without copying): held once in RAM, not once a host device, since their memory
    is the host's anyway. SmolLM2-135M's float32 base on 2 devices: 423 MB less (docs/performance.md)."""
    import jax
    import numpy as np

    devices = sorted(getattr(sharding, "addressable_devices", ()), key=lambda d: d.id)
    if len(devices) < 2 or not sharding.is_fully_replicated or any(d.platform != "cpu" for d in devices):
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    raw = np.empty(x.nbytes + 64, np.uint8)
    host = raw[(-raw.ctypes.data) % 64:][:x.nbytes].view(x.dtype).reshape(x.shape)
    host[...] = x
    shards = [jax.device_put(host, d, may_alias=True) for d in devices]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def global_batch(local: dict, sharding) -> dict:
    """This process's rows -> global arrays split over the mesh (one process: a plain device_put)."""
    import jax

    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def replicated_batch(x, sharding):
    """An array every process holds whole (eval batches) -> a global array split over the mesh."""
    import jax

    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


@dataclass(frozen=True)
class Processes:
    """This process's place among a run's processes, and the few collectives the trainer needs.

    With one process every method is local and imports nothing; with several (jax.distributed) each is
    a collective that every process must call at the same point. Tests pass a fake to the loop.
    """

    index: int = 0
    count: int = 1

    @property
    def primary(self) -> bool:
        """Process 0 writes logs, metrics, samples and the summary."""
        return self.index == 0

    def gather(self, obj: Any) -> list:
        """Every process's JSON-able `obj`, in process order."""
        return [obj] if self.count == 1 else _allgather_json(obj)

    def any(self, flag: bool) -> bool:
        """True on every process when `flag` is true on any (stop requests, end of data)."""
        return flag if self.count == 1 else bool(_allgather_numbers([float(flag)]).any())

    def value0(self, x: float) -> float:
        """Process 0's `x` on every process (its clock sets everyone's learning rate)."""
        return x if self.count == 1 else float(_allgather_numbers([x])[0])

    def decide0(self, fn: Callable[[], Any]) -> Any:
        """fn() run on process 0 only (a JSON-able result), shared with every process; so is its user
        error, so no process is left waiting in a collective while another exits."""
        if self.count == 1:
            return fn()
        try:
            sent = {"value": fn()} if self.primary else {}
        except UserError as e:
            sent = {"error": str(e)}
        sent = self.gather(sent)[0]
        if "error" in sent:
            raise UserError(sent["error"])
        return sent["value"]


def _allgather_numbers(values: list[float]):
    import numpy as np
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.array(values, np.float32))).reshape(-1)


def _allgather_json(obj: Any) -> list:
    import json

    import numpy as np
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(bytes(row[:size]).decode()) for row, size in zip(rows, sizes)]


def shardings(mesh):
    """(replicated, batch-sharded) NamedShardings for state and data."""
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))


def needs_step_sync(mesh) -> bool:
    """True where each step must finish before the next is dispatched (multi-device CPU)."""
    return mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"
