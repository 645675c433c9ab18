"""What fine-tuning a pretrained model holds per device, from its config.json alone (no weights). Pure Python.

`estimate_memory_usage(..., model=CONFIG, lora_rank=16, base_dtype="float16")` and `fit_to_budget`
(slm/memory/estimate.py) use this module. Without `lora_rank` a `model=` is full fine-tuning, which holds
what a from-scratch run of that shape holds. The LoRA layout is the trainer's (slm/model/lora.py,
slm/train/step.py), per device, in bytes (n = adapter parameters, N = the base's; tokens = micro-batch
per device x S):

    base_params   N * bytes(base_dtype)  the frozen base (float32, bfloat16 or float16): no gradient, no state;
                                         nf4: 4.5 bits a block matmul weight, the embedding/head bfloat16,
                                         norms and biases float32 (base_param_bytes)
    params        4n                     adapters A (in, r) and B (r, out) per target per layer, float32
    gradients     4n
    optimizer     8n AdamW | ~2.03n 8-bit (sizing.adam_state_bytes of the adapters' shapes)
    accumulation  4n + 8 when accumulating (optax.MultiSteps' float32 sum)
    base_casts    copies of base weights in the dtype the matmuls run in (below)
    activations   tokens*L*(a*D + b*F + c*H*S)  the backward runs through every layer, down to layer 0's
                                                adapters, though no base weight gets a gradient
    logits        tokens*V*e                    float32 (B, L, V) and the cross-entropy's temporaries
    update        the adapters' optimizer update, as for a full run (estimate.update_bytes)

Base casts: the model casts each weight to the compute dtype per matmul (bfloat16 under mixed precision,
else float32), and JAX's autodiff keeps that cast as the residual the backward's input gradient needs.
On XLA:CPU every bfloat16/float16 dot runs in float32 (bf16 is emulated), so a base that is not float32,
or any base under mixed precision, gets float32 copies of all its matmul weights, held for the whole
step, remat or not (CAST_CPU, fitted). On a GPU, XLA:GPU's own compile decides (LORA_ACCEL_CASTS, fitted to
its buffer assignment): a 16-bit base keeps about one kernel's copy at a time, a float32 base under mixed
precision most of its bf16 blocks, an nf4 base one kernel dequantised. On a TPU with remat under mixed
precision, and with neither (the flags' default), libtpu's compile decides the same way (fitted: with both a
float32 base about half a block's copy and its tied embedding cast whole, an nf4 base ~3 kernels' worth of its
dequantisation on one chip, ~1.2 on each of several (TPU_DP_NF4_KERNELS); with neither a 16-bit base no copy,
a float32 base's tied embedding half again (relaid out for the head), an nf4 base ~4 kernels' worth). Elsewhere
on a TPU (assumed, not fitted) only a base whose dtype differs from the compute dtype is cast: all layers' copies
are held without remat, one layer's with it (a block's casts are recomputed in its backward), and the head's copy
always.

Gradient checkpointing on an accelerator is modelled as it is meant to work: each block's input kept
(D x compute bytes per token per layer) plus one block's activations while it is recomputed. XLA:CPU
keeps recomputed activations live (docs/memory.md), so on CPU the fitted remat coefficients apply. On a
GPU the activations' terms are XLA:GPU's own (LORA_ACCEL_COEFFICIENTS); on a TPU libtpu's with remat under
mixed precision and with neither, else still XLA:CPU's.
On a GPU GPU_RUNTIME_MB (the CUDA context) is added to the device total; not on a TPU, whose runtime's HBM lies
outside what libtpu offers a program (the target's usable figure).

An nf4 base is dequantised per matmul and again for its backward (slm.model.nf4.nf4_linear), so no block
weight is held in a wider dtype: its casts are the head's (held bfloat16, like a bfloat16 base's) plus one
kernel dequantised at a time in the compute dtype (NF4_TRANSIENT, measured on XLA:CPU).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace

from slm.errors import ConfigError
from slm.model.hf_config import shape_from_hf_config
from slm.model.sizing import (
    ModelShape,
    adam_state_bytes,
    attention_block,
    count_params,
    hidden_matrix_shapes,
    logit_columns,
    lora_param_shapes,
    visible_keys,
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "nf4": 2}  # nf4: its non-block matrices (base_param_bytes)
NF4_BYTES = 0.5 + 4 / 64  # a 4-bit code per weight and a float32 absmax per block of 64 (slm.model.nf4)
CHUNKED_BYTES_PER_D = 64  # --loss-chunk's loop beyond its chunk of logits, per token (backward_bytes)

# Outside XLA's buffers on a GPU: the CUDA context (driver and lazily loaded kernels, ~300-400 MB since
# CUDA 11.7's lazy loading and over 1 GB before it: pytorch/pytorch#107667, #20532), cuBLAS/cuDNN handles
# and workspaces, and the allocator's fragmentation. An assumption, not measured here (no GPU).
GPU_RUNTIME_MB = 600.0

# LoRA activation coefficients (a, b, c, e; bytes per token) keyed (remat, mixed_precision), one device,
# fitted by relative least squares to XLA:CPU's memory analysis of the LoRA train step at abstract shapes
# (jax 0.10.2; smollm2-135m, qwen2.5-0.5b, tinyllama-1.1b and mistral-7b shapes at 2 and 4 layers, seq
# 256/512, batch 1/2, every base dtype: 160 compiles, each within -1.2..+2.6% of XLA's peak). Under mixed
# precision `a` fitted slightly negative (-0.9..-0.6) and is pinned to 0. Remat saves ~22% of b on CPU.
# The committed step at full depth, all four models: -2.3..+3.6% (bench/lora_memory_xla.py); kept for the
# blocked causal attention (c now per visible key, t 0): -2.3..+4.6% (2026-11-26, --quick).
LORA_COEFFICIENTS = {
    (False, False): (10.31, 18.11, 12.37, 7.91, 0.0),
    (False, True): (0.0, 13.01, 12.83, 8.08, 0.0),
    (True, False): (10.36, 14.08, 12.37, 7.91, 0.0),
    (True, True): (0.0, 13.05, 12.96, 8.09, 0.0),
}
# XLA:CPU's float32 copies of the base's matmul weights, per 4 bytes of them (fitted: 0.95-0.97); under
# mixed precision a base that is not bfloat16 also keeps the head's bfloat16 rounding (2 bytes/weight).
CAST_CPU = 0.96
# Qwen3's per-head q/k RMSNorms keep ~14 bytes per normed q and k element per token and layer beyond the
# coefficients (fitted to XLA:CPU at 2 and 4 layers of qwen3-0.6b, f32 and bf16 compute, bf16 and nf4 bases:
# 12-15; without it the full-depth estimate was -7% of XLA's).
QK_NORM_BYTES = 14.0
# Gemma 3's block (sandwich norms, q/k norms over 256-wide heads, GeGLU) keeps more per layer than the
# coefficients' Llama blocks: (bytes per token x D, bytes per D^2) a layer, by compute dtype's bytes, fitted to
# XLA:CPU's LoRA step at 2 and 4 layers of gemma-3-1b's shape, seq 256 and 512, bf16 and nf4 bases (the same
# at float32 with SwiGLU: the norms; under mixed precision GeGLU's). Without it the full-depth Gemma-3-1B
# estimate was -11..-13% of XLA's (2026-11-27).
GEMMA_BLOCK_BYTES = {4: (19.7, 3.4), 2: (10.0, 3.6)}
# LoRA on a GPU: (a, b, c, e, t, k) as estimate.ACCEL_COEFFICIENTS (without remat per layer and token; with it one
# block's, beside every other block's input), keyed (remat, mixed precision); and the base's copies in the compute dtype
# (LORA_ACCEL_CASTS: kernels, blocks of a 16-bit base; kernels, blocks of a float32 one; nf4 kernels; a float base's
# tied head): a float base whose dtype is not the compute dtype as its largest kernel and its blocks (every layer's, one
# with remat), an nf4 base as its largest kernel dequantised. Fitted to XLA:GPU's buffer assignment for a compile-only
# H100 (bench/lora_fit_accel.py, 2026-11-27, jax 0.10.2: 4 shapes x 2/4 layers x float32/bf16/nf4 bases, float16 on two,
# x seq 512 x 1 / 1,024 x 2: 56 compiles a key; worst error 6.6%, 6.4%, 6.8%, and 13.7% with remat under mixed
# precision, where an nf4 kernel's dequantisation overlaps the activations' peak on some shapes and not others). XLA:GPU
# fuses most casts into the matmuls (it keeps the narrowing float32-to-bf16 copies, not a 16-bit base's) and runs the
# backward on far fewer temporaries than XLA:CPU: LORA_COEFFICIENTS' figures had been +0% .. +401% over its peak.
LORA_ACCEL_COEFFICIENTS: dict[str, dict[tuple[bool, bool], tuple[float, ...]]] = {
    "gpu": {(False, False): (52.85, 7.40, 0.824, 6.50, 0.0, 5.7 * 2**20),
            (False, True): (15.75, 3.94, 0.0, 5.52, 0.0, 8.9 * 2**20),
            (True, False): (43.35, 17.15, 1.490, 0.88, 0.0, 4.9 * 2**20),
            (True, True): (25.27, 0.96, 0.0, 5.16, 0.0, 0.0)},
}
# On a TPU, libtpu's own (remat under mixed precision only, the default there; others fall back to the CPU's):
# fitted to its compile for a v5e chip, the HBM figure (slm.train.builder.tpu_hbm; bench/lora_fit_accel.py,
# 2026-11-28, libtpu 0.0.42.1: SmolLM2-135M, Qwen2.5-0.5B and Mistral-7B at 2 and 4 layers x float32/bf16/nf4 bases
# x seq 512 x 1 / 1,024 x 2, and SmolLM2 at 8 and 30, Qwen2.5 at 8, bf16/nf4: 48 compiles; worst 20.7%, 41 within
# 10%; the worst Mistral-7B's nf4 base at 512 tokens: libtpu holds more of its dequantisation there than at 2,048,
# which no term in the tokens follows). A seventh term: ~4.7 KB a unit of D for each layer past the first,
# whatever the tokens: libtpu holds more a layer than the remat-saved inputs (SmolLM2's 30 layers at 1 x 512: an
# arena of 91 MiB for 38 MiB of buffers, 59% fragmented; fitted at 2 and 4 layers only, it was planned 24-33% under).
# A float32 base's tied embedding is cast whole for the head there (the casts' sixth term). Without remat in float32
# compute (the flags' default), refitted the same way (2026-11-29: the same three models at 2 and 4 layers, SmolLM2 at
# 30, Qwen2.5 at 8, float32/bf16/nf4 bases x 1 x 512 / 2 x 1,024, and SmolLM2/Qwen2.5 at 2 and 4 layers, SmolLM2 at 30,
# float32/bf16 bases x 32 x 128 / 8 x 512, the CLI's many short sequences; 66 compiles, worst 24.7% (nf4 bases),
# float32 bases -9.2% .. +7.6%, bf16 ones at 4,096 tokens to -16%; XLA:CPU's terms were -53% .. +167%): libtpu copies
# no 16-bit base to float32, holds a float32 base's tied embedding about half again (relaid out for the head; at many
# tokens not always at the peak, which the sum cannot follow), an nf4 base ~4 kernels dequantised. Fitted at 512 and
# 2,048 tokens only, the depth term (~7.8 KB) stood in for the tokens' and the CLI's default (SmolLM2-135M, 32 x 128)
# was planned -15%; now +8.4%, the depth term 0.
LORA_ACCEL_COEFFICIENTS["tpu"] = {(True, True): (0.57, 2.82, 0.611, 0.0, 0.0, 6.6 * 2**20, 4692.0),
                                  (False, False): (50.86, 1.54, 1.556, 0.0, 0.0, 0.0, 0.0)}
LORA_ACCEL_CASTS = {"gpu": {(False, False): (0.11, 0.02, 0.0, 0.0, 0.70, 0.0),
                            (False, True): (0.39, 0.0, 0.50, 0.87, 0.66, 0.0),
                            (True, False): (0.15, 0.0, 0.0, 0.0, 0.93, 0.0),
                            (True, True): (0.0, 0.17, 0.0, 0.67, 0.90, 0.0)},
                    "tpu": {(True, True): (0.0, 0.0, 0.0, 0.40, 3.04, 0.71),
                            (False, False): (0.0, 0.0, 0.0, 0.0, 4.11, 0.49)}}
# An nf4 base on several TPU chips (data parallel, one SPMD program): libtpu fuses the dequantisation into the matmuls
# there; on one chip it emits both halves as (out, in / 64, 32) arrays, lane-padded 4x, and holds ~3-4 kernels of them
# (the casts' nf4 term above, fitted on one chip). Kernels held dequantised instead, by (remat, mixed precision):
# minimax over the v5e-8 sweep's 7 QLoRA rows and Llama-3.2-1B / TinyLlama at 2 and 8 layers (2026-12-06; the same
# on 2, 4 and 8 chips): -7.3% .. +7.3% (were -4.7% .. +13.9%; -7.4% .. +8.1% after the scales' fix). Without remat
# in float32 (the flags' default) 0.8: minimax over Llama-3.2-1B at 2/4/8/16 layers, TinyLlama at 2/22, Qwen2.5-0.5B
# at 2/24, SmolLM2-135M at 30, Mistral-7B at 2 on 8 chips, 1 x 512: -11.0% .. +11.2% (the one chip's 4.11 read them
# -0.7% .. +88.8%, once the scales stopped being held a layer: slm.model.nf4.dequantize_halves).
TPU_DP_NF4_KERNELS = {(True, True): 1.2, (False, False): 0.8}
# libtpu's LoRA step with its base split over the chips (FSDP; remat under mixed precision), beyond each chip's
# shard of the state and the activations: every block's base shard again (nf4: its codes, else 16-bit), one block
# gathered, a tied embedding gathered (16-bit), an untied head, the casts of a shard (nf4's, a float32 base's), the
# tokens of all the chips x D x compute bytes (libtpu gathers activations over the chips in the backward), and with
# an nf4 base tokens x layers x D x compute bytes (its per-layer hold grows with the tokens; a bf16 base's does not).
# Fitted: bench/lora_fit_accel.py collect --target v5e-8 --devices 8 (2026-11-28 night, libtpu 0.0.42.1, the HBM
# figure and LoRA's TPU terms with their per-layer term: TinyLlama, Llama-3.2-1B, Qwen2.5-0.5B, Mistral-7B at 2 and
# 8 layers, bf16/nf4 bases, 1 x 512 and 2 x 1,024 a chip; 32 compiles, worst 33.5% (Mistral-7B's nf4 base at 8
# layers: 510 MB at 512 tokens, 1,684 at 2,048), 18 within 10%; the terms before: worst 61%, 11 within 10%).
TPU_FSDP_LORA = (0.61, 0.15, 0.58, 0.19, 0.0, 0.0, 2.15, 1.72)
# A full fine-tune (every weight trained, from scratch too) on one TPU chip (or each of a data-parallel run's),
# remat under mixed precision, beyond 16N: libtpu's AdamW update holds ~0.6 float32 copies of every block's weights
# and ~0.8 of a tied embedding (~2.9 of an untied embedding and head), whatever the tokens; the update phase, the
# peak, where XLA:CPU's and the GPU's hold 1 and 0. Where a block kernel's last dimension is not a whole number of
# 128 lanes (576 wide, a fused gate/up of 2 x 1,616) ~0.4 copies of the blocks more, and where the width is not,
# ~2.7 of the embeddings more (libtpu lays such arrays out transposed or padded and copies them between layouts).
# Fitted to libtpu's HBM figure (slm.train.builder.compiled_peak): bench/lora_fit_accel.py collect --full --target
# v5e-1 (2026-11-28, libtpu 0.0.42.1: Qwen2.5-0.5B, TinyLlama and SmolLM2 at 2 and 8 layers, Llama-3.2-1B and
# Mistral-7B at 2, and SmolLM2 --over 448, 640, 704 and 960 wide and d_ff 1,600/1,616, TinyLlama's d_ff 5,600,
# 1 x 512 and 2 x 1,024; 44 compiles, worst 6.7%, all within 10%).
TPU_FULL_UPDATE = (0.63, 0.81, 2.86, 0.40, 2.70)
TPU_LANES = 128  # a TPU vector register's lanes: an array's last dimension is laid out in multiples of it
# The same step split over a TPU's chips (FSDP), beyond each chip's shard of the float32 params, gradients
# (reduce-scattered) and AdamW moments and the activations (LoRA's TPU terms): one block's float32 weights gathered,
# the float32 embedding gathered (tied; untied, with the head), the tokens of all the chips x D x 2 bytes, every
# block's float32 shard again; the fit kept the embedding's and the tokens' terms. XLA:CPU gathers the whole model
# and keeps whole gradients (4N each); libtpu does neither. Fitted: bench/lora_fit_accel.py collect --full --target
# v5e-8 --devices 8 and 4 (2026-11-28, libtpu 0.0.42.1: TinyLlama, Llama-3.2-1B, Qwen2.5-0.5B, Mistral-7B at 2 and 8
# layers, 1 x 512 and 2 x 1,024 a chip; 32 compiles; were +19% .. +288%). Refitted to libtpu's HBM figure
# (slm.train.builder.compiled_peak, the same 32 shapes recompiled): worst 18.3% (Llama-3.2-1B at 8 layers over 4
# chips +16%, TinyLlama at 2 over 8 -18%), 29 within 10%. Refitted to the least-HBM figure (slm.train.builder.tpu_hbm)
# with LoRA's TPU terms' per-layer term (2026-11-28 night, the same 32 shapes recompiled): worst 18.2% (the same
# two), 27 within 10% (the terms before on these: worst 22.3%, 22). A tied embedding is gathered whole in float32 for
# the head's matmul and its gradient at the loss, a phase of its own (Llama-3.2-1B's live ranges over a v5e-8: the
# gather's spike early in the step, the update's plateau late), not beside the update: TPU_FSDP_TIED float32 copies
# (2026-12-05, the v5e-8 sweep's five tied models at full depth, minimax: -6.6% .. +6.5%; it had been 0.82 beside
# the update, +2.6% .. +15.8%).
TPU_FSDP_FULL, TPU_FSDP_TIED = (0.0, 0.0, 0.0, 5.36, 0.0), 1.06
# XLA:GPU under mixed precision keeps a block matrix's gradient as the bf16 matmul made it and converts it to float32
# inside AdamW's fused update and the global norm: 2 bytes a hidden-matrix weight at the peak, not 4 (the memory
# usage report lists them as bf16[...] buffers), and beside the embeddings' float32 gradients one more float32
# vocab x D buffer. Accumulating, each micro-step's gradients go into optax.MultiSteps' float32 sum as they come:
# ~1 byte a hidden weight at the peak, no extra buffer. (bytes a hidden weight, vocab x D float32 buffers), keyed by
# accumulating; one H100, AdamW with float32 moments, a full fine-tune (2026-12-05: TinyLlama, Llama-3.2-1B and
# Qwen3-0.6B at 4-22 layers, Mistral-7B whole on an H200; 1 x 512 tokens; 12 compiles within +0.5%, 5 accumulating
# -1% .. +3%; 4 bytes had planned them -12% .. +16%: bench/plan_for_xla.py gpu-grads).
GPU_MIXED_GRADIENTS = {False: (2.0, 1.0), True: (1.0, 0.0)}
# With an nf4 base XLA:CPU holds 0.82-0.99x the activations the coefficients give (5 shapes at 2 and 4 layers:
# smollm2 0.82, qwen2.5 0.85, llama-3.2-1b 0.98, tinyllama 0.99); the middle of that range.
NF4_ACTIVATIONS = 0.9
NF4_TRANSIENT = 1.0  # one dequantised kernel in flight, per byte of the compute dtype (XLA:CPU, measured)


@dataclass(frozen=True)
class Finetune:
    """What a fine-tuning run trains: rank-`lora_rank` adapters on `lora_targets` of a frozen base held in
    `base_dtype`, or (lora_rank None) every weight, as a from-scratch run does."""

    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    base_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.base_dtype not in DTYPE_BYTES:
            raise ConfigError(f"base_dtype {self.base_dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
        if self.lora_rank is None and self.base_dtype != "float32":
            raise ConfigError(f"base_dtype {self.base_dtype}: only a frozen LoRA base can be held in a low dtype; "
                              f"give lora_rank")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ConfigError(f"lora_rank {self.lora_rank}: must be a positive rank (e.g. 8 or 16)")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))

    def trainable_params(self, shape: ModelShape) -> int:
        if self.lora_rank is None:
            return count_params(shape)
        return sum(math.prod(s) for s in lora_param_shapes(shape, self.lora_rank, self.lora_targets))


def model_shape(model: ModelShape | dict | str | os.PathLike) -> ModelShape:
    """The shape of `model`: a ModelShape, a transformers config.json's dict, or the path of that file or
    of the model folder holding it (only config.json is read: no weights)."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, dict):
        return shape_from_hf_config(model)
    path = os.fspath(model)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"model={os.fspath(model)}: no such config.json; pass a Hugging Face config.json, its "
                          f"folder or its dict")
    with open(path) as f:
        return shape_from_hf_config(json.load(f), path)


