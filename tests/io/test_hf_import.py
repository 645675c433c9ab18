"""slm.io.hf_import (issue 15, first part; Qwen3 from issue 33): tiny random Llama, Mistral, Qwen2 and Qwen3
models saved by transformers (grouped-query attention, rope theta, RMSNorm eps, Qwen2's q/k/v biases, Qwen3's
q/k norms and head_dim != hidden / heads, tied and untied heads; norms and biases randomised) load into this
trainer's model with float32 logits within 1e-4 of transformers' and the same greedy continuation token for
token; exported back, transformers reads the same logits again."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import FAMILIES, save_tiny

from slm.errors import RunError
from slm.io.hf_export import write_export
from slm.io.hf_import import load_hf_folder
from slm.model.generate import generate_ids
from slm.model.sizing import count_params
from slm.model.transformer import Transformer

TOL = 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_generation_match_transformers(family, tmp_path):
    hf = save_tiny(family, tmp_path / "hf")
    shape, params, _ = load_hf_folder(str(tmp_path / "hf"))
    biased = FAMILIES[family].get("attention_bias", False)
    assert shape.kv_heads == 2 and shape.qkv_bias == (family == "qwen2" or biased) and shape.o_bias == biased
    assert shape.qk_norm == (family in ("qwen3", "gemma3", "qwen3_bias"))
    assert count_params(shape) == sum(p.numel() for p in hf.parameters())
    assert shape.tie_embeddings == FAMILIES[family]["tie_word_embeddings"]
    assert sum(p.numel() for p in hf.parameters()) == sum(x.size for x in _leaves(params))
    model = Transformer(shape)
    ids = np.random.default_rng(0).integers(0, 128, (2, 23))
    ours = np.asarray(model.apply({"params": params}, jnp.asarray(ids, jnp.int32)))
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() < TOL, np.abs(ours - theirs).max()

    prompt = [5, 17, 99, 3]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    got = generate_ids(model, params, prompt, 12, temperature=0.0)[0].tolist()
    assert got == want

    # Exported back (a fine-tuned run writes this): transformers reads the same model.
    write_export(str(tmp_path / "out"), params, shape, max_positions=128)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 2 and cfg["rope_theta"] == FAMILIES[family]["rope_theta"]
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        back = again(input_ids=torch.tensor(ids)).logits.numpy()
    assert np.abs(back - theirs).max() < TOL


def _leaves(tree):
    for v in tree.values():
        yield from (_leaves(v) if isinstance(v, dict) else [v])


def test_pickled_weights_and_unknown_architectures_are_refused(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                                                    "num_attention_heads": 2, "vocab_size": 4,
                                                    "num_hidden_layers": 1, "intermediate_size": 8}))
    (folder / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(RunError, match="only pickled .bin weights, which are never loaded here"):
        load_hf_folder(str(folder))
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(RunError, match="architecture 'GPT2LMHeadModel' is not supported"):
        load_hf_folder(str(folder))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
    with pytest.raises(RunError, match=r"rope scaling 'llama3' \(in rope_scaling\) lacks low_freq_factor"):
        load_hf_folder(str(folder))


def test_a_tensor_the_config_does_not_describe_refuses_the_load_naming_it(tmp_path):
    """A checkpoint is loaded whole or refused: biases in the weights that config.json does not announce
    (attention_bias edited off) are named, not dropped."""
    save_tiny("llama_bias", tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "attention_bias": False}))
    with pytest.raises(RunError, match=r"tensor\(s\) this model does not use: self_attn.k_proj.bias, "
                                       r"self_attn.o_proj.bias"):
        load_hf_folder(str(tmp_path / "hf"))


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "linear", "factor": 4.0},
])
def test_rope_scaling_is_honoured_in_both_config_layouts(scaling, tmp_path):
    """Issue 33's silent wrong answer: transformers 5 writes the scaling inside `rope_parameters`, and it was
    loaded without a word (logits off by up to 14). Now it is computed, from that layout and from the hub's
    older one (`rope_scaling` + `rope_theta`), and the export writes both layouts back."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_scaling=dict(scaling))  # transformers adds to it
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention, so positions matter to the logits
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    hf.save_pretrained(str(tmp_path / "new"), safe_serialization=True)
    saved = json.loads((tmp_path / "new" / "config.json").read_text())
    assert saved.get("rope_parameters", {}).get("rope_type") == scaling["rope_type"] and not saved.get("rope_scaling")
    ids = np.random.default_rng(0).integers(0, 128, (2, 40))  # past the original context of 32
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids)).logits.numpy()
    old = {k: v for k, v in saved.items() if k != "rope_parameters"}  # the hub's older layout of the same model
    old.update(rope_theta=saved["rope_parameters"]["rope_theta"],
               rope_scaling={k: v for k, v in saved["rope_parameters"].items() if k != "rope_theta"})
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    (tmp_path / "old" / "model.safetensors").symlink_to(tmp_path / "new" / "model.safetensors")
    for layout in ("new", "old"):
        shape, params, _ = load_hf_folder(str(tmp_path / layout))
        assert shape.rope_scaling[0] == scaling["rope_type"]
        ours = np.asarray(Transformer(shape).apply({"params": params}, jnp.asarray(ids, jnp.int32)))
        assert np.abs(ours - theirs).max() < TOL, (layout, np.abs(ours - theirs).max())
    unscaled = np.asarray(Transformer(dataclasses.replace(shape, rope_scaling=None)).apply({"params": params}, jnp.asarray(ids, jnp.int32)))
    print(f"{scaling['rope_type']}: without the scaling, max |diff| {np.abs(unscaled - theirs).max():.3f}")
    assert np.abs(unscaled - theirs).max() > 100 * TOL  # the scaling matters here
    write_export(str(tmp_path / "out"), params, shape, max_positions=128)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["rope_scaling"] == scaling  # the hub's layout, for transformers 4.x
    assert exported["rope_parameters"] == {**scaling, "rope_theta": config.rope_parameters["rope_theta"]}
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        back = again(input_ids=torch.tensor(ids)).logits.numpy()
    assert np.abs(back - theirs).max() < TOL


