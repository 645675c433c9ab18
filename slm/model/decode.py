"""KV-cache decoding: the Transformer's arithmetic for T new tokens that attend to cached keys and values.

The same parameter tree and arithmetic as slm.model.transformer.Transformer, for T new tokens at absolute
positions start..start+T-1 that attend to K/V cached from earlier calls. Separate classes so the
training forward stays exactly as it is; `decode` applies them to a Transformer's params.

Like the training model it applies LoRA adapters beside their kernels and dequantises an NF4 base one
kernel at a time inside the program, with the model's matmul precision: a LoRA or QLoRA run samples from
its base as held (never a folded or dequantised float32 copy of the whole base, ~29 GB for Mistral-7B).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from slm.model.attention import causal_attend
from slm.model.lora import LoraSpec, adapted
from slm.model.loss import head_logits
from slm.model.matmul import bf16_linear_rows
from slm.model.nf4 import layout_for
from slm.model.rope import rotary_at
from slm.model.sizing import ModelShape
from slm.model.transformer import (
    Dtype,
    SwiGLU,
    Transformer,
    attend,
    dense,
    embed_tokens,
    head_weights,
    norm,
    normed_qk,
    project_qkv,
    sandwiched,
    windowed,
)

# CPU: the head's rows cast to the products' dtype a chunk at a time (slm.model.loss.head_logits); a bf16 head
# cast whole each token took 0.61 of Gemma-3-1B's 1.3 s a token on the 2-core EPYC, 0.11 s by chunks
HEAD_CHUNK = 8192
KVCache = list  # one {"k": BxSxGxK, "v": BxSxGxK} per layer: S cache positions, G key/value heads


def init_cache(shape: ModelShape, batch: int, length: int, dtype: Dtype = jnp.float32) -> KVCache:
    """A zeroed cache of `length` positions (one buffer per tensor, so the whole cache can be donated)."""
    def zeros() -> jax.Array:
        return jnp.zeros((batch, length, shape.kv_heads, shape.head_dim), dtype)

    return [{"k": zeros(), "v": zeros()} for _ in range(shape.n_layers)]


class CachedAttention(nn.Module):
    """Attention's math for T new tokens: write their rotated K and V into the cache at `start`, then attend
    over all S cache slots with the causal mask (key position <= query position). The mask also hides
    slots not written yet, or written by a right-padded prefill, until a later call overwrites them."""

    shape: ModelShape
    dtype: Dtype
    layer: int = 0
    lora: LoraSpec | None = None
    matmul: str = "float32"
    nf4: bool | str = False  # False, or the NF4 layout (slm.model.nf4.layout_for)

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array, cache: dict, start: jax.Array, fresh: bool = False
                 ) -> tuple[jax.Array, dict]:
        B, T, D = x_BxTxD.shape
        H, K = self.shape.n_heads, self.shape.head_dim
        rope = self.shape.rope(self.layer)
        S = cache["k"].shape[1]
        assert T <= S, f"{T} new tokens do not fit a cache of {S} positions"
        out_std = 0.02 / (2 * self.shape.n_layers) ** 0.5
        q, k, v = project_qkv(self.shape, self.dtype, x_BxTxD, self, self.lora, self.matmul, self.nf4)
        q, k = normed_qk(self.shape, q, k)
        q, k = rotary_at(q, start, S, *rope), rotary_at(k, start, S, *rope)
        k, v = k.astype(cache["k"].dtype), v.astype(cache["v"].dtype)  # as the cache holds them
        k_BxSxGxK = jax.lax.dynamic_update_slice_in_dim(cache["k"], k, start, axis=1)
        v_BxSxGxK = jax.lax.dynamic_update_slice_in_dim(cache["v"], v, start, axis=1)
        if fresh:  # a prefill into an empty cache: its T queries see only each other, so the blocked attention
            out_BxTxHxK = causal_attend(q, k, v, self.dtype, self.shape.query_scale,
                                        window=self.shape.window(self.layer), bf16=self.matmul == "bfloat16")
        else:
            q_pos, k_pos = start + jnp.arange(T), jnp.arange(S)
            causal_TxS = windowed(q_pos[:, None] >= k_pos[None, :], q_pos, k_pos, self.shape.window(self.layer))
            out_BxTxHxK = attend(q, k_BxSxGxK, v_BxSxGxK, causal_TxS, self.dtype, self.shape.query_scale)
        out_BxTxHK = out_BxTxHxK.reshape(B, T, H * K)
        out_BxTxD = dense(D, "o", self.dtype, out_std, bias=self.shape.o_bias, matmul=self.matmul,
                          nf4=self.nf4)(out_BxTxHK)
        return adapted(self, self.lora, out_BxTxD, out_BxTxHK, "o"), {"k": k_BxSxGxK, "v": v_BxSxGxK}


class CachedBlock(nn.Module):
    shape: ModelShape
    dtype: Dtype
    layer: int = 0
    lora: LoraSpec | None = None
    matmul: str = "float32"
    nf4: bool | str = False  # False, or the NF4 layout

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array, cache: dict, start: jax.Array, fresh: bool = False
                 ) -> tuple[jax.Array, dict]:
        attn_BxTxD, cache = CachedAttention(self.shape, self.dtype, self.layer, self.lora, self.matmul, self.nf4,
                                            name="attn")(norm(self.shape, "attn_norm")(x_BxTxD), cache, start, fresh)
        x_BxTxD = x_BxTxD + sandwiched(self.shape, "post_attn_norm", attn_BxTxD)
        mlp = SwiGLU(self.shape, self.dtype, self.lora, self.matmul, self.nf4, name="mlp")
        mlp_BxTxD = mlp(norm(self.shape, "mlp_norm")(x_BxTxD))
        return x_BxTxD + sandwiched(self.shape, "post_mlp_norm", mlp_BxTxD), cache


class CachedTransformer(nn.Module):
    """(ids (B, T) at positions start.., cache, start) -> (float32 logits, updated cache); Transformer's params.

    Logits are (B, T, V), or (B, 1, V) for position start+`last` only when `last` is given (a prefill
    needs just the last prompt token's, and the (T, V) projection is the largest matmul there).
    """

    shape: ModelShape
    dtype: Dtype = jnp.float32
    lora: LoraSpec | None = None  # adapters applied beside their kernels (training's arithmetic)
    matmul: str = "float32"  # the projections' and head's product precision, as in training
    nf4: bool = False  # the blocks' kernels held as NF4 codes, dequantised per matmul
    platform: str | None = None  # the backend compiled for (None: jax's default; --plan-for: the target's)

    @nn.compact
    def __call__(self, ids_BxT: jax.Array, cache: KVCache, start: jax.Array,
                 last: jax.Array | None = None, fresh: bool = False) -> tuple[jax.Array, KVCache]:
        embed_VxD = self.param(
            "embed", nn.initializers.normal(0.02), (self.shape.vocab_size, self.shape.d_model), jnp.float32
        )
        x_BxTxD = embed_tokens(self.shape, embed_VxD, ids_BxT, self.dtype)
        new_cache = []
        nf4 = self.nf4 and layout_for(self.platform or jax.default_backend(), decoding=True)  # NF4Dense's layout
        for i in range(self.shape.n_layers):
            block = CachedBlock(self.shape, self.dtype, i, self.lora, self.matmul, nf4, name=f"block_{i}")
            x_BxTxD, layer_cache = block(x_BxTxD, cache[i], start, fresh)
            new_cache.append(layer_cache)
        if last is not None:
            x_BxTxD = jax.lax.dynamic_slice_in_dim(x_BxTxD, last, 1, axis=1)
        x_BxTxD = norm(self.shape, "final_norm")(x_BxTxD)
        if self.matmul == "bfloat16":
            return bf16_linear_rows(x_BxTxD, head_weights(self, embed_VxD), jnp.float32), new_cache
        operands = jnp.promote_types(x_BxTxD.dtype, self.dtype)  # the einsum's promotion, as in training
        head_VxD = head_weights(self, embed_VxD)
        chunk = HEAD_CHUNK if (self.platform or jax.default_backend()) == "cpu" else head_VxD.shape[0]
        return head_logits(x_BxTxD.astype(operands), head_VxD, chunk), new_cache


def decode(model: Transformer, params: Any, ids_BxT: jax.Array, cache: KVCache, start: jax.Array,
           last: jax.Array | None = None, fresh: bool = False) -> tuple[jax.Array, KVCache]:
    """`model`'s logits for ids_BxT at positions start..start+T-1 given the cache of positions < start.

    The cache must have been made by `init_cache` with `model.dtype` and filled by earlier calls for every
    position < start; the returned cache also holds these T positions. `fresh`: start is 0 (a prefill into an
    empty cache), so the T tokens attend to each other only, by slm.model.attention.causal_attend's blocks
    instead of against the whole cache.
    """
    return CachedTransformer(model.shape, model.dtype, model.lora, model.matmul, model.nf4, model.platform).apply(
        {"params": params}, ids_BxT, cache, start, last, fresh)