def matmul_weights(shape: ModelShape) -> tuple[int, int]:
    """(one block's matmul weights, the head's): what the model casts per matmul (norms and biases aside)."""
    D, F = shape.d_model, shape.d_ff
    q, qkv = shape.n_heads * shape.head_dim, (shape.n_heads + 2 * shape.kv_heads) * shape.head_dim
    return D * qkv + q * D + 3 * D * F, shape.vocab_size * D


def largest_kernel(shape: ModelShape) -> int:
    """Weights of a block's largest matmul kernel (the fused gate/up, or the fused q/k/v)."""
    return max(i * o for i, o in hidden_matrix_shapes(shape)[:4])


def base_param_bytes(shape: ModelShape, base_dtype: str) -> int:
    """The frozen base's bytes: every weight in `base_dtype`, or for nf4 the blocks' matmul kernels at
    NF4_BYTES a weight (the absmax of a last partial block aside), the embedding and head bfloat16 and the
    norms and biases float32."""
    if base_dtype != "nf4":
        return count_params(shape) * DTYPE_BYTES[base_dtype]
    block, _ = matmul_weights(shape)
    matrices = shape.vocab_size * shape.d_model * (1 if shape.tie_embeddings else 2)
    rest = count_params(shape) - shape.n_layers * block - matrices
    return int(shape.n_layers * block * NF4_BYTES) + 2 * matrices + 4 * rest


