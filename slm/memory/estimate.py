"""Whole-run memory arithmetic: what a training run will hold, per device and in host RSS. Pure Python, no jax.

`estimate_memory_usage` (also importable from streaming_data_loader, where the seed guide put it) is the
notebook entry point; `fit_candidates` is what --auto-fit ranks, and `fit_to_budget` ranks the same from a
notebook. Fine-tuning a pretrained config.json, LoRA's frozen base and adapters, and what changes on an
accelerator (remat as designed, the CUDA runtime) are in slm/memory/finetune.py.

Per device (bytes; N = parameters, Bd = micro-batch per device, S = seq len, L/D/F/H/V = layers, width,
MLP width, heads, vocab; see slm/model/sizing.py):

    params        4N                      float32 master weights (also under mixed precision)
    gradients     4N                      float32, a temporary of the step (XLA:GPU holds fewer: finetune.py)
    optimizer     8N  float32 AdamW m, v  | ~2.03N with 8-bit state (model_sizing.optimizer_state_bytes)
    accumulation  4N  when accumulating   optax.MultiSteps' float32 gradient sum
    activations   Bd*S*L*(a*D + b*F + c*H*S') + t*Bd*H*Sb*S   what the backward pass keeps, incl. attention
                  scores: S' = visible_keys(S) keys a query's block is computed against, Sb its block's rows
                  (slm.model.attention); the last term one block's scores, a transient
    logits        Bd*S*V*e                     logits, softmax and their gradient
    update        4*(u*N + m*H)                the optimizer update's temporaries (H: Muon's hidden matrices)
    device total  params + gradients + optimizer + accumulation + max(activations + logits, update)

The backward pass and the optimizer update do not overlap: the activations are freed before the update
runs, so the step's peak is the larger of the two phases, not their sum. The update phase matters when
the micro-batch is small next to the model (50M params at micro-batch 1). Its temporaries are
4 * (u * N + m * H), H the hidden matrices' parameters (Muon's share; 0 with AdamW): AdamW needs one
parameter-sized float32 temporary (u = 1), the 8-bit update dequantizes m and v (u = 2.3); Muon's
Newton-Schulz iterations hold m = 2.8 matrix-sized float32 temporaries per hidden matrix (1.85 with its
bfloat16 momentum). Read from XLA's memory analysis of the trainer's step at 1M/5M/20M params (micro-batch
1, seq 16: within 0.07 of 4N at each). Accumulation adds nothing: the optimizer runs in a loop of one trip on
the micro-step that emits, in place (slm.optim.optimizer.LazyMultiSteps.step_params).

With FSDP over n devices (`fsdp=True`) params, optimizer state, accumulation and the update are divided
by n, and `gathered` (4N) is added: XLA:CPU all-gathers the full weights for the step, and the gradients
stay full-size before their reduce-scatter (bench/sharding.py@1a39af2: 10M params on 8 devices, 237 MB/device
compiled vs 259 predicted, +9%; DP 300 vs 321, +7%). libtpu, with remat under mixed precision, does neither: the
gradients are reduce-scattered and `gathered` is its own fitted terms (slm.memory.finetune.TPU_FSDP_FULL).

The coefficients a, b, c, e, t (bytes) are fitted to XLA's memory analysis of this trainer's compiled step
(jax 0.10.2, XLA:CPU; per key 20 configurations, 5 shapes x 4 batch/seq up to seq 2,048, on one device and
partitioned over two: bench/lora_memory_xla.py --fit scratch, 2026-11-26; worst error 1.9% in float32, 5.7% in bf16):
XLA's CPU scheduler keeps most activations live even with remat (remat saves 0-10% on CPU). Other backends
differ; the pre-flight compiles the real step and reads XLA's figure (bench/memory_accuracy.py checks these).

Host RSS (`host_breakdown`; MB) is the whole run's peak, not one step's:

    runtime       RUNTIME_MB + COMPILE_MB_PER_LAYER * L, + COMPILE_8BIT_MB + COMPILE_8BIT_MB_PER_M * N/1e6
                  with 8-bit state: Python, JAX/XLA, the tokenizer, the eval set and the compiled programs,
                  after the compiler's freed memory went back to the OS (the trainer trims the heap after each
                  compile; glibc had kept 300-1,300 MB of it: docs/memory.md)
    data          the data pipeline (estimate_memory_usage's data side)
    devices       on CPU, every host device's total (device memory *is* host memory there)
    step slack    STEP_SLACK_MB + STEP_SLACK_PER_STATE * state: what the first steps, the eval and the sample
                  hold beside the compiled step (the state's init program, the eval program's activations,
                  the loader thread, the host's copy of a batch)
    checkpoint    SAVE_STAGING_MB + SAVE_STAGING_PER_BYTE * state (state = params + optimizer state +
                  accumulator, one replica): orbax's host copy of the state and tensorstore's write buffers,
                  beside the step that runs while an asynchronous save writes. With `save_alone` (saves that
                  wait for their write, or a run that ends before its first save) only what the copy adds
                  over the step's temporaries, which are freed between steps.

The runtime, slack and staging terms are fitted to 24 trainer runs (2026-11-25, jax 0.10.2, glibc malloc,
2-core AMD EPYC: bench/memory_accuracy.py, 1M-100M params x seq 256-1024 x float32/8-bit x remat x 1/2
devices, runs shorter and longer than --checkpoint-every): the pre-flight's prediction within -2.8% .. +10.2%
of the measured peak RSS (docs/memory.md's table). The pre-flight (preflight.py) puts XLA's figure for devices.
"""

