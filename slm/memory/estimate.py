"""Whole-run memory arithmetic: what a training run will hold, per device and in host RSS. Pure Python, no jax.

`estimate_memory_usage` (also importable from streaming_data_loader, where the seed guide put it) is the
notebook entry point; `fit_candidates` is what --auto-fit ranks, and `fit_to_budget` ranks the same from a
notebook. Fine-tuning a pretrained config.json, LoRA's frozen base and adapters, and what changes on an
accelerator (remat as designed, the CUDA runtime) are in slm/memory/finetune.py.

Per device (bytes; N = parameters, Bd = micro-batch per device, S = seq len, L/D/F/H/V = layers, width,
MLP width, heads, vocab; see slm/model/sizing.py):

    params        4N                      float32 master weights (also under mixed precision)
    gradients     4N                      float32, a temporary of the step
    optimizer     8N  float32 AdamW m, v  | ~2.03N with 8-bit state (model_sizing.optimizer_state_bytes)
    accumulation  4N  when accumulating   optax.MultiSteps' float32 gradient sum
    activations   Bd*S*L*(a*D + b*F + c*H*S)   what the backward pass keeps, incl. attention scores
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
1, seq 16: within 0.07 of 4N at each). Accumulation adds nothing: the optimizer runs inside a cond on the
micro-step that emits (slm.optim.optimizer.LazyMultiSteps).

With FSDP over n devices (`fsdp=True`) params, optimizer state, accumulation and the update are divided
by n, and `gathered` (4N) is added: XLA:CPU all-gathers the full weights for the step, and the gradients
stay full-size before their reduce-scatter (bench/sharding.py: 10M params on 8 devices, 237 MB/device
compiled vs 259 predicted, +9%; DP 300 vs 321, +7%).

The coefficients a, b, c, e (bytes) are fitted to XLA's memory analysis of this trainer's compiled step
(jax 0.10.2, XLA:CPU; one device: 48 configurations, 4 shapes x 3 batch/seq x remat x bf16, worst error
3.7%; two devices (the step partitioned over a mesh): 64 configurations, worst error 4.1%):
XLA's CPU scheduler keeps most activations live even with remat, so gradient checkpointing saves only
5-12% on CPU. Other backends and versions differ; the trainer's pre-flight compiles the real step and
reads XLA's own figure, and bench/memory_accuracy.py measures these formulas against it.

Host RSS (`host_breakdown`; MB) is the whole run's peak, not one step's:

    runtime       RUNTIME_MB + COMPILE_MB_PER_LAYER * L, + COMPILE_8BIT_MB + COMPILE_8BIT_MB_PER_M * N/1e6
                  with 8-bit state: Python, JAX/XLA, the tokenizer, and what compiling the step leaves in
                  the heap (glibc keeps the compiler's freed memory; the 8-bit step compiles to a much
                  larger program: +450 MB at 20M)
    data          the data pipeline (estimate_memory_usage's data side)
    devices       on CPU, every host device's total (device memory *is* host memory there)
    step slack    STEP_SLACK_MB: the state's init program, the loader thread, the host's copy of a batch
    checkpoint    SAVE_STAGING_MB + k * state (params + optimizer state + accumulator, one replica;
                  k = SAVE_STAGING_PER_BYTE): saves are asynchronous, so the step after a save runs while
                  orbax still holds its host copy of the state and tensorstore its write buffers

The runtime and checkpoint terms are fitted to peak RSS of trainer runs on this machine (2026-11,
jax 0.10.2, glibc malloc, tinystories, eval and checkpoint every step; docs/memory.md has the table).
Before these two terms the estimate was framework 560 + data + devices, which missed the compile's
leftovers (8-bit state: 20M at micro-batch 8 x 2, predicted 1,544, measured 1,905-2,317 MB) and the
save staging (+170 to +1,340 MB on the step after a save). The pre-flight (slm/memory/preflight.py)
replaces the runtime term by the RSS it measures right after the compile, and the device term by XLA's
figure.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import astuple, dataclass, replace

from slm.errors import ConfigError
from slm.memory.finetune import (
    GPU_RUNTIME_MB,
    Finetune,
    backward_bytes,
    lora_breakdown,
    model_shape,
)
from slm.model.sizing import (
    ModelShape,
    choose_shape,
    count_params,
    default_vocab_size,
    hidden_matrix_shapes,
    optimizer_state_bytes,
)

MB = 1 << 20


@dataclass(frozen=True)
class ActivationCoefficients:
    """Bytes per token per layer per unit of D, F and H*S, and per token per vocab entry."""

    a: float
    b: float
    c: float
    e: float


# Fitted on XLA:CPU (jax 0.10.2) by relative least squares; keys: (remat, mixed_precision, partitioned).
# A step partitioned over several devices keeps fewer attention bytes per token than a one-device step.
COEFFICIENTS = {
    (False, False, False): ActivationCoefficients(3.29, 29.04, 12.47, 11.45),
    (False, True, False): ActivationCoefficients(35.12, 14.68, 12.03, 8.40),
    (True, False, False): ActivationCoefficients(1.98, 25.50, 12.47, 11.48),
    (True, True, False): ActivationCoefficients(41.79, 13.19, 11.75, 7.50),
    (False, False, True): ActivationCoefficients(11.94, 26.03, 8.29, 12.45),
    (False, True, True): ActivationCoefficients(39.16, 12.77, 7.84, 9.96),
    (True, False, True): ActivationCoefficients(10.94, 22.37, 8.29, 12.49),
    (True, True, True): ActivationCoefficients(49.57, 10.24, 7.60, 8.52),
}

# Update-phase temporaries in units of 4N, and in units of 4H for Muon's hidden matrices; keyed by 8-bit
# state (module docstring).
UPDATE_TEMPS = {False: 1.0, True: 2.3}
MUON_UPDATE_TEMPS = {False: 2.8, True: 1.85}

# Host RSS terms (MB), fitted to trainer runs on XLA:CPU (module docstring). Post-compile RSS measured
# (fresh compile cache): float32 7/12/15 layers 526-587/640/657, 8-bit 12/15 layers 871-1,092/1,346-1,371.
RUNTIME_MB = 540.0
COMPILE_MB_PER_LAYER = 8.0
COMPILE_8BIT_MB = 150.0
COMPILE_8BIT_MB_PER_M = 12.0
# Step slack and checkpoint staging: fitted together over 30 runs (7 calibration runs + 23 of
# bench/autofit_sweep.py), the pre-flight's error -4.1% .. +7.2%. What the step after a save added,
# over the state it copies: 1.6-1.8x (float32), 0.9-1.6x (8-bit), +170-200 MB at 5M.
STEP_SLACK_MB = 75.0  # first step's peak - (post-compile RSS + devices x XLA's figure): 56-102 MB in 8 runs
SAVE_STAGING_MB = 50.0
SAVE_STAGING_PER_BYTE = {False: 1.5, True: 1.2}  # keyed by 8-bit state


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
    Off CPU, remat is modelled as on an accelerator and GPU_RUNTIME_MB is added (finetune's docstring).
    """
    remat, mixed, ideal = bool(gradient_checkpointing), bool(mixed_precision), gradient_checkpointing and platform != "cpu"
    accumulating = gradient_accumulation_steps > 1
    if finetune is not None and finetune.lora_rank is not None:
        out = lora_breakdown(shape, finetune, seq_len, micro_batch, mixed_precision=mixed, gradient_checkpointing=remat,
                             use_8bit_optimizer=use_8bit_optimizer, accumulation=gradient_accumulation_steps,
                             platform=platform, loss_chunk=loss_chunk)
        n = out["params"] // 4
    else:
        n = count_params(shape)
        accumulation = 4 * n + 8 if accumulating else 0
        activations, logits = backward_bytes(
            shape, micro_batch * seq_len, seq_len, astuple(COEFFICIENTS[(remat and not ideal, mixed, devices > 1)]),
            astuple(COEFFICIENTS[(False, mixed, devices > 1)]) if ideal else None, 2 if mixed else 4, loss_chunk, platform)
        out = {
            "params": 4 * n,
            "gradients": 4 * n,
            "optimizer_state": optimizer_state_bytes(shape, use_8bit_optimizer, gradient_accumulation_steps,
                                                     optimizer=optimizer) - accumulation,
            "accumulation": accumulation,
            "activations": activations,
            "logits": logits,
        }
    out["update"] = update_bytes(shape, n, bool(use_8bit_optimizer), optimizer if finetune is None else "adamw")
    if platform != "cpu":
        out["runtime"] = int(GPU_RUNTIME_MB * MB)
    if fsdp and devices > 1:
        for key in ("params", "base_params", "optimizer_state", "accumulation", "update"):
            if key in out:
                out[key] //= devices
        out["gathered_params"] = out.get("base_params", 0) * devices or 4 * n
    phases = ("activations", "logits", "base_casts", "update")
    backward = out["activations"] + out["logits"] + out.get("base_casts", 0)
    out["total"] = sum(v for k, v in out.items() if k not in phases) + max(backward, out["update"])
    return out