@pytest.mark.parametrize("key, value, says", [
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "rope scaling 'yarn'"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("attention_dropout", 0.1, "attention_dropout 0.1"),
    ("layer_types", ["sliding_attention", "full_attention"], "layer_types"),
    ("mlp_bias", True, "mlp_bias"),
])
def test_every_config_key_that_changes_the_computation_is_honoured_or_refused(key, value, says):
    from slm.model.hf_config import shape_from_hf_config

    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 4,
           "num_hidden_layers": 1, "intermediate_size": 8}
    assert shape_from_hf_config(cfg).rope_theta == 10000.0
    assert shape_from_hf_config({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}).rope_theta \
        == 5e5  # transformers 5's layout of a plain rope: its theta honoured
    with pytest.raises(RunError, match=f"^config.json: {says}"):
        shape_from_hf_config({**cfg, key: value})


def test_a_sliding_window_shorter_than_the_sequence_is_refused(tmp_path, data_dir):
    """Mistral attends within `sliding_window`; full attention is the same only while --seq-len fits in it."""
    from hf_tiny import save_tiny

    from slm.errors import ConfigError
    from train_optimized import Config, train

    save_tiny("mistral", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "sliding_window": 32}))
    with pytest.raises(ConfigError, match=r"^--seq-len 64: .* sliding window of 32 tokens .*use --seq-len 32 or less"):
        train(Config(init_from=str(tmp_path / "hf"), tokenizer=None, dataset_id=str(data_dir / "tinyshakespeare.txt"),
                     use_streaming=True, seq_len=64, batch_size=2, max_steps=1, output_dir=str(tmp_path / "run")),
              log=lambda *_: None)