from __future__ import annotations

import re
from dataclasses import astuple, dataclass

from slm.errors import ConfigError
from slm.memory.finetune import (
    GPU_RUNTIME_MB,
    LORA_ACCEL_COEFFICIENTS,
    Finetune,
    backward_bytes,
    fsdp_gathered_bytes,
    gpu_mixed_gradient_bytes,
    lora_breakdown,
    model_shape,
    tpu_fsdp_full_bytes,
    tpu_full_update_bytes,
    tpu_fsdp_lora_bytes,
)
from slm.model.sizing import (
    ModelShape,
    choose_shape,
    count_params,
    default_vocab_size,
    hidden_matrix_shapes,
    largest_matrix,
    muon_stacks,
    optimizer_state_bytes,
)

MB = 1 << 20


@dataclass(frozen=True)
class ActivationCoefficients:
    """Bytes per token per layer per unit of D, F and H x visible_keys(S), per token per vocab entry, and per
    score of one attention block (a transient of the backward pass, not kept per layer)."""

    a: float
    b: float
    c: float
    e: float
    t: float = 0.0


# Fitted on XLA:CPU (jax 0.10.2) by relative least squares; keys: (remat, mixed_precision, partitioned).
# Refitted 2026-11-26 (evening) for the attention's unnormalised probabilities and transposed dV/dK products
# (bench/lora_memory_xla.py --fit scratch: 5 shapes x 4 batch/seq up to seq 2,048, 20 compiles a key; worst
# error 6.3-7.6% in float32, 4.1-4.8% under mixed precision, against 1.4-5.7% for the attention before: its
# peak follows these terms less closely). The shapes' F/D is ~2.7 throughout, so a and b trade against each
# other: only a*D + b*F is determined there.
COEFFICIENTS = {
    (False, False, False): ActivationCoefficients(3.99, 38.68, 3.31, 7.63, 18.32),
    (False, True, False): ActivationCoefficients(53.42, 10.75, 3.35, 7.54, 15.33),
    (True, False, False): ActivationCoefficients(0.00, 36.07, 3.25, 7.62, 19.27),
    (True, True, False): ActivationCoefficients(84.57, 0.00, 3.25, 7.46, 16.21),
    (False, False, True): ActivationCoefficients(1.08, 40.17, 3.13, 7.74, 19.31),
    (False, True, True): ActivationCoefficients(83.54, 0.00, 3.32, 7.62, 15.28),
    (True, False, True): ActivationCoefficients(0.00, 36.39, 3.05, 7.73, 20.58),
    (True, True, True): ActivationCoefficients(86.02, 0.00, 3.27, 7.53, 16.05),
}