def fsdp_gathered_bytes(shape: ModelShape, base_dtype: str, casts: int, devices: int) -> int:
    """A LoRA step with its base split over `devices` (FSDP) on XLA:CPU: one block's base gathered at a time,
    plus the casts' own shard (each device casts its slice before the gather). Fitted to XLA at abstract
    shapes, 8 host devices: TinyLlama and Mistral-7B, bf16 and nf4 bases (docs/memory.md). A TPU's differs
    (tpu_fsdp_lora_bytes)."""
    block, _ = matmul_weights(shape)
    per_weight = NF4_BYTES if base_dtype == "nf4" else DTYPE_BYTES[base_dtype]
    return int(block * per_weight) + casts // devices


def weighted(coefficients: tuple[float, ...], columns: list[float]) -> int:
    """A fitted term's bytes: its coefficients times its columns (the tpu_*_columns functions, in their order)."""
    return int(sum(k * x for k, x in zip(coefficients, columns, strict=True)))


def gpu_mixed_gradient_bytes(shape: ModelShape, accumulating: bool) -> int:
    """The gradients XLA:GPU holds at a full-parameter step's peak under mixed precision (GPU_MIXED_GRADIENTS)."""
    block, vocab_x_d = matmul_weights(shape)
    hidden = shape.n_layers * block
    per_hidden, vocab_buffers = GPU_MIXED_GRADIENTS[accumulating]
    return int(4 * (count_params(shape) - hidden) + per_hidden * hidden + 4 * vocab_buffers * vocab_x_d)


