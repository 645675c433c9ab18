"""Decoder-only transformer in Flax Linen: pre-norm RMSNorm, rotary positions, SwiGLU, tied embedding; with
grouped-query attention, q/k/v biases and an untied head when the shape asks (Llama, Mistral, Qwen2).

Shapes are in the names: B batch, L sequence, D model width, H heads, K head dim, F MLP width, V vocab.
Parameters are float32 ("master weights"); `dtype` is the compute dtype (bfloat16 under
--use-mixed-precision). Norms, softmax, logits and the loss are always float32.

Why Linen rather than NNX: the trainer wants parameters as a plain pytree (explicit state that optax,
orbax and jax.sharding take as-is) and a pure `apply` inside one jitted step, so there is no per-step
Python graph traversal at all. NNX would be split/merged around the same jitted function to the same
effect; Linen says it with less machinery.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from slm.model.attention import causal_attend
from slm.model.lora import LoraSpec, adapted
from slm.model.loss import chunked_token_nll
from slm.model.matmul import bf16_dot_general, bf16_linear_rows
from slm.model.nf4 import BLOCK, blocks_of, layout_for, nf4_linear
from slm.model.rope import rotary, rotary_positions
from slm.model.sizing import ModelShape

Dtype = Any


class RMSNorm(nn.Module):
    eps: float = 1e-6
    plus_one: bool = False  # Gemma: scale by (1 + w), w initialised to zero

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale_D = self.param("scale", init, (x_BxLxD.shape[-1],), jnp.float32)
        x = x_BxLxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * (1.0 + scale_D if self.plus_one else scale_D)).astype(x_BxLxD.dtype)


def norm(shape: ModelShape, name: str) -> RMSNorm:
    return RMSNorm(shape.norm_eps, shape.norm_plus_one, name=name)


def embed_tokens(shape: ModelShape, embed_VxD: jax.Array, ids_BxL: jax.Array, dtype: Dtype) -> jax.Array:
    """The ids' embeddings in `dtype`; Gemma's scaled by sqrt(d_model) (a float32 constant, as transformers')."""
    x = jnp.take(embed_VxD, ids_BxL, axis=0)
    if shape.embed_scale:
        x = x * jnp.asarray(shape.d_model ** 0.5, x.dtype)
    return x.astype(dtype)


def windowed(mask: jax.Array, q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """`mask` also hiding keys `window` or more positions behind their query (a sliding-window layer)."""
    return mask & (q_pos[..., :, None] - k_pos[..., None, :] < window) if window else mask


def gated_act(shape: ModelShape, gate: jax.Array) -> jax.Array:
    return jax.nn.gelu(gate, approximate=True) if shape.mlp_act == "gelu_tanh" else nn.silu(gate)


def gated_product(shape: ModelShape, gate_up_BxLx2F: jax.Array, bf16_residual: bool = False) -> jax.Array:
    """act(gate) * up of the fused gate/up product (B, L, 2F). With `bf16_residual` (the products take bf16
    operands anyway: --matmul-precision bfloat16) and a float32 product, the backward keeps the product rounded
    to bf16 and recomputes the activation from it; XLA would otherwise keep the float32 product, sigmoid(gate)
    and silu(gate) a layer, most of what a LoRA step holds for its backward. The forward is unchanged."""
    if bf16_residual and gate_up_BxLx2F.dtype == jnp.float32:
        return _gated_bf16_residual(shape, gate_up_BxLx2F)
    return _act_times_up(shape, gate_up_BxLx2F)


def _act_times_up(shape: ModelShape, gate_up: jax.Array) -> jax.Array:
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return gated_act(shape, gate) * up


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gated_bf16_residual(shape: ModelShape, gate_up: jax.Array) -> jax.Array:
    return _act_times_up(shape, gate_up)


def _gated_fwd(shape: ModelShape, gate_up: jax.Array) -> tuple[jax.Array, jax.Array]:
    # A float32 residual would not do: XLA merges the backward's recomputed activation with the forward's (CSE)
    return _act_times_up(shape, gate_up), gate_up.astype(jnp.bfloat16)


def _gated_bwd(shape: ModelShape, gate_up_bf16: jax.Array, dh: jax.Array) -> tuple[jax.Array]:
    return jax.vjp(functools.partial(_act_times_up, shape), gate_up_bf16.astype(dh.dtype))[1](dh)


_gated_bf16_residual.defvjp(_gated_fwd, _gated_bwd)


def document_layout(ids_BxL: jax.Array, start_id: int) -> tuple[jax.Array, jax.Array]:
    """(positions (B, L), mask (B, L, L)) for packed documents that each begin at a `start_id` token (the
    separator a document follows, or its bos): positions restart at 0 there and a token attends only to
    earlier tokens of its own document. Tokens before a row's first separator form one more document."""
    B, L = ids_BxL.shape
    index_L = jnp.arange(L)
    starts_BxL = ids_BxL == start_id
    doc_BxL = jnp.cumsum(starts_BxL, axis=1)
    first_BxL = jax.lax.cummax(jnp.where(starts_BxL, index_L, 0), axis=1)
    same_BxLxL = doc_BxL[:, :, None] == doc_BxL[:, None, :]
    return index_L - first_BxL, same_BxLxL & jnp.tril(jnp.ones((L, L), dtype=bool))


def dense(features: int, name: str, dtype: Dtype, std: float, bias: bool = False,
          matmul: str = "float32", nf4: bool | str = False) -> nn.Module:
    """A Linen Dense with float32 parameters; `matmul` "bfloat16": its products in bf16 (slm.model.matmul);
    `nf4`: the frozen base's kernel held as NF4 codes (NF4Dense)."""
    if nf4:
        return NF4Dense(features, dtype, bias, matmul == "bfloat16", "pairs" if nf4 is True else nf4, name=name)
    return nn.Dense(
        features, use_bias=bias, dtype=dtype, param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(std), name=name,
        dot_general=bf16_dot_general if matmul == "bfloat16" else None,
    )


class NF4Dense(nn.Module):
    """Dense for a QLoRA base: the kernel (in, out) is held as "nf4_codes" and "nf4_absmax" (slm.model.nf4,
    zeros at init: the weights come from --init-from) and dequantised per matmul; the bias, if any, float32."""

    features: int
    dtype: Dtype
    use_bias: bool = False
    bf16: bool = False  # bf16 products with float32 sums (--matmul-precision bfloat16)
    layout: str = "pairs"  # how the codes are dequantised (slm.model.nf4.layout_for): the backend's

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        blocks = blocks_of(x.shape[-1], self.features)
        codes = self.param("nf4_codes", nn.initializers.zeros, (blocks * BLOCK // 2,), jnp.uint8)
        absmax = self.param("nf4_absmax", nn.initializers.zeros, (blocks,), jnp.float32)
        y = nf4_linear(x, codes, absmax, self.features, jnp.dtype(self.dtype), self.bf16, self.layout)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32).astype(y.dtype)
        return y


def project_qkv(shape: ModelShape, dtype: Dtype, x_BxLxD: jax.Array, module: nn.Module | None = None,
                lora: LoraSpec | None = None, matmul: str = "float32",
                nf4: bool | str = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One fused projection (named "qkv", inside the calling `module`) -> q (B, L, H, K), k and v (B, L, G, K);
    G = H without grouped-query attention, when the kernel is (D, 3D) as it always was. With `lora`, the
    module's q/k/v adapters add to their columns."""
    B, L, _ = x_BxLxD.shape
    H, G, K = shape.n_heads, shape.kv_heads, shape.head_dim
    qkv = dense((H + 2 * G) * K, "qkv", dtype, 0.02, bias=shape.qkv_bias, matmul=matmul, nf4=nf4)(x_BxLxD)
    qkv = adapted(module, lora, qkv, x_BxLxD, "qkv").reshape(B, L, H + 2 * G, K)
    return qkv[:, :, :H], qkv[:, :, H:H + G], qkv[:, :, H + G:]


def normed_qk(shape: ModelShape, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Qwen3's per-head RMSNorm of q and k (params "q_norm", "k_norm" of width K, inside the calling module),
    before the rotation; q and k unchanged for the other families."""
    if not shape.qk_norm:
        return q, k
    return norm(shape, "q_norm")(q), norm(shape, "k_norm")(k)


def attend(q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, mask_LxS: jax.Array,
           dtype: Dtype, scale: float | None = None) -> jax.Array:
    """Scaled dot-product attention under any boolean mask -> (B, L, H, K), logits times `scale` (default
    K^-0.5): the KV-cache decoder's one-token steps, whose queries sit at a traced position of the cache
    (training, eval, the prefill and --plan-for's programs run slm.model.attention.causal_attend). With G < H
    key/value heads each serves H/G consecutive query heads (transformers' repeat_kv order), without
    materialising copies."""
    B, L, H, K = q_BxLxHxK.shape
    scale = K ** -0.5 if scale is None else scale
    G = k_BxSxGxK.shape[2]
    if mask_LxS.ndim == 3:  # per row (B, L, S): document masking
        mask_LxS = mask_LxS[:, None] if G == H else mask_LxS[:, None, None]
    if G == H:
        logits_BxHxLxS = jnp.einsum("bqhk,bshk->bhqs", q_BxLxHxK, k_BxSxGxK, preferred_element_type=jnp.float32)
        logits_BxHxLxS = jnp.where(mask_LxS, logits_BxHxLxS * scale, jnp.finfo(jnp.float32).min)
        probs_BxHxLxS = jax.nn.softmax(logits_BxHxLxS, axis=-1).astype(dtype)
        return jnp.einsum("bhqs,bshk->bqhk", probs_BxHxLxS, v_BxSxGxK)
    q_BxLxGxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K)
    logits = jnp.einsum("bqgrk,bsgk->bgrqs", q_BxLxGxRxK, k_BxSxGxK, preferred_element_type=jnp.float32)
    logits = jnp.where(mask_LxS, logits * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
    return jnp.einsum("bgrqs,bsgk->bqgrk", probs, v_BxSxGxK).reshape(B, L, H, K)


def fused_attention_fits(dtype: Dtype, platform: str | None = None, head_dim: int = 64) -> bool:
    """cuDNN's fused (flash) attention for one causal sequence: on GPUs, in bf16 or fp16 (the kernel's dtypes),
    for heads of at most 128 in multiples of 8 (jax refuses others: Gemma 3's 256 takes the einsum attention;
    found by --plan-for, which compiles the GPU's program).
    It never materialises the (L, L) scores: at 85M params, seq 1024 on an H100 the einsum attention held
    ~20 GB of activations and ran at 0.36x nanoGPT's tokens/s (docs/performance.md). Elsewhere the model runs
    slm.model.attention's blocked causal attention (CPUs, TPUs, float32 on GPUs)."""
    platform = platform or jax.default_backend()  # --plan-for compiles a GPU's program on a CPU
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and platform == "gpu"
            and head_dim <= 128 and head_dim % 8 == 0)


class Attention(nn.Module):
    shape: ModelShape
    dtype: Dtype
    lora: LoraSpec | None = None
    matmul: str = "float32"  # the projections' product precision (slm.model.matmul)
    nf4: bool | str = False  # the frozen base's kernels as NF4 codes: False, or their layout (NF4Dense)
    layer: int = 0  # its index: Gemma 3's sliding-window layers differ from its global ones
    platform: str | None = None  # the backend compiled for (None: jax's default; --plan-for: the target's)

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, layout: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        B, L, D = x_BxLxD.shape
        H, K = self.shape.n_heads, self.shape.head_dim
        rope, window = self.shape.rope(self.layer), self.shape.window(self.layer)
        q, k, v = project_qkv(self.shape, self.dtype, x_BxLxD, self, self.lora, self.matmul, self.nf4)
        q, k = normed_qk(self.shape, q, k)
        if layout is None:  # one causal sequence
            q, k, doc_mask = rotary(q, *rope), rotary(k, *rope), None
        else:  # packed documents kept apart (document_layout)
            pos_BxL, doc_mask = layout
            q, k = rotary_positions(q, pos_BxL, *rope), rotary_positions(k, pos_BxL, *rope)
        if layout is None and not window and fused_attention_fits(self.dtype, self.platform, K):
            out_BxLxHxK = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=self.shape.query_scale,
                                                       implementation="cudnn")
        else:
            out_BxLxHxK = causal_attend(q, k, v, self.dtype, self.shape.query_scale, window=window,
                                        mask_BxLxS=doc_mask, bf16=self.matmul == "bfloat16")
        out_BxLxHK = out_BxLxHxK.reshape(B, L, H * K)
        o = dense(D, "o", self.dtype, 0.02 / (2 * self.shape.n_layers) ** 0.5, bias=self.shape.o_bias,
                  matmul=self.matmul, nf4=self.nf4)
        return adapted(self, self.lora, o(out_BxLxHK), out_BxLxHK, "o")


class SwiGLU(nn.Module):
    shape: ModelShape
    dtype: Dtype
    lora: LoraSpec | None = None
    matmul: str = "float32"
    nf4: bool | str = False  # False, or the NF4 layout (slm.model.nf4.layout_for)

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        F = self.shape.d_ff
        out_std = 0.02 / (2 * self.shape.n_layers) ** 0.5
        gate_up = dense(2 * F, "gate_up", self.dtype, 0.02, matmul=self.matmul, nf4=self.nf4)
        gate_up_BxLx2F = adapted(self, self.lora, gate_up(x_BxLxD), x_BxLxD, "gate_up")
        h_BxLxF = gated_product(self.shape, gate_up_BxLx2F, self.matmul == "bfloat16")
        down = dense(self.shape.d_model, "down", self.dtype, out_std, matmul=self.matmul, nf4=self.nf4)
        return adapted(self, self.lora, down(h_BxLxF), h_BxLxF, "down")


def dropout(module: nn.Module, rate: float, x: jax.Array) -> jax.Array:
    """Dropout in training only: when the caller gives a "dropout" rng stream (token_nll's dropout_rng)."""
    if rate > 0 and module.has_rng("dropout"):
        return drop(x, module.make_rng("dropout"), rate)
    return x


def drop(x: jax.Array, key: jax.Array, rate: float) -> jax.Array:
    """`x` with each element zeroed with probability `rate` (to 2^-32) and the rest scaled to keep the mean.

    The mask is a counter-based hash of each element's index (keep_mask), not jax.random's threefry: on CPU
    threefry made a step 1.08-1.11x slower at 0.1 and XLA kept its two 32-bit words an element for the backward
    pass (~7.7 bytes an element), while the hash costs a few integer operations that XLA fuses and recomputes."""
    cut = min(round(rate * 2**32), 2**32 - 1)
    keep = keep_mask(key, x.shape, cut)
    scaled = (x.astype(jnp.float32) * (2**32 / (2**32 - cut))).astype(x.dtype)  # a bf16 scale would bias the mean
    return jnp.where(keep, scaled, jnp.zeros((), x.dtype))


def keep_mask(key: jax.Array, shape: tuple[int, ...], cut: int) -> jax.Array:
    """Bernoulli(1 - cut / 2^32) booleans: murmur3's 32-bit finalizer applied twice to each element's index,
    with two seeds drawn from `key` (the second keeps two masks from being shifted copies of each other)."""
    s1, s2 = jax.random.bits(key, (2,), jnp.uint32)
    return hashed_bits(s1, s2, math.prod(shape)).reshape(shape) >= jnp.uint32(cut)


def hashed_bits(s1: jax.Array, s2: jax.Array, n: int) -> jax.Array:
    """n uint32 words: fmix32(fmix32(i * golden + s1) ^ s2) for i < n. With s1 alone, two seeds k * golden apart
    would give copies of one sequence shifted by k; the second seed, mixed in after the first round, breaks that."""
    if n >= 2**32:
        raise ValueError(f"dropout over {n:,} elements: the uint32 index would wrap (at most 2^32 - 1 per array)")
    index = lax.iota(jnp.uint32, n) * jnp.uint32(0x9E3779B1)  # a Weyl sequence: spreads the counter's bits
    return _fmix32(_fmix32(index + s1) ^ s2)


def _fmix32(h: jax.Array) -> jax.Array:
    """murmur3's finalizer: a bijection of uint32 whose every output bit depends on every input bit."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


class Block(nn.Module):
    shape: ModelShape
    dtype: Dtype
    lora: LoraSpec | None = None
    matmul: str = "float32"
    dropout: float = 0.0  # on each residual branch's output (GPT-2's resid_pdrop)
    nf4: bool | str = False  # False, or the NF4 layout (Transformer resolves it)
    layer: int = 0
    platform: str | None = None  # Attention's

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, layout: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        attn = Attention(self.shape, self.dtype, self.lora, self.matmul, self.nf4, self.layer, self.platform,
                         name="attn")
        mlp = SwiGLU(self.shape, self.dtype, self.lora, self.matmul, self.nf4, name="mlp")
        attn_BxLxD = attn(norm(self.shape, "attn_norm")(x_BxLxD), layout)
        x_BxLxD = x_BxLxD + dropout(self, self.dropout, sandwiched(self.shape, "post_attn_norm", attn_BxLxD))
        mlp_BxLxD = mlp(norm(self.shape, "mlp_norm")(x_BxLxD))
        return x_BxLxD + dropout(self, self.dropout, sandwiched(self.shape, "post_mlp_norm", mlp_BxLxD))


def sandwiched(shape: ModelShape, name: str, y: jax.Array) -> jax.Array:
    """A branch's output, normed before its residual add when the shape has sandwich norms (Gemma)."""
    return norm(shape, name)(y) if shape.sandwich_norms else y


class Transformer(nn.Module):
    """Token ids (B, L) -> float32 logits (B, L, V)."""

    shape: ModelShape
    dtype: Dtype = jnp.float32
    remat: bool = False  # gradient checkpointing: recompute each block's activations in backward
    doc_start: int | None = None  # document masking: the token each packed document begins at (None: off)
    lora: LoraSpec | None = None  # adapters on a frozen base (slm.model.lora)
    matmul: str = "float32"  # "bfloat16": the projections and head in bf16 products, f32 sums (slm.model.matmul)
    loss_chunk: int = 0  # token_nll's vocabulary chunk (slm.model.loss); 0 or >= V: the full logits
    dropout: float = 0.0  # on the embeddings and each residual branch, in training only (token_nll's dropout_rng)
    nf4: bool = False  # QLoRA: the blocks' matmul kernels held as NF4 codes (slm.model.nf4, NF4Dense)
    platform: str | None = None  # the backend it is compiled for (None: jax's default; --plan-for: the target's)

    @nn.compact
    def __call__(self, ids_BxL: jax.Array, features: bool = False) -> Any:
        """Logits (B, L, V), or with `features` the final normed hidden state (B, L, D) and the head (V, D)."""
        embed_VxD = self.param(
            "embed", nn.initializers.normal(0.02), (self.shape.vocab_size, self.shape.d_model), jnp.float32
        )
        x_BxLxD = dropout(self, self.dropout, embed_tokens(self.shape, embed_VxD, ids_BxL, self.dtype))
        layout = None if self.doc_start is None else document_layout(ids_BxL, self.doc_start)
        block_cls = nn.remat(Block, prevent_cse=True) if self.remat else Block
        nf4 = self.nf4 and layout_for(self.platform or jax.default_backend())  # the blocks' NF4Dense layout
        for i in range(self.shape.n_layers):
            x_BxLxD = block_cls(self.shape, self.dtype, self.lora, self.matmul, self.dropout, nf4, i,
                                self.platform, name=f"block_{i}")(
                x_BxLxD, layout)
        x_BxLxD = norm(self.shape, "final_norm")(x_BxLxD)
        head_VxD = head_weights(self, embed_VxD)
        if features:
            return x_BxLxD, head_VxD
        if self.matmul == "bfloat16":
            return bf16_linear_rows(x_BxLxD, head_VxD, jnp.float32)
        return jnp.einsum("bld,vd->blv", x_BxLxD, head_VxD.astype(self.dtype), preferred_element_type=jnp.float32)


def head_weights(module: nn.Module, embed_VxD: jax.Array) -> jax.Array:
    """The output projection (V, D): the embedding itself when tied, else its own "unembed" parameter."""
    shape = module.shape
    if shape.tie_embeddings:
        return embed_VxD
    return module.param("unembed", nn.initializers.normal(0.02), (shape.vocab_size, shape.d_model), jnp.float32)


def init_params(model: Transformer, seed: int, seq_len: int) -> Any:
    ids = jnp.zeros((1, seq_len), dtype=jnp.int32)
    return jax.jit(model.init)(jax.random.PRNGKey(seed), ids)["params"]


def token_nll(model: Transformer, params: Any, ids_BxL: jax.Array, targets_BxL: jax.Array,
              dropout_rng: jax.Array | None = None) -> jax.Array:
    """Per-token negative log-likelihood in nats, float32, shape (B, L); 0 where the target is negative
    (instruction data: not a response token). `dropout_rng` turns dropout on (training: --dropout, LoRA's); with
    `model.loss_chunk` below the vocabulary the loss runs over vocabulary chunks (slm.model.loss)."""
    rngs = None if dropout_rng is None else {"dropout": dropout_rng}
    if 0 < model.loss_chunk < model.shape.vocab_size:
        x_BxLxD, head_VxD = model.apply({"params": params}, ids_BxL, features=True, rngs=rngs)
        bf16 = model.matmul == "bfloat16" or jnp.dtype(model.dtype) == jnp.bfloat16
        return chunked_token_nll(x_BxLxD, head_VxD, targets_BxL, model.loss_chunk, jnp.bfloat16 if bf16 else jnp.float32)
    logits_BxLxV = model.apply({"params": params}, ids_BxL, rngs=rngs)
    logz_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    keep_BxL = targets_BxL >= 0
    target_logit_BxL = jnp.take_along_axis(logits_BxLxV, jnp.maximum(targets_BxL, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(keep_BxL, logz_BxL - target_logit_BxL, 0.0)


def mean_nll(nll_BxL: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """The mean over scored tokens (targets >= 0): plain data scores all of them."""
    return jnp.sum(nll_BxL) / jnp.maximum(jnp.sum(targets_BxL >= 0), 1)