# Fitted to XLA's own buffer assignment for the target's compiler, from this CPU (--plan-for's compile-only
# devices: bench/plan_for_xla.py fit, 2026-11-25, jax 0.10.2): an H100 for "gpu", a TPU v5e for "tpu"; keys
# (remat, mixed precision); (a, b, c, e, t, k) with k a constant in bytes (t 0: the block transient is in c).
# On a GPU the bf16 step runs cuDNN's fused attention, which keeps no (S, S) scores (c ~ 0); XLA:GPU and the
# TPU compiler fuse far more than XLA:CPU, so their activations are a fraction of COEFFICIENTS' (docs/memory.md,
# "Plan for the GPU or TPU").
# Without remat the five are per layer and token (as COEFFICIENTS); with remat, those of the one block being
# recomputed, beside every other block's input (D x compute bytes a token: backward_bytes' layer path).
# Fit errors (worst of 20 steps, 5 shapes x 4 token counts): 6.8%, 4.1%; remat 27.8%, 15.5%. A TPU's are fitted
# to libtpu's compile for a v5e chip, its HBM figure (slm.train.builder.compiled_peak; bench/plan_for_xla.py fit
# --target v5e-1, 2026-11-28, libtpu 0.0.42.1) on the widths people train there (384-1,024, heads of 32-128) at 2
# and 6 layers, seq 512-2,048, minimising the relative error of the whole peak: worst 10.2% at 6 layers (32% at
# 2, where fixed costs weigh in); float32 compute (the flags' default; 2026-11-29, the same 18 shapes): worst 11.8%.
# It runs training's blocked attention and keeps its probabilities for the backward (c: ~2.3 bytes a score, in
# bf16 plus their float32 sums), no fused kernel. Settings not fitted there fall back to COEFFICIENTS.
ACCEL_COEFFICIENTS: dict[str, dict[tuple[bool, bool], tuple[float, ...]]] = {
    "gpu": {(False, False): (0.0, 22.04, 8.56, 7.74, 0.0, 0.0), (False, True): (0.0, 11.41, 0.03, 7.97, 0.0, 0.0),
            (True, False): (0.0, 0.0, 10.23, 4.97, 0.0, 0.0), (True, True): (0.0, 0.0, 0.07, 7.72, 0.0, 0.0)},
    "tpu": {(False, True): (0.0, 6.26, 1.83, 2.63, 0.0, 0.0), (False, False): (0.0, 12.72, 3.24, 2.34, 0.0, 0.0)},
}

# Update-phase temporaries in units of 4N (4H for Muon's hidden matrices), keyed by 8-bit state (module docstring).
UPDATE_TEMPS = {False: 1.0, True: 2.3}
MUON_UPDATE_TEMPS = {False: 2.8, True: 1.85}
# XLA:GPU, skipping a non-finite step by `where`, holds 0.07-0.6 matrix-sized temporaries beyond the state at Muon's
# update (H100, 1B/350M/100M at 1 x 512, 2026-12-05; 1.92 under the cond) and fuses AdamW's part; 8-bit: CPU's.
GPU_MUON_UPDATE_TEMPS = {False: 0.5, True: MUON_UPDATE_TEMPS[True]}
# XLA:GPU: AdamW's float32 update in one fused pass, no temporaries (5 H100 full fine-tunes, 2026-11-27: 0.96-0.99x);
# 8-bit (skip by `where`) leaf by leaf, the largest last: its gradient (none accumulating) + 11.5 B an element
GPU_ADAMW_UPDATE_TEMPS, GPU_ADAM8_LARGEST_LEAF = 0.0, 4 + 11.5
# libtpu's holds more (a full fine-tune under remat and mixed precision, float32 moments): finetune.TPU_FULL_UPDATE.
# libtpu, data parallel: the Newton-Schulz work is shared out (slm.optim.muon.shared_newton_schulz), but each chip
# holds the stacks it was handed and the all-gather's result whole (one of them padded to a multiple of the chips),
# their slices and relayout copies: TPU_DP_MUON_UPDATE float32 copies of the hidden matrices beside AdamW's 4N.
# Traced in libtpu's live ranges; 11 shapes compiled for a v5e-8 (bench/plan_for_xla.py muon-dp, widths 512-1,024,
# 4-12 layers, 2 and 8 sequences of 512 a chip, 2026-11-29): the copies run 2.0 (512 wide) to 4.5 (960), and 3.5
# plans those within -9.1% ... +9.5% but 640 / 512 wide at 2 sequences +15% / +26% (docs/memory.md).
TPU_DP_MUON_UPDATE = 3.5