def tpu_fsdp_lora_columns(shape: ModelShape, base_dtype: str, casts: int, devices: int, tokens: int,
                          compute_bytes: int) -> list[float]:
    """TPU_FSDP_LORA's terms, bytes, in its order (bench/lora_fit_accel.py fits their coefficients): `casts`, the
    one-chip step's base casts; `tokens`, a chip's."""
    block, nf4 = matmul_weights(shape)[0], base_dtype == "nf4"
    embedding, token_bytes = shape.vocab_size * shape.d_model * 2, tokens * shape.d_model * compute_bytes
    return [shape.n_layers * block * (NF4_BYTES if nf4 else 2) / devices, 2 * block,
            shape.tie_embeddings * embedding, (not shape.tie_embeddings) * embedding,
            nf4 * casts / devices, (base_dtype == "float32") * casts / devices,
            devices * token_bytes, nf4 * shape.n_layers * token_bytes]


def tpu_fsdp_lora_bytes(shape: ModelShape, base_dtype: str, casts: int, devices: int, tokens: int,
                        compute_bytes: int) -> int:
    """What libtpu holds beyond each chip's shard and the activations in a LoRA step whose base is split over
    `devices` chips: TPU_FSDP_LORA's coefficients times tpu_fsdp_lora_columns."""
    return weighted(TPU_FSDP_LORA, tpu_fsdp_lora_columns(shape, base_dtype, casts, devices, tokens, compute_bytes))


