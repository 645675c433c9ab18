"""slm.model.nf4 (issue 33, QLoRA): NF4 quantisation as QLoRA/bitsandbytes define it (the 16 levels, blocks of
64 over the (out, in) weight row-major, nearest level, two codes a byte with the first in the high nibble), its
error on normal weights, and a model holding NF4 codes computes exactly what the same model with the
dequantised float32 kernels computes, forward and adapter gradients, without holding a wide copy of the base."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slm.model import nf4
from slm.model.lora import LoraSpec, merge, split
from slm.model.sizing import ModelShape
from slm.model.transformer import Transformer, init_params


def test_codes_are_the_nearest_level_in_bitsandbytes_layout():
    rng = np.random.default_rng(0)
    w_OxI = rng.standard_normal((3, 128)).astype(np.float32)  # (out, in): torch's layout
    q = nf4.quantize(w_OxI.T)  # the model's kernel is (in, out)
    assert q["nf4_codes"].dtype == np.uint8 and q["nf4_codes"].shape == (3 * 128 // 2,)
    blocks = w_OxI.reshape(-1, 64)  # each output row's 128 inputs are two whole blocks
    np.testing.assert_array_equal(q["nf4_absmax"], np.abs(blocks).max(axis=1))
    codes = np.stack([q["nf4_codes"] >> 4, q["nf4_codes"] & 15], axis=-1).reshape(-1, 64)  # high nibble first
    want = np.abs(blocks[..., None] / q["nf4_absmax"][:, None, None] - nf4.LEVELS).argmin(axis=-1)
    np.testing.assert_array_equal(codes, want)
    assert codes.max() == 15 and codes.min() == 0  # each block's absmax is exactly a +-1 level
    np.testing.assert_array_equal(nf4.dequantize(q, 128, 3), (nf4.LEVELS[codes] * q["nf4_absmax"][:, None]).reshape(3, 128).T)


def test_quantisation_error_on_normal_weights_and_odd_sizes():
    rng = np.random.default_rng(1)
    k = (rng.standard_normal((576, 1536)) * 0.02).astype(np.float32)
    back = nf4.dequantize(nf4.quantize(k), 576, 1536)
    rel = np.linalg.norm(back - k) / np.linalg.norm(k)
    assert 0.08 < rel < 0.11, rel  # NF4 at block 64 on N(0, s): ~9.4% relative RMS error
    odd = rng.standard_normal((7, 5)).astype(np.float32)  # 35 weights: one padded block
    q = nf4.quantize(odd)
    assert q["nf4_absmax"].shape == (1,) and np.abs(nf4.dequantize(q, 7, 5) - odd).max() <= 0.2 * np.abs(odd).max()


@pytest.mark.parametrize("n_in, n_out", [(576, 1536), (128, 3), (7, 5)])
def test_each_layout_dequantises_to_the_numpy_reference(n_in, n_out):
    """The CPU's pair lookup and a TPU's halves (slm.model.nf4.layout_for: the even and the odd inputs' weights)
    give numpy's weights to the bit in float32; the halves in bf16 (their arithmetic's dtype) within three bf16
    roundings of them (the level, the absmax, their product). (7, 5): an `in` that is no multiple of the block,
    which only the pairs take."""
    q = nf4.quantize((np.random.default_rng(2).standard_normal((n_in, n_out)) * 0.02).astype(np.float32))
    want = nf4.dequantize(q, n_in, n_out).T
    codes, absmax = jnp.asarray(q["nf4_codes"]), jnp.asarray(q["nf4_absmax"])
    np.testing.assert_array_equal(np.asarray(nf4.dequantize_rows(codes, absmax, n_in, n_out, jnp.float32)), want)
    if n_in % nf4.BLOCK:
        return
    for dtype, rtol in ((jnp.float32, 0), (jnp.bfloat16, 3 * 2.0**-8)):
        even, odd = nf4.dequantize_halves(codes, absmax, n_in, n_out, dtype)
        assert even.dtype == odd.dtype == dtype and even.shape == odd.shape == (n_out, n_in // 2)
        np.testing.assert_allclose(np.asarray(even, np.float32), want[:, 0::2], rtol=rtol, atol=0)
        np.testing.assert_allclose(np.asarray(odd, np.float32), want[:, 1::2], rtol=rtol, atol=0)


def test_a_tpu_dequantises_without_padded_temporaries():
    """Compiled for a TPU (libtpu, compile-only), the halves hold at most their bf16 output beyond it; the
    pair lookup's (n, 2) array is laid out with its last dimension padded to 128 lanes: 64x its size."""
    from jax.sharding import SingleDeviceSharding

    from slm.memory.targets import load_target
    from slm.train.aot import compile_only, target_devices

    n_in, n_out = 576, 1536
    device = SingleDeviceSharding(target_devices(load_target("v5e-1"))[0])
    args = (jax.ShapeDtypeStruct((n_in * n_out // 2,), jnp.uint8, sharding=device),
            jax.ShapeDtypeStruct((n_in * n_out // nf4.BLOCK,), jnp.float32, sharding=device))
    with compile_only():
        pairs = jax.jit(lambda c, a: nf4.dequantize_rows(c, a, n_in, n_out, jnp.bfloat16)).lower(*args).compile()
        halves = jax.jit(lambda c, a: nf4.dequantize_halves(c, a, n_in, n_out, jnp.bfloat16)).lower(*args).compile()
    output = n_in * n_out * 2
    temps = [p.memory_analysis().temp_size_in_bytes for p in (pairs, halves)]
    assert temps[1] <= output and temps[0] > 50 * output, temps


@pytest.mark.slow
@pytest.mark.parametrize("matmul, platform", [("float32", None), ("bfloat16", None), ("float32", "tpu"),
                                              ("bfloat16", "tpu")])
def test_an_nf4_model_computes_what_its_dequantised_weights_compute(matmul, platform):
    shape = ModelShape(vocab_size=128, n_layers=2, d_model=64, n_heads=4, d_ff=96, n_kv_heads=2, qkv_bias=True)
    lora = LoraSpec(4, targets=("q_proj", "v_proj", "down_proj"))
    plain = Transformer(shape, lora=lora, matmul=matmul)
    params = jax.tree_util.tree_map_with_path(  # B off zero, so the adapters' gradients flow everywhere
        lambda p, x: np.asarray(x) + 0.01 * ("lora_b" in jax.tree_util.keystr(p)), init_params(plain, 0, 16))
    quantized = nf4.quantize_params(params)
    # a TPU's bf16 step dequantises in bf16 (three roundings a weight, checked against numpy above): the plain
    # model gets those very weights, so what is compared is the halves' products and their gradients
    dequantized = (halves_dequantized if matmul == "bfloat16" and platform == "tpu" else nf4.dequantize_params)(
        quantized, shape)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)
    held = Transformer(shape, lora=lora, matmul=matmul, nf4=True, platform=platform)  # "tpu": the halves
    # bf16: the plain model rounds the kernel, the nf4 one its levels; a TPU's halves sum two half-width products
    tol = 5e-3 if matmul == "bfloat16" else 1e-6 if platform == "tpu" else 0
    assert np.abs(held.apply({"params": quantized}, ids) - plain.apply({"params": dequantized}, ids)).max() <= tol

    def loss(adapters, base, model):
        return model.apply({"params": merge(base, adapters)}, ids).std()

    (bq, aq), (bd, ad) = split(quantized), split(dequantized)
    got, want = jax.grad(loss)(aq, bq, held), jax.grad(loss)(ad, bd, plain)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-3 if matmul == "bfloat16" else 1e-5, atol=1e-6)


def halves_dequantized(params: dict, shape: ModelShape) -> dict:
    """dequantize_params with each kernel the bf16 halves' weights, interleaved back to (in, out), as float32
    (a kernel whose `in` is no multiple of the block is the pairs' there too)."""
    out, kernels = nf4.dequantize_params(params, shape), nf4.kernel_shapes(shape).items()
    for name, block in params.items():
        for (part, kernel), (n_in, n_out) in kernels if name.startswith("block_") else ():
            if n_in % nf4.BLOCK:
                continue
            q = block[part][kernel]
            halves = nf4.dequantize_halves(jnp.asarray(q["nf4_codes"]), jnp.asarray(q["nf4_absmax"]), n_in, n_out,
                                           jnp.bfloat16)
            out[name][part][kernel]["kernel"] = jnp.stack(halves, -1).reshape(n_out, n_in).T.astype(jnp.float32)
    return out


def test_the_step_never_holds_the_base_dequantised():
    """XLA's memory analysis of the adapters' gradient: with an NF4 base the temporaries are the float32 base's
    plus about one kernel dequantised (each is dequantised, used and dropped, forward and backward), far
    below a float32 copy of the block kernels (where it was before the kernels' dequantisation was tied to
    each layer's input and cotangent: slm.model.nf4._after)."""
    shape = ModelShape(vocab_size=256, n_layers=8, d_model=256, n_heads=4, d_ff=1024)
    ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    temporaries = {}
    for held in (True, False):
        model = Transformer(shape, lora=LoraSpec(4), nf4=held)
        base, adapters = split(jax.eval_shape(lambda: init_params(model, 0, 8)))
        grad = jax.jit(jax.grad(lambda a, b, i: model.apply({"params": merge(b, a)}, i).mean()))
        temporaries[held] = grad.lower(adapters, base, ids).compile().memory_analysis().temp_size_in_bytes
    kernels = shape.n_layers * sum(i * o for i, o in nf4.kernel_shapes(shape).values())
    largest = max(i * o for i, o in nf4.kernel_shapes(shape).values())
    extra = temporaries[True] - temporaries[False]  # what holding the base as NF4 adds to the step
    assert extra <= 16 * largest, (temporaries, largest)  # a few of the largest kernel in float32, at most
    assert extra < kernels * 4 / 4, (temporaries, kernels)  # not a quarter of the block kernels' float32 copy