def test_gemma3_in_both_config_layouts(tmp_path):
    """Gemma 3's config as transformers 5 saves it (layer_types, per-type rope_parameters) and as the hub has it
    (sliding_window_pattern, rope_theta + rope_local_base_freq, rope_scaling): the same shape and logits; and
    what this model cannot compute (soft-capping, another activation) is refused in one line."""
    hf = save_tiny("gemma3", tmp_path / "new")
    saved = json.loads((tmp_path / "new" / "config.json").read_text())
    assert "layer_types" in saved and "full_attention" in saved["rope_parameters"]
    old = {k: v for k, v in saved.items() if k not in ("layer_types", "rope_parameters", "_sliding_window_pattern")}
    old.update(sliding_window_pattern=3, rope_theta=saved["rope_parameters"]["full_attention"]["rope_theta"],
               rope_local_base_freq=saved["rope_parameters"]["sliding_attention"]["rope_theta"], rope_scaling=None)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    (tmp_path / "old" / "model.safetensors").symlink_to(tmp_path / "new" / "model.safetensors")
    ids = np.random.default_rng(0).integers(0, 128, (1, 20))
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids)).logits.numpy()
    shapes = []
    for layout in ("new", "old"):
        shape, params, _ = load_hf_folder(str(tmp_path / layout))
        ours = np.asarray(Transformer(shape).apply({"params": params}, jnp.asarray(ids, jnp.int32)))
        assert np.abs(ours - theirs).max() < TOL, layout
        shapes.append(shape)
    assert shapes[0] == shapes[1] and shapes[0].layer_windows == (8, 8, 0) and shapes[0].rope_local_theta == 1e4
    from slm.model.hf_config import shape_from_hf_config

    for key, value, says in [("final_logit_softcapping", 30.0, "final_logit_softcapping 30.0"),
                             ("hidden_activation", "gelu", "hidden_activation 'gelu'")]:
        with pytest.raises(RunError, match=f"^config.json: {says}"):
            shape_from_hf_config({**saved, key: value})


@pytest.mark.parametrize("chunk_bytes", [12, 4096, 64 << 20])  # chunks ending mid-row, several rows, one chunk
def test_float32_weights_read_narrowed_equal_numpys_own_cast(tmp_path, chunk_bytes, monkeypatch):
    """A float32 file held in bfloat16 is converted as read, a chunk at a time (never the whole float32 copy
    beside it): every value equals safetensors' float32 read cast by numpy, and a truncated file is refused."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from slm.io import hf_import

    rng = np.random.default_rng(0)
    path = str(tmp_path / "model.safetensors")
    save_file({"a": rng.standard_normal((37, 11), dtype=np.float32) * 3, "b": rng.standard_normal(5).astype(np.float32)},
              path)
    read = hf_import._read_tensor
    monkeypatch.setattr(hf_import, "_read_tensor", lambda *a: read(*a, chunk_bytes=chunk_bytes))
    got = dict(hf_import._tensors([path], ml_dtypes.bfloat16))
    for name, want in load_file(path).items():
        assert got[name].dtype == ml_dtypes.bfloat16 and got[name].shape == want.shape
        assert np.array_equal(got[name].view(np.uint16), want.astype(ml_dtypes.bfloat16).view(np.uint16))
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) - 8)
    with pytest.raises(RunError, match="truncated"):
        dict(hf_import._tensors([path], ml_dtypes.bfloat16))


def test_a_narrowed_read_never_holds_the_wide_tensor(tmp_path, monkeypatch):
    """numpy reports its buffers to tracemalloc: reading a 32 MB float32 tensor as bfloat16 (16 MB) in 1 MB
    chunks must peak below the float32 tensor's own size (the whole read and its cast held 48 MB)."""
    import tracemalloc

    import ml_dtypes
    from safetensors.numpy import save_file

    from slm.io import hf_import

    path = str(tmp_path / "model.safetensors")
    save_file({"w": np.ones((2048, 4096), np.float32)}, path)
    read = hf_import._read_tensor
    monkeypatch.setattr(hf_import, "_read_tensor", lambda *a: read(*a, chunk_bytes=1 << 20))
    tracemalloc.start()
    try:
        (name, w), = hf_import._tensors([path], ml_dtypes.bfloat16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert w.dtype == ml_dtypes.bfloat16 and float(w.astype(np.float32).min()) == 1.0
    assert peak < 2048 * 4096 * 4, peak


def _resave(folder, split: bool, stored) -> None:
    """The folder's model.safetensors saved again in `stored`, or (`split`) as two shards with an index,
    layer 2's MLP in the first and its attention in the second (read while layers 10 and 11 are)."""
    import os

    from safetensors.numpy import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = {k: v.astype(stored) for k, v in load_file(path).items()}
    os.remove(path)
    if not split:
        return save_file(tensors, path)
    first = {k for k in tensors if k == "model.embed_tokens.weight" or k.startswith(("model.layers.0.", "model.layers.1."))
             or (k.startswith("model.layers.2.") and ".mlp." in k)}
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": set(tensors) - first}
    for name, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(folder, name))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {k: name for name, keys in shards.items() for k in keys}}, f)