def tpu_full_update_columns(shape: ModelShape) -> list[float]:
    """TPU_FULL_UPDATE's terms, bytes, in its order (bench/lora_fit_accel.py fits their coefficients): a block
    kernel whose last dimension is not a whole number of a TPU's 128 lanes (SmolLM2's 576 wide, a fused gate/up of
    2 x 1,616) adds the blocks' again, a width that is not adds the embeddings'."""
    embedding, blocks = shape.vocab_size * shape.d_model * 4, shape.n_layers * 4 * matmul_weights(shape)[0]
    odd_blocks = any(o % TPU_LANES for _, o in hidden_matrix_shapes(shape)[:4])
    return [blocks, shape.tie_embeddings * embedding, (not shape.tie_embeddings) * embedding,
            odd_blocks * blocks, (shape.d_model % TPU_LANES != 0) * (2 - shape.tie_embeddings) * embedding]


def tpu_full_update_bytes(shape: ModelShape) -> int:
    """libtpu's AdamW update of a full fine-tune on one chip (or each of a data-parallel run's): TPU_FULL_UPDATE's
    coefficients times tpu_full_update_columns."""
    return weighted(TPU_FULL_UPDATE, tpu_full_update_columns(shape))


def tpu_fsdp_full_columns(shape: ModelShape, devices: int, tokens: int) -> list[float]:
    """TPU_FSDP_FULL's terms, bytes, in its order (bench/lora_fit_accel.py fits their coefficients); `tokens`, a
    chip's."""
    block, embedding = matmul_weights(shape)[0], shape.vocab_size * shape.d_model * 4
    return [4 * block, shape.tie_embeddings * embedding, (not shape.tie_embeddings) * embedding,
            devices * tokens * shape.d_model * 2, shape.n_layers * 4 * block / devices]


