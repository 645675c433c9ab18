"""Compile-only devices for a GPU or TPU this machine does not have (`--plan-for`), as MaxText's
train_compile.py does for TPUs: XLA builds the target's own programs on this CPU, and their memory analysis
is the target compiler's buffer assignment, not XLA:CPU's.

GPU: jax's CUDA plugin (jax-cuda12-plugin, no CUDA toolkit or driver needed) takes a GpuTargetConfig text
proto, which `gpu_target_config` writes from the target's spec file (SMs, compute capability, memory,
bandwidth, caches). TPU: libtpu's topology description of the slice. Neither starts a backend: the process
stays on CPU and nothing is allocated.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from slm.errors import ConfigError, first_line
from slm.memory.targets import Target
from slm.train.devices import quiet_native_stderr

INSTALL = {"gpu": 'pip install -e ".[plan-gpu]"  (jax-cuda12-plugin, ~480 MB)',
           "tpu": 'pip install -e ".[plan-tpu]"  (libtpu, ~690 MB)'}
PLUGIN = {"gpu": "jax_plugins.xla_cuda12", "tpu": "libtpu"}
# Per compute-capability major.minor: FP32 lanes per SM and the opt-in shared memory per block (CUDA
# programming guide, "Compute capabilities" table); the rest of a GpuTargetConfig is the card's own facts.
FPUS_PER_SM = {"8.0": 64, "8.6": 128, "8.9": 128, "9.0": 128}
SHARED_OPTIN_KIB = {"8.0": 163, "8.6": 99, "8.9": 99, "9.0": 227}
THREADS_PER_SM = {"8.0": 2048, "8.6": 1536, "8.9": 1536, "9.0": 2048}
CUDNN = (9, 8, 0)  # the cuDNN jax 0.10's CUDA wheels bring: fused attention is compiled as it would be


def gpu_target_config(facts: dict) -> str:
    """The GpuTargetConfig text proto of one GPU's spec file (slm/memory/target_specs)."""
    cc = facts["compute_capability"]
    major, minor = (int(x) for x in cc.split("."))
    kib = 1024
    return "\n".join([
        "gpu_device_info {",
        "  threads_per_block_limit: 1024", "  threads_per_warp: 32", "  shared_memory_per_block: 49152",
        f"  shared_memory_per_core: {facts['shared_memory_per_sm_kib'] * kib}",
        f"  threads_per_core_limit: {THREADS_PER_SM[cc]}",
        f"  core_count: {facts['sm_count']}", f"  fpus_per_core: {FPUS_PER_SM[cc]}",
        "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535", "  block_dim_limit_z: 65535",
        f"  memory_bandwidth: {int(facts['memory_bandwidth_gbs'] * 1e9)}",
        f"  l2_cache_size: {int(facts['l2_cache_mb'] * 2**20)}", f"  clock_rate_ghz: {facts['clock_ghz']}",
        f"  device_memory_size: {int(facts['memory_bytes'])}",
        f"  shared_memory_per_block_optin: {SHARED_OPTIN_KIB[cc] * kib}",
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
        "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
        "}",
        'platform_name: "CUDA"',
        f"dnn_version_info {{ major: {CUDNN[0]} minor: {CUDNN[1]} patch: {CUDNN[2]} }}",
        f'device_description_str: "{facts["device"]}"',
    ])


def plugin_installed(platform: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(PLUGIN[platform]) is not None
    except ModuleNotFoundError:  # jax_plugins itself absent
        return False


def target_devices(target: Target) -> list[Any]:
    """The target's compile-only devices (count of them), or a ConfigError saying which pip command adds the
    compiler for it."""
    if not plugin_installed(target.platform):
        raise ConfigError(f"--plan-for {target.name}: compiling for a {target.platform.upper()} here needs its XLA "
                          f"compiler; {INSTALL[target.platform]}")
    from jax.experimental import topologies

    # libtpu locks /tmp/libtpu_lockfile so that one process owns the chips; compile-only there are no chips, and
    # two plans (or a plan and the tests' workers) may compile at once
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    f = target.facts
    try:
        with quiet_native_stderr():
            if target.platform == "gpu":
                register_cuda_compiler()
                topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(f),
                                                    topology=f"1x1x{target.count}")
            else:
                topo = topologies.get_topology_desc(
                    platform="tpu", topology_name=f["topology"], chip_config_name=f["chip_config"],
                    chips_per_host_bounds=tuple(f["chips_per_host_bounds"]), num_slices=1, wrap=(False, False, False))
    except Exception as e:  # noqa: BLE001 - a plugin that cannot describe the target: one line
        raise ConfigError(f"--plan-for {target.name}: XLA could not describe this target here "
                          f"({type(e).__name__}: {first_line(e)[:200]})") from None
    return list(topo.devices)


def register_cuda_compiler() -> None:
    """Make sure jax's CUDA plugin is registered. jax registers its plugins once a process, and the CUDA plugin
    first checks the CUDA runtime's version unless jax_platforms leaves CUDA out: where jax's backends started
    without that (a notebook's `jax.devices()` before the plan, on a machine without CUDA) the check failed and
    no CUDA compiler was registered ("topology not implemented for cuda"). A compile needs no runtime: register
    it again with the check skipped (jax's own JAX_SKIP_CUDA_CONSTRAINTS_CHECK), for this call only."""
    from jax._src import xla_bridge

    xla_bridge._discover_and_register_pjrt_plugins()  # what jax does at its first backend or topology
    if "cuda" in xla_bridge._topology_factories:  # registered (or a real GPU's): nothing to do
        return
    import importlib

    plugin = importlib.import_module(PLUGIN["gpu"])
    skip = os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    try:
        plugin.initialize()
    finally:
        if skip is None:
            del os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"]
        else:
            os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = skip


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """While compiling for compile-only devices: no persistent compilation cache (a compile-only executable
    cannot be stored or loaded there: jax warns "PjRtCompiler must be constructed with a Client"), and a
    stand-in for cuDNN where this machine has none (cudnn_version). Both restored after."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as fa
    from jax.experimental.compilation_cache import compilation_cache

    cache, original = jax.config.jax_enable_compilation_cache, fa.check_cudnn_version
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # jax decides once a process whether the cache is used: after a train() it is
    fa.check_cudnn_version = cudnn_version(original)
    try:
        yield
    finally:
        fa.check_cudnn_version = original
        jax.config.update("jax_enable_compilation_cache", cache)
        compilation_cache.reset_cache()  # decided again at the next compile, with the setting restored


def cudnn_version(runtime: Callable[[], int]) -> Callable[[], int]:
    """jax asks the cuDNN *runtime* for its version before it emits cuDNN's fused attention, and a machine
    without a GPU has none: answer with the cuDNN jax's CUDA wheels bring (CUDNN), so the program compiled is
    the one the GPU runs. A real cuDNN, where there is one, answers for itself."""
    try:
        runtime()
        return runtime
    except Exception:  # noqa: BLE001 - no cuDNN here: stand in for it while lowering
        return lambda: CUDNN[0] * 10000 + CUDNN[1] * 100 + CUDNN[2]