@pytest.mark.parametrize("vocab, layers, stored, held, split", [
    (512, 4, "float32", "float32", False), (512, 4, "float32", "bfloat16", False),  # layer-bound
    (16384, 2, "float32", "bfloat16", False), (16384, 2, "bfloat16", "float16", False),  # embedding-bound
    (512, 12, "float32", "float32", True)])  # a layer split over two shards
def test_the_reads_transient_is_what_tracemalloc_sees(tmp_path, vocab, layers, stored, held, split):
    """read_transient_mb, from the headers alone, is what reading a folder holds beyond what it placed (here
    `place` drops every array), from tracemalloc's peak to 25% over it: layer-bound reads (vocab 512: 4 MB
    float32 layers), embedding-bound ones (vocab 16,384: the held head and its read, under one chunk; bf16 to
    float16 converts a whole copy), and a layer split over two shards, half of it held while the next file's
    other layers are read. Before, a placed layer stayed referenced beside the next one (10.7 MB against 7.5)."""
    import tracemalloc

    import ml_dtypes

    from slm.io.hf_import import read_transient_mb
    from slm.model.sizing import ModelShape
    from slm.model.transformer import init_params

    shape = ModelShape(vocab_size=vocab, n_layers=layers, d_model=256, n_heads=4, d_ff=1024, n_kv_heads=2)
    write_export(str(tmp_path), init_params(Transformer(shape), 0, 8), shape, 64)
    as_numpy = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}
    _resave(str(tmp_path), split, as_numpy[stored])
    tracemalloc.start()
    try:
        load_hf_folder(str(tmp_path), place=lambda x: None, dtype=as_numpy[held])
        peak = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    predicted, _ = read_transient_mb(str(tmp_path), as_numpy[held])
    assert 0.99 * peak <= predicted <= 1.25 * peak, (peak, predicted)
    if not split:  # --plan-for's figure, from the shape and config.json's dtype alone (no shards known)
        from slm.memory.gpu_host import load_transient_bytes

        from_shape = load_transient_bytes(shape, stored, held) / 2**20
        assert 0.99 * peak <= from_shape <= 1.25 * peak, (peak, from_shape)


def test_checkpoint_dtype_reads_the_headers_then_config_json(tmp_path):
    """The dtype a folder's weights are stored in, from every shard's header (safetensors' own writer, with
    ml_dtypes' bfloat16); a folder with only config.json says its torch_dtype; mixed or unknown is None."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from slm.io.hf_import import checkpoint_dtype

    def folder(name: str, shards: dict, cfg: dict | None = None):
        out = tmp_path / name
        out.mkdir()
        for file, tensors in shards.items():
            save_file(tensors, str(out / file))
        if len(shards) > 1:
            (out / "model.safetensors.index.json").write_text(json.dumps(
                {"weight_map": {k: f for f, t in shards.items() for k in t}}))
        (out / "config.json").write_text(json.dumps(cfg or {"torch_dtype": "float32"}))
        return str(out)

    bf16 = np.ones((2, 3), ml_dtypes.bfloat16)
    assert checkpoint_dtype(folder("bf16", {"model.safetensors": {"a": bf16, "b": bf16[0]}})) == "bfloat16"
    assert checkpoint_dtype(folder("f32", {"model.safetensors": {"a": np.ones(3, np.float32)}})) == "float32"
    two = {"model-1.safetensors": {"a": bf16}, "model-2.safetensors": {"b": np.ones(3, np.float32)}}
    assert checkpoint_dtype(folder("mixed", two)) is None  # a float32 norm beside bf16 kernels: not one dtype
    assert checkpoint_dtype(folder("config-only", {}, {"torch_dtype": "bfloat16"})) == "bfloat16"
    assert checkpoint_dtype(folder("says-nothing", {}, {"model_type": "llama"})) is None
    run = tmp_path / "a-run"
    (run / "checkpoints").mkdir(parents=True)
    assert checkpoint_dtype(str(run)) == "float32"  # this trainer's runs keep float32 params