def tpu_fsdp_full_bytes(shape: ModelShape, devices: int, tokens: int) -> tuple[int, int]:
    """What libtpu holds beyond each chip's shard of the state and the activations in a full fine-tune split over
    `devices` chips: (beside every phase, TPU_FSDP_FULL's coefficients times tpu_fsdp_full_columns; at the loss, a
    tied embedding gathered, TPU_FSDP_TIED copies)."""
    columns = tpu_fsdp_full_columns(shape, devices, tokens)
    return weighted(TPU_FSDP_FULL, columns), int(TPU_FSDP_TIED * columns[1])


def base_cast_bytes(shape: ModelShape, base_dtype: str, mixed_precision: bool, remat: bool, platform: str,
                    chunked_loss: bool = False, data_parallel: bool = False) -> int:
    """Bytes of compute-dtype copies of base weights the step holds at its peak (module docstring). A chunked
    loss (--loss-chunk) casts the head a chunk at a time, inside its loop (slm.model.loss.rows_in_loop): no
    copy of the whole head. `data_parallel`: each of several chips holding the whole base (TPU_DP_NF4_KERNELS)."""
    block, head = matmul_weights(shape)
    compute = "bfloat16" if mixed_precision else "float32"
    if (remat, mixed_precision) in LORA_ACCEL_CASTS.get(platform, {}):  # the target compiler's own fit
        k16, b16, k32, b32, nf4_kernels, tied = LORA_ACCEL_CASTS[platform][(remat, mixed_precision)]
        if platform == "tpu" and data_parallel:
            nf4_kernels = TPU_DP_NF4_KERNELS.get((remat, mixed_precision), nf4_kernels)
        cast = base_dtype not in ("nf4", compute)
        kernels, blocks = (k32, b32) if base_dtype == "float32" else (k16, b16)
        held = "bfloat16" if base_dtype == "nf4" else base_dtype  # nf4 keeps its embedding and head in bf16
        # a head wider than the loss's chunk is cast a chunk at a time; an unchunked one whole (not measured: every
        # fitted vocabulary is chunked on a GPU)
        whole_head = head if held != compute and not chunked_loss else 0
        copies = (cast * (kernels * largest_kernel(shape) + blocks * (1 if remat else shape.n_layers) * block)
                  + (base_dtype == "float32") * tied * shape.tie_embeddings * shape.vocab_size * shape.d_model
                  + (base_dtype == "nf4") * nf4_kernels * largest_kernel(shape))
        return int(DTYPE_BYTES[compute] * (copies + whole_head))
    if base_dtype == "nf4":  # the head as a bfloat16 base's, and one block kernel dequantised at a time
        return base_cast_bytes(replace(shape, n_layers=0), "bfloat16", mixed_precision,
                               remat, platform, chunked_loss) + int(NF4_TRANSIENT * (2 if mixed_precision else 4)
                                                                     * largest_kernel(shape))
    if platform == "cpu":
        if not (base_dtype != "float32" or mixed_precision):
            return 0
        if chunked_loss:
            return int(CAST_CPU * 4 * shape.n_layers * block)
        head_rounding = 2 * head if mixed_precision and base_dtype != "bfloat16" else 0
        return int(CAST_CPU * 4 * (shape.n_layers * block + head)) + head_rounding
    head = 0 if chunked_loss else head
    if base_dtype == compute:
        return 0
    return DTYPE_BYTES[compute] * ((1 if remat else shape.n_layers) * block + head)


