"""A GPU run's host RSS, predicted from a CPU (--plan-for): against the runs measured on an H200."""

import pytest
from helpers import ROOT

from slm.memory.estimate import estimate_memory_usage
from slm.memory.finetune import model_shape
from slm.memory.gpu_host import gpu_host_rss, load_transient_bytes

GEMMA = ROOT.parent / "shared" / "models" / "gemma-3-1b"
H200_MB = 143_771  # nvidia-smi's figure for the H200 the runs had


@pytest.mark.parametrize("fraction, measured_peak", [(0.75, 5_968), (0.25, 3_733)])
def test_the_h200_runs_peak_host_rss_is_predicted(fraction, measured_peak):
    """bench/gpu_trainer_run.py's Gemma-3-1B QLoRA run (random float32 weights, r16 nf4, seq 512 x 1, remat,
    bf16 compute) on an H200, 2026-11-27, cold compile cache: peak RSS 5,968 MB at jax's default pool (0.75)
    and 3,733 MB at XLA_PYTHON_CLIENT_MEM_FRACTION=0.25 (docs/memory.md). Both peaked while the weights loaded.
    (CUDA_CLIENT_MB was read from these runs' RSS after their compiles, before the load; the peak is VmHWM.)"""
    shape = model_shape(GEMMA)
    est = estimate_memory_usage(0, 512, 1, model=GEMMA, lora_rank=16, base_dtype="nf4", mixed_precision=True,
                                gradient_checkpointing=True, platform="gpu")
    h = gpu_host_rss(est, fraction * H200_MB, 1, load_transient_bytes(shape, "float32", "bfloat16"))
    assert h["peak"] == h["load"] > h["steps"]
    assert h["peak"] == pytest.approx(measured_peak, rel=0.05)


def test_the_allocator_table_is_a_32nd_of_each_cards_pool():
    """Measured with jax alone (one array placed) on the H200: 688 MB without preallocation, 2,924 MB with half
    the card's 143,771 MB as the pool (+2,236 MB: 1/32 of it is 2,246)."""
    est = {"framework_mb": 0.0, "data_pipeline_mb": 0.0, "step_slack_mb": 0.0, "checkpoint_staging_mb": 0.0}
    one, two = gpu_host_rss(est, 0.5 * H200_MB, 1), gpu_host_rss(est, 0.5 * H200_MB, 2)
    assert one["allocator_table"] == pytest.approx(2_924 - 688, rel=0.01)
    assert two["allocator_table"] == pytest.approx(2 * one["allocator_table"]) and one["load"] == 0.0
