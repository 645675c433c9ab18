"""slm.io.hf_import (issue 15, first part): tiny random Llama, Mistral and Qwen2 models saved by transformers
(grouped-query attention, rope theta, RMSNorm eps, Qwen2's q/k/v biases, tied and untied heads; norms and
biases randomised) load into this trainer's model with float32 logits within 1e-4 of transformers' and the
same greedy continuation token for token; exported back, transformers reads the same logits again."""

from __future__ import annotations

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
from slm.model.transformer import Transformer

TOL = 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_generation_match_transformers(family, tmp_path):
    hf = save_tiny(family, tmp_path / "hf")
    shape, params, _ = load_hf_folder(str(tmp_path / "hf"))
    assert shape.kv_heads == 2 and shape.qkv_bias == (family == "qwen2")
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
    with pytest.raises(RunError, match="rope scaling 'llama3' is not supported yet"):
        load_hf_folder(str(folder))