def backward_bytes(shape: ModelShape, tokens: int, seq_len: int, coefficients: tuple[float, ...],
                   layer_coefficients: tuple[float, ...] | None = None, compute_bytes: int = 4,
                   loss_chunk: int | None = None, platform: str = "cpu") -> tuple[int, int]:
    """(activations, logits) for `tokens` tokens: L layers at `coefficients` (a, b, c, e, t), or with
    `layer_coefficients` an accelerator's remat: each block's input kept, one block recomputed at a time.
    The logits are those of `loss_chunk` vocabulary entries at a time (slm.model.sizing.logit_columns)."""
    L, D, F, H = shape.n_layers, shape.d_model, shape.d_ff, shape.n_heads
    V = logit_columns(shape.vocab_size, loss_chunk, platform)
    a, b, c, e, t = coefficients[:5]
    fixed = coefficients[5] if len(coefficients) > 5 else 0.0  # an accelerator's constant (ACCEL_COEFFICIENTS)
    # One attention block's scores at a time: the backward pass's float32 temporaries of the block it is in.
    fixed += t * tokens * H * attention_block(seq_len)
    # Chunked, XLA:CPU keeps ~64 bytes per token per unit of D beyond the chunk's logits (the loop's float32
    # dx carry and its operands): fitted to 5 shapes, 1M-30M params, vocab 2,048-32,000 (docs/memory.md).
    # XLA:GPU's loop keeps nothing the fitted terms do not (LORA_ACCEL_COEFFICIENTS' fit with it: worst 17%, 9% without).
    loop = CHUNKED_BYTES_PER_D * D if V < shape.vocab_size and platform == "cpu" else 0
    logits = tokens * (V * e + loop)
    qk = QK_NORM_BYTES * (H + shape.kv_heads) * shape.head_dim if shape.qk_norm else 0  # Qwen3's q/k norms
    # Blocked causal attention's scores per query (slm.model.attention); a GPU's figures were fitted and checked
    # on a real card with the whole square (its bf16 step runs cuDNN's, which keeps none): kept as they were.
    keys = seq_len if platform == "gpu" else visible_keys(seq_len)
    g_token, g_layer = GEMMA_BLOCK_BYTES[compute_bytes] if shape.sandwich_norms and platform == "cpu" else (0, 0)
    fixed += g_layer * L * D * D
    per_layer = a * D + b * F + c * H * keys + qk + g_token * D
    # libtpu's: each layer past the first holds bytes per unit of D whatever the tokens (LORA_ACCEL_COEFFICIENTS)
    deep = coefficients if layer_coefficients is None else layer_coefficients
    fixed += (deep[6] if len(deep) > 6 else 0.0) * (L - 1) * D
    if layer_coefficients is not None:
        a1, b1, c1 = layer_coefficients[:3]
        per_token = (L - 1) * D * compute_bytes + a1 * D + b1 * F + c1 * H * keys + qk
        return int(tokens * per_token + fixed), int(logits)
    return int(tokens * L * per_layer + fixed), int(logits)