# Host RSS terms (MB), fitted to 24 trainer runs (module docstring). Post-compile RSS after the heap's trim:
# float32 4/9/15/20 layers 387-394/415-429/451-486/488-517; 8-bit adds 15-80 (1M-100M params).
RUNTIME_MB = 370.0
COMPILE_MB_PER_LAYER = 6.5
COMPILE_8BIT_MB = 15.0
COMPILE_8BIT_MB_PER_M = 0.65
# Peak - (post-compile RSS + devices x XLA's figure) in runs whose only save was the last: 161-477 MB,
# growing with the state (13-1,166 MB); the rest, in runs that stepped beside a save, 1.1-1.5 x the state.
STEP_SLACK_MB = 185.0
STEP_SLACK_PER_STATE = 0.23
SAVE_STAGING_MB = 25.0
SAVE_STAGING_PER_BYTE = {False: 1.35, True: 1.35}  # keyed by 8-bit state (the same once the heap is trimmed)


def device_breakdown(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    *,
    mixed_precision: bool = False,
    gradient_checkpointing: bool = False,
    use_8bit_optimizer: bool = False,
    gradient_accumulation_steps: int = 1,
    devices: int = 1,
    fsdp: bool = False,
    finetune: Finetune | None = None,
    platform: str = "cpu",
    optimizer: str = "adamw",
    loss_chunk: int | None = None,
) -> dict[str, int]:
    """Bytes per device for one replica of the train step (micro_batch = sequences on this device).

    "total" is the step's peak: the state and gradients plus the larger of the backward pass
    (activations + logits, and a LoRA step's base casts) and the optimizer update ("update"); the other
    keys are its parts. `finetune` with a LoRA rank: a frozen base and its adapters (slm.memory.finetune).
    `loss_chunk`: --loss-chunk (None: its default for the vocabulary), the logits' columns held at once.
    Off CPU, remat is modelled as on an accelerator; on a GPU GPU_RUNTIME_MB is added (finetune's docstring).
    """
    remat, mixed, ideal = bool(gradient_checkpointing), bool(mixed_precision), gradient_checkpointing and platform != "cpu"
    accumulating = gradient_accumulation_steps > 1
    lora = finetune is not None and finetune.lora_rank is not None
    # libtpu's own fits of a full fine-tune are AdamW's with float32 moments under remat and mixed precision: 8-bit
    # state and Muon keep XLA:CPU's terms (not fitted), over libtpu's figure: Muon 22-66%, 8-bit (updated in chunks,
    # adam8bit.CHUNK_BLOCKS) Qwen3-0.6B +46% (docs/memory.md)
    tpu_full = platform == "tpu" and remat and mixed and not lora and optimizer == "adamw" and not use_8bit_optimizer
    tpu_fsdp = platform == "tpu" and remat and mixed and fsdp and devices > 1 and (lora or tpu_full)
    gpu_bf16_grads = platform == "gpu" and mixed and optimizer == "adamw" and not use_8bit_optimizer and devices == 1
    if lora:
        out = lora_breakdown(shape, finetune, seq_len, micro_batch, mixed_precision=mixed, gradient_checkpointing=remat,
                             use_8bit_optimizer=use_8bit_optimizer, accumulation=gradient_accumulation_steps,
                             platform=platform, loss_chunk=loss_chunk, data_parallel=devices > 1 and not fsdp)
        n = out["params"] // 4
    else:
        n = count_params(shape)
        accumulation = 4 * n + 8 if accumulating else 0
        if tpu_full:  # LoRA's TPU terms: the same blocks and loss (TPU_FULL_UPDATE, TPU_FSDP_FULL fitted with them)
            coefficients = per_layer = LORA_ACCEL_COEFFICIENTS["tpu"][(True, True)]
        elif (remat, mixed) in ACCEL_COEFFICIENTS.get(platform, {}):  # the target compiler's own fit (remat: one block)
            coefficients = ACCEL_COEFFICIENTS[platform][(remat, mixed)]
            per_layer = coefficients if remat else None
        else:
            coefficients = astuple(COEFFICIENTS[(remat and not ideal, mixed, devices > 1)])
            per_layer = astuple(COEFFICIENTS[(False, mixed, devices > 1)]) if ideal else None
        activations, logits = backward_bytes(shape, micro_batch * seq_len, seq_len, coefficients, per_layer,
                                             2 if mixed else 4, loss_chunk, platform)
        out = {
            "params": 4 * n,
            "gradients": gpu_mixed_gradient_bytes(shape, accumulating) if gpu_bf16_grads else 4 * n,
            "optimizer_state": optimizer_state_bytes(shape, use_8bit_optimizer, gradient_accumulation_steps,
                                                     optimizer=optimizer) - accumulation,
            "accumulation": accumulation,
            "activations": activations,
            "logits": logits,
        }
    out["update"] = (tpu_full_update_bytes(shape) if tpu_full and not tpu_fsdp  # libtpu's, on whole weights
                     else update_bytes(shape, n, bool(use_8bit_optimizer), "adamw" if lora else optimizer,
                                       1 if fsdp else devices, platform, accumulating))
    if platform == "gpu":  # the CUDA context; libtpu's reserve lies outside the HBM it offers a program
        out["runtime"] = int(GPU_RUNTIME_MB * MB)
    if fsdp and devices > 1:
        for key in ("params", "base_params", "optimizer_state", "accumulation", "update"):
            if key in out:
                out[key] //= devices
        if lora and tpu_fsdp:  # libtpu's own fit (TPU_FSDP_LORA)
            out["gathered_params"] = tpu_fsdp_lora_bytes(shape, finetune.base_dtype, out["base_casts"], devices,
                                                         micro_batch * seq_len, 2)  # bf16 compute
            out["base_casts"] = 0  # a shard's, counted in gathered_params
        elif tpu_fsdp:  # libtpu's own fit (TPU_FSDP_FULL): the gradients reduce-scattered, no whole model gathered
            out["gradients"] //= devices
            out["gathered_params"], out["tied_head"] = tpu_fsdp_full_bytes(shape, devices, micro_batch * seq_len)
        else:
            out["gathered_params"] = (fsdp_gathered_bytes(shape, finetune.base_dtype, out["base_casts"], devices)
                                      if lora else 4 * n)
    phases = ("activations", "logits", "base_casts", "update", "tied_head")
    backward = out["activations"] + out["logits"] + out.get("base_casts", 0)
    out["total"] = sum(out[k] for k in out if k not in phases) + max(backward, out["update"], out.get("tied_head", 0))
    return out


