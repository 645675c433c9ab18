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
    """The CPU's pair lookup and the accelerators' row lookup (slm.model.nf4.layout_for) give numpy's weights to
    the bit; (7, 5): an `in` that is no multiple of the block, which the row lookup leaves to the pairs."""
    q = nf4.quantize((np.random.default_rng(2).standard_normal((n_in, n_out)) * 0.02).astype(np.float32))
    want = nf4.dequantize(q, n_in, n_out).T
    for layout in ("pairs", "rows"):
        got = nf4.dequantize_rows(jnp.asarray(q["nf4_codes"]), jnp.asarray(q["nf4_absmax"]), n_in, n_out,
                                  jnp.float32, layout=layout)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_tpu_dequantises_without_padded_temporaries():
    """Compiled for a TPU (libtpu, compile-only), the row lookup holds about its output; the pair lookup's
    (n, 2) array is laid out with its last dimension padded to 128 lanes: 64x its size."""
    from jax.sharding import SingleDeviceSharding

    from slm.memory.targets import load_target
    from slm.train.aot import compile_only, target_devices

    n_in, n_out = 576, 1536
    device = SingleDeviceSharding(target_devices(load_target("v5e-1"))[0])
    args = (jax.ShapeDtypeStruct((n_in * n_out // 2,), jnp.uint8, sharding=device),
            jax.ShapeDtypeStruct((n_in * n_out // nf4.BLOCK,), jnp.float32, sharding=device))
    temps = {}
    for layout in ("pairs", nf4.layout_for("tpu")):
        f = jax.jit(lambda c, a: nf4.dequantize_rows(c, a, n_in, n_out, jnp.bfloat16, layout=layout))  # noqa: B023
        with compile_only():
            temps[layout] = f.lower(*args).compile().memory_analysis().temp_size_in_bytes
    output = n_in * n_out * 2
    assert temps["rows"] <= output and temps["pairs"] > 50 * output, temps


@pytest.mark.slow
@pytest.mark.parametrize("matmul, platform", [("float32", None), ("bfloat16", None), ("float32", "tpu")])
def test_an_nf4_model_computes_what_its_dequantised_weights_compute(matmul, platform):
    shape = ModelShape(vocab_size=128, n_layers=2, d_model=64, n_heads=4, d_ff=96, n_kv_heads=2, qkv_bias=True)
    lora = LoraSpec(4, targets=("q_proj", "v_proj", "down_proj"))
    plain = Transformer(shape, lora=lora, matmul=matmul)
    params = jax.tree_util.tree_map_with_path(  # B off zero, so the adapters' gradients flow everywhere
        lambda p, x: np.asarray(x) + 0.01 * ("lora_b" in jax.tree_util.keystr(p)), init_params(plain, 0, 16))
    quantized = nf4.quantize_params(params)
    dequantized = nf4.dequantize_params(quantized, shape)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)
    held = Transformer(shape, lora=lora, matmul=matmul, nf4=True, platform=platform)  # "tpu": the row lookup
    tol = 0 if matmul == "float32" else 5e-3  # bf16: the plain model rounds the kernel, the nf4 one its levels
    assert np.abs(held.apply({"params": quantized}, ids) - plain.apply({"params": dequantized}, ids)).max() <= tol

    def loss(adapters, base, model):
        return model.apply({"params": merge(base, adapters)}, ids).std()

    (bq, aq), (bd, ad) = split(quantized), split(dequantized)
    got, want = jax.grad(loss)(aq, bq, held), jax.grad(loss)(ad, bd, plain)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-3 if matmul == "bfloat16" else 1e-5, atol=1e-6)


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
