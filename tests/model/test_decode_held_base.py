"""The KV-cache decoder applies a LoRA run's adapters beside their kernels and an NF4 base as codes, as training
does: its logits equal the full training forward's, and equal the folded (or dequantised) float32 model's, so
sampling needs no float32 copy of the base."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slm.model import nf4
from slm.model.decode import decode, init_cache
from slm.model.lora import LoraSpec, fold, merge, split
from slm.model.sizing import ModelShape
from slm.model.transformer import Transformer, init_params

SHAPE = ModelShape(vocab_size=96, n_layers=2, d_model=64, n_heads=4, d_ff=96, n_kv_heads=2, qkv_bias=True,
                   tie_embeddings=False)
LORA = LoraSpec(4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))


def decoded_logits(model, params, ids):
    """Prefill the first half, then one token at a time: every position's logits."""
    B, L = ids.shape
    P = L // 2
    dec = jax.jit(decode, static_argnums=0)
    first, cache = dec(model, params, ids[:, :P], init_cache(model.shape, B, 64, model.dtype), 0)
    out = [first]
    for t in range(P, L):
        logits, cache = dec(model, params, ids[:, t:t + 1], cache, t)
        out.append(logits)
    return np.asarray(jnp.concatenate(out, axis=1))


def trained_params(model):
    params = init_params(model, 0, 16)  # adapters' B off zero: they change the output
    return jax.tree_util.tree_map_with_path(
        lambda p, x: np.asarray(x) + 0.05 * ("lora_b" in jax.tree_util.keystr(p)), params)


@pytest.mark.parametrize("matmul", ["float32", "bfloat16"])
def test_lora_decoding_equals_the_training_forward_and_the_folded_model(matmul):
    tuned = Transformer(SHAPE, lora=LORA, matmul=matmul)
    params = trained_params(tuned)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)), jnp.int32)
    got = decoded_logits(tuned, params, ids)
    tol = 1e-4 if matmul == "float32" else 3e-2
    np.testing.assert_allclose(got, np.asarray(tuned.apply({"params": params}, ids)), atol=tol, rtol=0)
    plain = Transformer(SHAPE, matmul=matmul)  # the old way: adapters folded into float32 kernels
    folded = fold(params, SHAPE, LORA)
    np.testing.assert_allclose(got, decoded_logits(plain, folded, ids), atol=tol, rtol=0)
    assert np.abs(got - decoded_logits(plain, split(params)[0], ids)).max() > 10 * tol  # the adapters matter


@pytest.mark.parametrize("platform", ["cpu", "gpu"])  # the CPU's decoder takes the halves, a GPU's the pairs
def test_nf4_decoding_equals_the_dequantised_models_and_holds_only_codes(platform):
    tuned = Transformer(SHAPE, lora=LORA, nf4=True, platform=platform)
    params = trained_params(Transformer(SHAPE, lora=LORA))
    base, adapters = split(params)
    held = merge(nf4.quantize_params(jax.tree.map(np.asarray, base)), adapters)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 12)), jnp.int32)
    got = decoded_logits(tuned, held, ids)
    dequantised = fold(merge(nf4.dequantize_params(split(held)[0], SHAPE), adapters), SHAPE, LORA)
    np.testing.assert_allclose(got, decoded_logits(Transformer(SHAPE), dequantised, ids), atol=1e-4, rtol=0)
    kernels = [k for k in jax.tree_util.tree_flatten_with_path(held)[0] if "kernel" in jax.tree_util.keystr(k[0])
               and "block_" in jax.tree_util.keystr(k[0])]
    assert not kernels  # the blocks' matmul kernels are codes and absmax only


def test_the_cpu_decoder_casts_a_bf16_head_a_chunk_at_a_time():
    """The sampler's one-token step with a LoRA base's bf16 embedding as its head (tied): XLA's temporaries hold
    no float32 copy of the whole head (it was cast whole each token: 1.2 GB for Gemma-3-1B)."""
    shape = ModelShape(vocab_size=65536, n_layers=1, d_model=128, n_heads=4, d_ff=256)  # head: 32 MB as float32
    model = Transformer(shape, lora=LORA, platform="cpu")
    params = jax.eval_shape(lambda: init_params(model, 0, 8))
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16 if "embed" in jax.tree_util.keystr(p) else x.dtype),
        params)
    cache = jax.eval_shape(lambda: init_cache(shape, 1, 16, model.dtype))
    step = jax.jit(decode, static_argnums=0).lower(model, params, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache,
                                                   jax.ShapeDtypeStruct((), jnp.int32)).compile()
    temp = step.memory_analysis().temp_size_in_bytes
    assert temp < shape.vocab_size * shape.d_model * 4 / 4, temp / 2**20
