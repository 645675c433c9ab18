"""--auto-fit's search: every setting that keeps the effective batch, its predicted whole-run peak, and its
predicted speed; the fastest that fits wins. Pure Python, no jax (`fit_to_budget` is the notebook's door).

The levers: micro-batch x accumulation, the host devices the micro-batch is split over (on CPU each holds a
replica of the state, so fewer devices can fit where more do not), 8-bit optimizer state, mixed precision,
gradient checkpointing (remat), for LoRA the frozen base's dtype, and checkpoint saves that wait for their
write (then no step runs beside the save's copy of the state: slm.memory.estimate.host_breakdown's
`save_alone`). The peak is slm.memory.estimate's arithmetic: deterministic, so the same command on the same
machine decides the same way every time; the trainer then compiles the choice and checks XLA's figure.

Speed (`relative_speed`) is a model fitted to timings of the trainer's own step (bench/fit_speed.py, 2026-11-25,
2-core AMD EPYC; 20M and 50M params, seq 256, micro-batch 1-64 on 1 or 2 host devices). What it captures:
- tokens per device per micro-step, T = micro-batch / devices x seq: at small T the step's fixed costs
  dominate (reading and accumulating every weight and gradient: T0 = 4.6e-6 x params tokens, 92 at 20M,
  230 at 50M), past a few thousand the activations spill out of cache (T1 = 24,500 tokens):
  speed ~ 1 / (1 + T0/T + T/T1). Micro-batch 1 at seq 256 runs at 0.7x the best, not 0.1x: accumulation
  no longer repeats the optimizer every micro-step (slm.optim.optimizer.LazyMultiSteps).
- two host devices gain 1.2x once each has >= 1,024 tokens; below that they gain nothing on 2 cores.
- remat costs 1.3x on CPU, bf16 activations 1.3x (no native bf16 arithmetic beyond the products), 8-bit
  state ~3%, and a save that waits for its write ~1% (once per --checkpoint-every steps).
On accelerators the rule is the usual one: the largest micro-batch, all devices, bf16 a gain.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from slm.errors import ConfigError
from slm.memory.estimate import (
    DATA_KEYS,
    MB,
    MemoryEstimate,
    device_breakdown,
    estimate_memory_usage,
    host_breakdown,
    parse_size,
)
from slm.memory.finetune import Finetune, model_shape
from slm.model.sizing import ModelShape, choose_shape, count_params, default_vocab_size, flops_per_token

T0_PER_PARAM, T0_MIN, T1 = 4.6e-6, 64.0, 24_500.0  # tokens per device: fixed-cost and cache scales (docstring)
CPU_DEVICE_GAIN, CPU_DEVICE_MIN_TOKENS = 1.2, 1024
CPU_COST = {"remat": 1.3, "mixed": 1.3, "eight": 1.03, "sync": 1.01}
ACCEL_COST = {"remat": 1.3, "mixed": 1 / 1.3, "eight": 1.03, "sync": 1.01}
USER_BONUS = 1.05  # the user's own setting wins against one predicted within 5% of it


def cpu_efficiency(params: int) -> float:
    """tokens/s = speed x this x peak FLOP/s / FLOPs per token on CPU: 0.35 at 10M (seq 512), 0.62 at 20M and 0.90
    at 50M (seq 256) measured on a 2-core AMD EPYC, larger models running larger products; shown, never ranked by."""
    return min(0.95, max(0.1, 0.34 * math.log(params / 1e6) - 0.43))


def relative_speed(seq_len: int, micro_per_device: int, devices: int, *, params: int, platform: str = "cpu",
                   remat: bool = False, mixed: bool = False, eight: bool = False, sync: bool = False) -> float:
    """Predicted tokens/s of a setting, relative (1.0: the best a CPU step reaches); module docstring."""
    tokens = micro_per_device * seq_len
    if platform == "cpu":
        speed = 1 / (1 + max(T0_MIN, T0_PER_PARAM * params) / tokens + tokens / T1)
        if devices > 1 and tokens >= CPU_DEVICE_MIN_TOKENS:
            speed *= CPU_DEVICE_GAIN
        cost = CPU_COST
    else:
        speed, cost = devices * tokens / (tokens + 2048), ACCEL_COST
    for lever, on in (("remat", remat), ("mixed", mixed), ("eight", eight), ("sync", sync)):
        speed /= cost[lever] if on else 1.0
    return speed


def fit_candidates(
    shape: ModelShape,
    seq_len: int,
    batch_size: int,
    accumulation: int,
    budget_bytes: int,
    *,
    max_devices: int,
    platform: str,
    data_mb: float,
    margin: float = 0.10,
    user: tuple[bool, bool, bool] = (False, False, False),
    finetune: Finetune | None = None,
    base_dtypes: tuple[str, ...] = (),
    optimizer: str = "adamw",
    loss_chunk: int | None = None,
    checkpoint_sync: str = "auto",
    saves_beside_steps: bool = True,
    peak_flops: float | None = None,
    chunk_lever: bool = False,
) -> list[dict]:
    """Every setting that keeps the effective batch (batch_size x accumulation sequences) and is predicted to
    fit (1 - margin) x budget (host RSS on CPU, device memory elsewhere), fastest first.

    Each candidate: batch_size (the micro-batch, a divisor of the effective batch), gradient_accumulation_steps,
    devices (a divisor of the micro-batch, at most `max_devices`), use_8bit_optimizer, use_mixed_precision,
    gradient_checkpointing, checkpoint_sync (only both ways when `checkpoint_sync` is "auto"), with LoRA
    base_dtype (`finetune.base_dtype` or one of `base_dtypes`), predicted_peak_mb, speed (relative_speed) and,
    given the devices' `peak_flops`, tokens_per_s. `saves_beside_steps`: False when the run ends before its
    first save. `chunk_lever` (--loss-chunk not given): where `loss_chunk` keeps the whole logits, also try
    the loss over 512-entry chunks (same loss; ~5% slower there, docs/performance.md), with key loss_chunk.
    The user's own setting (their micro-batch and `user` = their 8-bit, bf16, remat) wins ties within 5%.
    """
    effective = batch_size * accumulation
    own = finetune.base_dtype if finetune is not None else "float32"
    dtypes = (own,) + tuple(d for d in base_dtypes if d != own) if finetune is not None else (own,)
    syncs = {"auto": (False, True), "on": (True,), "off": (False,)}[checkpoint_sync]
    per_token, n = flops_per_token(shape, seq_len), count_params(shape)
    efficiency = cpu_efficiency(n) if platform == "cpu" else 0.4  # an accelerator's MFU, roughly
    whole = loss_chunk is not None and (loss_chunk == 0 or loss_chunk >= shape.vocab_size)
    chunks = (loss_chunk, 512) if chunk_lever and whole and shape.vocab_size > 512 else (loss_chunk,)
    out = []
    for micro in (d for d in range(1, effective + 1) if effective % d == 0):
        for devices in (k for k in range(1, min(max_devices, micro) + 1) if micro % k == 0):
            for dtype, eight, mixed, remat, chunk in itertools.product(dtypes, (False, True), (False, True),
                                                                       (False, True), chunks):
                ft = replace(finetune, base_dtype=dtype) if finetune is not None else None
                dev = device_breakdown(shape, seq_len, micro // devices, mixed_precision=mixed,
                                       gradient_checkpointing=remat, use_8bit_optimizer=eight,
                                       gradient_accumulation_steps=effective // micro, devices=devices,
                                       finetune=ft, platform=platform, optimizer=optimizer, loss_chunk=chunk)
                for sync in syncs:
                    alone = sync or not saves_beside_steps
                    host = host_breakdown(shape, dev, devices, platform, data_mb, eight, alone)["total"] * MB
                    peak = host if platform == "cpu" else dev["total"]
                    if peak > (1 - margin) * budget_bytes:
                        continue
                    speed = relative_speed(seq_len, micro // devices, devices, params=n, platform=platform, remat=remat,
                                           mixed=mixed, eight=eight, sync=sync) / (1.05 if dtype != own else 1.0)
                    speed /= 1.05 if chunk != loss_chunk else 1.0
                    mine = micro == batch_size and (eight, mixed, remat) == tuple(user) and dtype == own
                    out.append({"batch_size": micro, "gradient_accumulation_steps": effective // micro,
                                "devices": devices, "use_8bit_optimizer": eight, "use_mixed_precision": mixed,
                                "gradient_checkpointing": remat, "checkpoint_sync": sync,
                                "predicted_peak_mb": peak / MB, "speed": speed,
                                "rank": speed * (USER_BONUS if mine else 1.0),
                                **({"tokens_per_s": speed * efficiency * peak_flops / per_token} if peak_flops else {}),
                                **({"loss_chunk": chunk} if len(chunks) > 1 else {}),
                                **({"base_dtype": dtype} if finetune is not None else {})})
    return sorted(out, key=lambda c: (-c["rank"], c["predicted_peak_mb"]))


def smallest_setting(shape: ModelShape, seq_len: int, *, platform: str, data_mb: float, optimizer: str = "adamw",
                     finetune: Finetune | None = None, loss_chunk: int | None = None) -> tuple[str, float]:
    """The least memory a run of this model can take (micro-batch 1 on one device, 8-bit state, remat, bf16,
    saves that wait), described, and its predicted peak in MB: what a refusal names."""
    dev = device_breakdown(shape, seq_len, 1, mixed_precision=True, gradient_checkpointing=True,
                           use_8bit_optimizer=True, gradient_accumulation_steps=2, finetune=finetune,
                           platform=platform, optimizer=optimizer, loss_chunk=loss_chunk)
    host = host_breakdown(shape, dev, 1, platform, data_mb, True, True)["total"]
    peak = host if platform == "cpu" else dev["total"] / MB
    return ("micro-batch 1 on one device with 8-bit state, bf16, remat and saves that wait for their write", peak)


def fit_to_budget(
    budget: str | int,
    seq_len: int,
    batch_size: int,
    gradient_accumulation_steps: int = 1,
    *,
    model=None,
    target_params: int | None = None,
    vocab_size: int | None = None,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] | list[str] = ("q_proj", "v_proj"),
    base_dtype: str = "float32",
    allow_base_dtypes: tuple[str, ...] | list[str] = (),
    use_8bit_optimizer: bool = False,
    mixed_precision: bool = False,
    gradient_checkpointing: bool = False,
    platform: str = "gpu",
    devices: int = 1,
    margin: float = 0.10,
    loss_chunk: int | None = None,
    optimizer: str | None = None,
) -> MemoryEstimate:
    """--auto-fit from a notebook, before any download: the setting predicted fastest among those that keep
    the effective batch (batch_size x gradient_accumulation_steps sequences of seq_len) and fit `budget`
    ("24GB", or bytes) with `margin` to spare: device memory on an accelerator, host RSS on CPU.

    It ranks what fit_candidates ranks for the trainer's --auto-fit (micro-batch x accumulation, devices, remat,
    8-bit state, mixed precision, saves that wait for their write; the settings given here win ties), and for
    LoRA the base dtype too, but only among `base_dtype` and the `allow_base_dtypes` you name. The model is
    `model` (a config.json, its folder or dict: fine-tuning, LoRA with `lora_rank`) or `target_params`;
    `loss_chunk` and `optimizer` as estimate_memory_usage's. Returns the chosen settings, "budget_mb", "candidates" (how many
    fit), "runner_up" and the choice's estimate_memory_usage figures; raises ConfigError naming the smallest
    setting and its predicted peak when nothing fits. The trainer's --auto-fit then confirms by compiling.
    """
    budget_bytes = parse_size(budget, "budget") if isinstance(budget, str) else int(budget)
    shape = model_shape(model) if model is not None else choose_shape(
        target_params, vocab_size or default_vocab_size(target_params))
    finetune = Finetune(lora_rank, tuple(lora_targets), base_dtype) if model is not None or lora_rank else None
    optimizer = optimizer or ("adamw" if lora_rank else "muon")  # the trainer's default
    data_mb = estimate_memory_usage(0, seq_len, batch_size)["streaming_mb"]
    found = fit_candidates(shape, seq_len, batch_size, gradient_accumulation_steps, budget_bytes, max_devices=devices,
                           platform=platform, data_mb=data_mb, margin=margin,
                           user=(use_8bit_optimizer, mixed_precision, gradient_checkpointing), finetune=finetune,
                           base_dtypes=tuple(allow_base_dtypes), loss_chunk=loss_chunk, optimizer=optimizer)
    if not found:
        what, peak = smallest_setting(shape, seq_len, platform=platform, data_mb=data_mb, optimizer=optimizer,
                                      finetune=finetune, loss_chunk=loss_chunk)
        raise ConfigError(f"nothing fits {budget} with a {margin:.0%} margin at seq_len {seq_len} for "
                          f"{count_params(shape):,} parameters: the smallest setting ({what}) needs ~{peak:,.0f} MB; "
                          f"shorten seq_len, use LoRA or a lower base_dtype, or raise the budget")
    best = found[0]
    est = estimate_memory_usage(
        0, seq_len, best["batch_size"], model=shape if finetune is not None else None,
        shape=shape, lora_rank=lora_rank, lora_targets=tuple(lora_targets),
        base_dtype=best.get("base_dtype", base_dtype), mixed_precision=best["use_mixed_precision"],
        use_8bit_optimizer=best["use_8bit_optimizer"], gradient_accumulation_steps=best["gradient_accumulation_steps"],
        gradient_checkpointing=best["gradient_checkpointing"], devices=best["devices"], platform=platform,
        loss_chunk=loss_chunk, optimizer=optimizer, checkpoint_sync=best["checkpoint_sync"])
    chosen = {k: v for k, v in best.items() if k != "rank"}
    runner = {k: v for k, v in found[1].items() if k != "rank"} if len(found) > 1 else None
    return MemoryEstimate({**chosen, "budget_mb": round(budget_bytes / MB, 3), "candidates": len(found),
                           "runner_up": runner, **{k: v for k, v in est.items() if k not in DATA_KEYS}})