def update_bytes(shape: ModelShape, trained: int, use_8bit: bool, optimizer: str = "adamw", shared: int = 1,
                 platform: str = "cpu", accumulating: bool = False) -> int:
    """The optimizer update's temporaries (module docstring): AdamW's on every trained parameter, plus Muon's
    Newton-Schulz buffers on the hidden matrices, whose work `shared` data-parallel devices split between them
    (slm.optim.muon: 50M params on 2 devices, XLA 1,221 MB/device, this 1,220; on one 1,464 and 1,469)."""
    if platform == "gpu" and optimizer == "adamw" and use_8bit:  # the largest leaf's, less the other gradients
        leaf = GPU_ADAM8_LARGEST_LEAF - 4 * accumulating  # the gradients went into the accumulator (counted)
        return max(0, int(leaf * min(trained, largest_matrix(shape)) - 4 * trained))
    hidden = sum(a * b for a, b in hidden_matrix_shapes(shape)) if optimizer == "muon" else 0
    muon = (GPU_MUON_UPDATE_TEMPS if platform == "gpu" else MUON_UPDATE_TEMPS)[use_8bit]
    temps = GPU_ADAMW_UPDATE_TEMPS if platform == "gpu" and not use_8bit else UPDATE_TEMPS[use_8bit]
    if platform == "tpu" and hidden and shared > 1 and not use_8bit:  # libtpu's: whole on every chip, one padded
        padded = sum(r * c * -(-n // shared) * shared for (r, c), n in muon_stacks(shape).items())
        return int(4 * (temps * trained + (TPU_DP_MUON_UPDATE - 1) * hidden + padded))
    return int(4 * (temps * trained + muon * hidden / max(shared, 1)))


class MemoryEstimate(dict):
    """A dict of figures (MB unless the key says otherwise) that prints as a table in a terminal or notebook."""

    def rows(self) -> list[tuple[str, str]]:
        return [(k, f"{v:,.1f}" if isinstance(v, float) else str(v)) for k, v in self.items()]

    def __repr__(self) -> str:
        width = max(len(k) for k in self)
        return "\n".join(f"{k:<{width}}  {v:>12}" for k, v in self.rows())

    def _repr_html_(self) -> str:
        body = "".join(f"<tr><td>{k}</td><td style='text-align:right'>{v}</td></tr>" for k, v in self.rows())
        return f"<table><tr><th>item</th><th>value</th></tr>{body}</table>"


def state_mb(dev: dict[str, int], devices: int) -> float:
    """The train state's host bytes in MB, one replica (params + optimizer state + accumulator): what a
    checkpoint save copies. Under FSDP each device holds 1/devices of it, so the host holds all of it."""
    per_device = dev["params"] + dev["optimizer_state"] + dev["accumulation"]
    return per_device * (devices if "gathered_params" in dev else 1) / MB


def step_slack_mb(state: float) -> float:
    """What the first steps, the eval and the sample hold beside the compiled step (MB; module docstring)."""
    return STEP_SLACK_MB + STEP_SLACK_PER_STATE * state


def checkpoint_staging_mb(state: float, use_8bit_optimizer: bool) -> float:
    """What the step after an asynchronous save holds on top of itself: orbax's copy of the state and
    tensorstore's buffers."""
    return SAVE_STAGING_MB + SAVE_STAGING_PER_BYTE[bool(use_8bit_optimizer)] * state


def runtime_mb(shape: ModelShape, use_8bit_optimizer: bool, trained: int | None = None) -> float:
    """RSS right after the step is compiled, before any state: the runtime and the compiler's leftovers
    (`trained`: the parameters the 8-bit optimizer updates; all of them unless given)."""
    mb = RUNTIME_MB + COMPILE_MB_PER_LAYER * shape.n_layers
    if use_8bit_optimizer:
        mb += COMPILE_8BIT_MB + COMPILE_8BIT_MB_PER_M * (count_params(shape) if trained is None else trained) / 1e6
    return mb


def host_breakdown(
    shape: ModelShape,
    dev: dict[str, int],
    devices: int,
    platform: str,
    data_mb: float,
    use_8bit_optimizer: bool = False,
    save_alone: bool = False,
) -> dict[str, float]:
    """Predicted whole-run peak RSS in MB and its parts (module docstring); `dev` is device_breakdown's. On CPU a
    LoRA base replicated over the host devices counts once (they alias one buffer: slm.train.devices.put_frozen).
    `save_alone`: no step runs beside a save's copy of the state (saves that wait for their write, or a run that
    ends before its first save): the copy then only counts where it outgrows the step's temporaries."""
    held = devices * dev["total"] - (devices - 1) * (0 if "gathered_params" in dev else dev.get("base_params", 0))
    out = {
        "runtime": runtime_mb(shape, use_8bit_optimizer, dev["gradients"] // 4),
        "data": data_mb,
        "devices": held / MB if platform == "cpu" else 0.0,
        "step_slack": step_slack_mb(state_mb(dev, devices)),
        "checkpoint_staging": staging_beside(dev, devices, platform, use_8bit_optimizer, save_alone),
    }
    out["total"] = sum(out.values())
    return out


def staging_beside(dev: dict[str, int], devices: int, platform: str, use_8bit_optimizer: bool,
                   save_alone: bool) -> float:
    """The checkpoint staging's share of the whole run's peak (MB): all of it when steps run beside a save;
    with `save_alone` what the copy adds over the step's temporaries (on CPU devices' memory is the host's)."""
    staging = checkpoint_staging_mb(state_mb(dev, devices), use_8bit_optimizer)
    if not save_alone:
        return staging
    temporaries = devices * (dev["total"] - dev["params"] - dev["optimizer_state"] - dev["accumulation"]) / MB
    return max(0.0, staging - (temporaries if platform == "cpu" else 0.0))


def data_side(num_sequences: int, seq_len: int, batch_size: int, shuffle_buffer_size: int, avg_document_chars: int,
              prefetch: int, chunk_chars: int) -> tuple[MemoryEstimate, float, float]:
    """estimate_memory_usage's data keys (formulas in its docstring), the full-load MB and the streaming MB."""
    mb = 1 / MB
    row_bytes = seq_len * 2 * 4
    full = num_sequences * row_bytes * mb
    batches = (prefetch + 2) * batch_size * row_bytes * mb
    shuffle = (shuffle_buffer_size if shuffle_buffer_size > 1 else 0) * (avg_document_chars + 49) * mb
    chunk = chunk_chars * 5 * mb
    streaming_mb = batches + shuffle + chunk
    frac = 1 - streaming_mb / full if full > 0 else 0.0
    out = MemoryEstimate({
        "full_load_mb": round(full, 3),
        "streaming_mb": round(streaming_mb, 3),
        "memory_savings": f"{frac * 100:.2f}%",
        "memory_savings_frac": frac,
        "streaming_batches_mb": round(batches, 3),
        "shuffle_buffer_mb": round(shuffle, 3),
        "tokenize_chunk_mb": round(chunk, 3),
    })
    return out, full, streaming_mb


def estimate_memory_usage(
    num_sequences: int,
    seq_len: int,
    batch_size: int,
    shuffle_buffer_size: int = 10_000,
    avg_document_chars: int = 1_000,
    prefetch: int = 2,
    chunk_chars: int = 256_000,
    *,
    target_params: int | None = None,
    shape=None,
    vocab_size: int | None = None,
    mixed_precision: bool = False,
    use_8bit_optimizer: bool = False,
    gradient_accumulation_steps: int = 1,
    gradient_checkpointing: bool = False,
    streaming: bool = True,
    devices: int = 1,
    platform: str = "cpu",
    sharding: str = "dp",
    model=None,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] | list[str] = ("q_proj", "v_proj"),
    base_dtype: str = "float32",
    optimizer: str | None = None,
    loss_chunk: int | None = None,
    checkpoint_sync: bool = False,
) -> dict:
    """Memory of a run in MB: the data side always, and the whole run when a model is given.

    Data side (the seed's keys):
    full_load_mb   = num_sequences * seq_len * 2 arrays (inputs, targets) * 4 bytes (int32)
    streaming_mb   = batches alive ((prefetch + 2) batches: queue, the one being built, the one in use)
                   + shuffle buffer (shuffle_buffer_size * (avg_document_chars + 49 bytes of str header))
                   + one tokenization chunk (chunk_chars as text + ~4 bytes/char of token ids, upper bound)
    memory_savings = "xx.xx%" (1 - streaming / full load), also as a fraction in memory_savings_frac.

    With `target_params` (shape from model_sizing.choose_shape, vocab from `vocab_size` or the default for
    that size) or an explicit model_sizing.ModelShape `shape`, also the device breakdown per device
    (params, gradients, optimizer state, accumulation buffer, activations, logits, update; formulas in
    this module's docstring), `device_total_mb`, and the whole run's peak `host_rss_mb` = framework
    (runtime + compile leftovers) + data pipeline (streaming or full load) + on CPU the device totals of
    all `devices` host devices + step slack + checkpoint staging (`host_breakdown`). `batch_size` is the
    global micro-batch, split over `devices`; `sharding="fsdp"` splits the train state over them too.

    Fine-tuning: `model` is a pretrained model's config.json (its path, its folder or its dict; no weights
    are read), full fine-tuning of that shape; with `lora_rank`, rank-r adapters on `lora_targets` of a
    frozen base held in `base_dtype` (slm/memory/finetune.py): the breakdown gains base_params_mb and
    base_casts_mb, params/gradients/optimizer state are the adapters', and `trainable_params` and
    `model_params` are added. `platform="gpu"` adds runtime_mb (the CUDA context) to the device total.
    `optimizer`: the trainer's default unless given: "muon" (Muon's one momentum on the hidden matrices
    instead of Adam's two, and its Newton-Schulz temporaries: slm/optim/muon.py), "adamw" with LoRA;
    `loss_chunk`: --loss-chunk (None: its default with float32 products). `checkpoint_sync`: saves wait for
    their write (or the run ends before its first save), so no step runs beside the save's copy of the state
    (host_breakdown's `save_alone`). Prints as a table, also in notebooks.
    """
    out, full, streaming_mb = data_side(num_sequences, seq_len, batch_size, shuffle_buffer_size, avg_document_chars,
                                        prefetch, chunk_chars)
    if shape is None and target_params is None and model is None:
        return out
    if model is not None:
        shape = model_shape(model)
    elif shape is None:
        shape = choose_shape(target_params, vocab_size or default_vocab_size(target_params))
    finetune = Finetune(lora_rank, tuple(lora_targets), base_dtype) if model is not None or lora_rank else None
    optimizer = optimizer or ("adamw" if lora_rank else "muon")
    if finetune is not None:
        out["model_params"] = count_params(shape)
        out["trainable_params"] = finetune.trainable_params(shape)
    if batch_size % devices:
        raise ValueError(f"batch_size {batch_size} does not split over {devices} devices")
    dev = device_breakdown(shape, seq_len, batch_size // devices, mixed_precision=mixed_precision,
                           gradient_checkpointing=gradient_checkpointing, use_8bit_optimizer=use_8bit_optimizer,
                           gradient_accumulation_steps=gradient_accumulation_steps, devices=devices,
                           fsdp=sharding == "fsdp", finetune=finetune, platform=platform, optimizer=optimizer,
                           loss_chunk=loss_chunk)
    for k, v in dev.items():
        out[f"{k}_mb" if k != "total" else "device_total_mb"] = round(v / MB, 3)
    data_mb = streaming_mb if streaming else full
    host = host_breakdown(shape, dev, devices, platform, data_mb, use_8bit_optimizer, checkpoint_sync)
    out["data_pipeline_mb"] = round(data_mb, 3)
    for key, k in (("framework_mb", "runtime"), ("step_slack_mb", "step_slack"),
                   ("checkpoint_staging_mb", "checkpoint_staging"), ("host_rss_mb", "total")):
        out[key] = round(host[k], 3)
    return out


_UNITS = {"": MB, "b": 1, "k": 2**10, "m": MB, "g": 2**30, "t": 2**40}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|(b))?\s*", re.IGNORECASE)


def parse_size(text: str, flag: str = "--memory-budget") -> int:
    """Bytes in a size like '8GB', '512MB', '1.5G', '800MiB', '2048' (a plain number is MB).

    Units are binary whatever the spelling: K/KB/KiB = 2**10, M/MB/MiB = 2**20, G/GB/GiB = 2**30,
    T/TB/TiB = 2**40 (memory is reported in binary units, so '8GB' means what `free -g` shows).
    """
    m = _SIZE_RE.fullmatch(text) if isinstance(text, str) else None
    value = float(m.group(1)) if m else 0.0
    if not m or value <= 0:
        raise ConfigError(f"{flag} {text!r}: use a size like 8GB or 512MB")
    unit = (m.group(2) or m.group(3) or "").lower()
    return round(value * _UNITS[unit])


DATA_KEYS = ("full_load_mb", "streaming_mb", "memory_savings", "memory_savings_frac", "streaming_batches_mb",
             "shuffle_buffer_mb", "tokenize_chunk_mb")


def __getattr__(name: str):
    """fit_candidates and fit_to_budget live in slm.memory.fit; importable from here too, as they were."""
    if name in ("fit_candidates", "fit_to_budget"):
        from slm.memory import fit

        return getattr(fit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