def update_bytes(shape: ModelShape, trained: int, use_8bit: bool, optimizer: str = "adamw") -> int:
    """The optimizer update's temporaries (module docstring): AdamW's on every trained parameter, plus Muon's
    Newton-Schulz buffers on the hidden matrices."""
    hidden = sum(a * b for a, b in hidden_matrix_shapes(shape)) if optimizer == "muon" else 0
    return int(4 * (UPDATE_TEMPS[use_8bit] * trained + MUON_UPDATE_TEMPS[use_8bit] * hidden))


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


def checkpoint_staging_mb(state: float, use_8bit_optimizer: bool) -> float:
    """What the step after an asynchronous save holds on top of itself: orbax's copy of the state and
    tensorstore's buffers, freed into glibc's arenas and not reused by the step's threads."""
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
) -> dict[str, float]:
    """Predicted whole-run peak RSS in MB and its parts (module docstring); `dev` is device_breakdown's."""
    out = {
        "runtime": runtime_mb(shape, use_8bit_optimizer, dev["gradients"] // 4),
        "data": data_mb,
        "devices": devices * dev["total"] / MB if platform == "cpu" else 0.0,
        "step_slack": STEP_SLACK_MB,
        "checkpoint_staging": checkpoint_staging_mb(state_mb(dev, devices), use_8bit_optimizer),
    }
    out["total"] = sum(out.values())
    return out


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
) -> list[dict]:
    """Settings that keep the effective batch (batch_size x accumulation sequences) and fit the budget.

    Each candidate: micro-batch (a divisor of the effective batch), the
    matching accumulation, 8-bit optimizer state, mixed precision, gradient checkpointing, on as many of
    `max_devices` as divide the micro-batch (as devices.data_mesh does); the user's own setting first
    when it fits, then the rest ordered by an estimated speed cost (halving the micro-batch ~10%, remat ~30%, bf16 on CPU ~30% (it is emulated) but
    a gain on accelerators, 8-bit state ~1%) and kept only when the predicted peak is within
    (1 - margin) x budget: host RSS on CPU, device memory elsewhere. The trainer compiles the first
    candidates and takes the first one XLA agrees fits. With `finetune` (a LoRA run) each candidate also
    names its base dtype: `finetune.base_dtype`, or one of `base_dtypes` the user allows (cost 0.05, so
    the given dtype wins at equal speed).
    """
    effective = batch_size * accumulation
    own = finetune.base_dtype if finetune is not None else "float32"
    dtypes = (own,) + tuple(d for d in base_dtypes if d != own) if finetune is not None else (own,)
    out = []
    for micro in sorted({d for d in range(1, effective + 1) if effective % d == 0}, reverse=True):
        devices = max(k for k in range(1, min(max_devices, micro) + 1) if micro % k == 0)
        for dtype, eight, mixed, remat in itertools.product(dtypes, (False, True), (False, True), (False, True)):
            ft = replace(finetune, base_dtype=dtype) if finetune is not None else None
            dev = device_breakdown(shape, seq_len, micro // devices, mixed_precision=mixed,
                                   gradient_checkpointing=remat, use_8bit_optimizer=eight,
                                   gradient_accumulation_steps=effective // micro, devices=devices,
                                   finetune=ft, platform=platform, optimizer=optimizer, loss_chunk=loss_chunk)
            host = host_breakdown(shape, dev, devices, platform, data_mb, eight)["total"] * MB
            peak = host if platform == "cpu" else dev["total"]
            if peak > (1 - margin) * budget_bytes:
                continue
            cost = (0.1 * math.log2(effective / micro) + 0.3 * remat + 0.01 * eight
                    + (0.3 if platform == "cpu" else -0.1) * mixed + 0.05 * (dtype != own))
            if micro == batch_size and (eight, mixed, remat) == tuple(user) and dtype == own:
                cost = -1.0  # the user's own setting (user = their 8-bit, bf16, remat flags) when it fits
            out.append({"batch_size": micro, "gradient_accumulation_steps": effective // micro, "devices": devices,
                        "use_8bit_optimizer": eight, "use_mixed_precision": mixed,
                        "gradient_checkpointing": remat, "predicted_peak_mb": peak / MB, "cost": cost,
                        **({"base_dtype": dtype} if finetune is not None else {})})
    return sorted(out, key=lambda c: (c["cost"], c["predicted_peak_mb"]))


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
    optimizer: str = "adamw",
    loss_chunk: int | None = None,
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
    `optimizer="muon"`: Muon's one momentum on the hidden matrices instead of Adam's two (slm/optim/muon.py);
    `loss_chunk`: --loss-chunk (None: its default with float32 products). Prints as a table, also in notebooks.
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
    host = host_breakdown(shape, dev, devices, platform, data_mb, use_8bit_optimizer)
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
) -> MemoryEstimate:
    """--auto-fit from a notebook, before any download: the setting that is cheapest in compute, keeps the
    effective batch (batch_size x gradient_accumulation_steps sequences of seq_len) and is predicted to fit
    `budget` ("24GB", or bytes) with `margin` to spare: device memory on an accelerator, host RSS on CPU.

    It ranks what fit_candidates ranks for the trainer's --auto-fit (micro-batch x accumulation, remat,
    8-bit state, mixed precision; the settings given here win when they fit), and for LoRA the base dtype
    too, but only among `base_dtype` and the `allow_base_dtypes` you name. The model is `model` (a
    config.json, its folder or dict: fine-tuning, LoRA with `lora_rank`) or `target_params`; `loss_chunk` as
    estimate_memory_usage's. Returns the
    chosen settings, "budget_mb", "candidates" (how many fit) and the choice's estimate_memory_usage
    figures; raises ConfigError when nothing fits. The trainer's --auto-fit then confirms by compiling.
    """
    budget_bytes = parse_size(budget, "budget") if isinstance(budget, str) else int(budget)
    shape = model_shape(model) if model is not None else choose_shape(
        target_params, vocab_size or default_vocab_size(target_params))
    finetune = Finetune(lora_rank, tuple(lora_targets), base_dtype) if model is not None or lora_rank else None
    found = fit_candidates(shape, seq_len, batch_size, gradient_accumulation_steps, budget_bytes, max_devices=devices,
                           platform=platform, data_mb=estimate_memory_usage(0, seq_len, batch_size)["streaming_mb"],
                           margin=margin, user=(use_8bit_optimizer, mixed_precision, gradient_checkpointing),
                           finetune=finetune, base_dtypes=tuple(allow_base_dtypes), loss_chunk=loss_chunk)
    if not found:
        raise ConfigError(f"nothing fits {budget} with a {margin:.0%} margin at seq_len {seq_len} for "
                          f"{count_params(shape):,} parameters, even at micro-batch 1 with remat and 8-bit state; "
                          f"shorten seq_len, use LoRA or a lower base_dtype, or raise the budget")
    best = found[0]
    est = estimate_memory_usage(
        0, seq_len, best["batch_size"], model=shape if finetune is not None else None,
        shape=shape, lora_rank=lora_rank, lora_targets=tuple(lora_targets),
        base_dtype=best.get("base_dtype", base_dtype), mixed_precision=best["use_mixed_precision"],
        use_8bit_optimizer=best["use_8bit_optimizer"], gradient_accumulation_steps=best["gradient_accumulation_steps"],
        gradient_checkpointing=best["gradient_checkpointing"], devices=best["devices"], platform=platform,
        loss_chunk=loss_chunk)
    chosen = {k: v for k, v in best.items() if k != "cost"}
    return MemoryEstimate({**chosen, "budget_mb": round(budget_bytes / MB, 3), "candidates": len(found),
                           **{k: v for k, v in est.items() if k not in DATA_KEYS}})