def lora_breakdown(shape: ModelShape, ft: Finetune, seq_len: int, micro_batch: int, *, mixed_precision: bool,
                   gradient_checkpointing: bool, use_8bit_optimizer: bool, accumulation: int,
                   platform: str, loss_chunk: int | None = None, data_parallel: bool = False) -> dict[str, int]:
    """The LoRA step's parts per device, bytes (module docstring), all but the update phase; `data_parallel`:
    one of several devices each holding the whole base."""
    shapes = lora_param_shapes(shape, ft.lora_rank, ft.lora_targets)
    n = sum(math.prod(s) for s in shapes)
    acc = 4 * n + 8 if accumulation > 1 else 0
    remat = bool(gradient_checkpointing)
    ideal = remat and platform != "cpu"
    coefficients = LORA_COEFFICIENTS[(remat and not ideal, bool(mixed_precision))]
    layer = LORA_COEFFICIENTS[(False, bool(mixed_precision))] if ideal else None
    fitted = (remat, bool(mixed_precision)) in LORA_ACCEL_COEFFICIENTS.get(platform, {})
    if fitted:  # the target compiler's own fit (remat: one block recomputed)
        coefficients = LORA_ACCEL_COEFFICIENTS[platform][(remat, bool(mixed_precision))]
        layer = coefficients if remat else None
    activations, logits = backward_bytes(shape, micro_batch * seq_len, seq_len, coefficients, layer,
                                         2 if mixed_precision else 4, loss_chunk, platform)
    if ft.base_dtype == "nf4" and not fitted:  # XLA:CPU's nf4 step (NF4_ACTIVATIONS)
        activations = int(NF4_ACTIVATIONS * activations)
    return {
        "base_params": base_param_bytes(shape, ft.base_dtype),
        "params": 4 * n,
        "gradients": 4 * n,
        "optimizer_state": adam_state_bytes(shapes, use_8bit_optimizer, accumulation) - acc,
        "accumulation": acc,
        "base_casts": base_cast_bytes(shape, ft.base_dtype, mixed_precision, remat, platform,
                                      logit_columns(shape.vocab_size, loss_chunk, platform) < shape.vocab_size,
                                      data_parallel),
        "activations": activations,
        "logits": logits,
    }
