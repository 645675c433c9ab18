"""What a run on a GPU holds in its host's RAM, predicted from any machine (`--plan-for`): the rented
machine's RAM is as finite as its card's (seed 002's ml.g5.xlarge: 16 GiB beside a 24 GB A10G). Pure Python.

A GPU run's RSS, measured on an H200 (2026-11-27, jax 0.11.2 with its CUDA 13 plugin; docs/memory.md, "Host
RSS on a GPU, predicted"), is the trainer's CPU runtime (slm.memory.estimate.runtime_mb) plus:
- the CUDA client's host side: the driver, cuBLAS/cuDNN and the compiled programs' images, ~1.3 GB beyond the
  CPU runtime (CUDA_CLIENT_MB: pre-flight's reading after the sampler's compile, less the formula's runtime
  and the table below, was 1,835 and 1,839 MB at two pool sizes, Gemma-3-1B QLoRA);
- XLA's GPU allocator's table: 8 bytes per 256 of its pool (1/32), made at its first allocation and kept
  (ALLOCATOR_TABLE; the pool is jax's preallocated fraction of each card this process drives);
- the data pipeline, the step slack and the checkpoint's staging, as on CPU (slm.memory.estimate);
- while --init-from's weights load, what the read holds beside what it has placed (load_transient_bytes):
  the GPU holds the weights, the host one layer or the embedding at a time.
The run's peak is the larger of the steps' and the load's. A TPU host's runtime was never measured: no figure.
"""

from __future__ import annotations

from slm.memory.estimate import MB
from slm.memory.finetune import DTYPE_BYTES, matmul_weights
from slm.model.sizing import ModelShape

CUDA_CLIENT_MB = 1300.0
ALLOCATOR_TABLE = 1 / 32
READ_CHUNK = 64 << 20  # bytes: a tensor stored wider than it is held is converted this much at a time


def read_buffer_bytes(n: int, stored_bytes: int, held_bytes: int, chunk_bytes: int = READ_CHUNK,
                      same: bool = False) -> int:
    """Bytes the read holds beside a tensor of `n` values as it is held: one chunk when it narrows, the tensor
    as stored when it converts otherwise (bf16 to float16 too), nothing when stored as held (`same`)."""
    if same:
        return 0
    return min(n * stored_bytes, chunk_bytes) if stored_bytes > held_bytes else n * stored_bytes


def load_transient_bytes(shape: ModelShape, stored: str, held: str) -> int:
    """What reading a Hugging Face folder of this shape holds beyond what it has placed, from the shape alone
    (slm.io.hf_import.read_transient_mb reads the real tensors' headers): the larger of the embedding (or an
    untied head) as held plus its read buffer, and twice one layer as held (as read, and as assembled).
    `stored`: the checkpoint's dtype (config.json's torch_dtype); `held`: the dtype it is read into."""
    n_top = shape.vocab_size * shape.d_model
    top = n_top * DTYPE_BYTES[held] + read_buffer_bytes(n_top, DTYPE_BYTES[stored], DTYPE_BYTES[held],
                                                         same=stored == held)
    layer = matmul_weights(shape)[0] + 2 * shape.d_model  # a block's kernels and its two norms
    return max(top, 2 * layer * DTYPE_BYTES[held])


def gpu_host_rss(est: dict, pool_mb: float, gpus: int, load_bytes: int = 0) -> dict[str, float]:
    """The predicted host RSS of a GPU run, MB, and its parts: `est` is estimate_memory_usage's dict for the
    run on the GPU (its data pipeline, step slack and staging); `pool_mb` the pool jax takes on each of the
    `gpus` this process drives; `load_bytes` what the weights' read holds (0: no --init-from)."""
    out = {"runtime": est["framework_mb"] + CUDA_CLIENT_MB, "allocator_table": gpus * pool_mb * ALLOCATOR_TABLE,
           "data": est["data_pipeline_mb"], "step_slack": est["step_slack_mb"],
           "checkpoint_staging": est["checkpoint_staging_mb"], "weights_read": load_bytes / MB}
    base = out["runtime"] + out["allocator_table"] + out["data"]
    out["steps"] = base + out["step_slack"] + out["checkpoint_staging"]
    out["load"] = base + out["weights_read"] if load_bytes else 0.0
    out["peak"] = max(out["steps"], out["load"])
    return out
