import math

import numpy as np
import pytest

from slm.model.sizing import (
    ModelShape,
    SizingError,
    choose_shape,
    count_params,
    default_vocab_size,
    flops_per_token,
)

TARGETS = np.unique(np.logspace(5, 8, 31).astype(int))


@pytest.mark.parametrize("target", TARGETS)
def test_grid_within_5_percent_with_default_vocab(target):
    shape = choose_shape(int(target), default_vocab_size(int(target)))
    assert abs(count_params(shape) / target - 1) <= 0.05
    assert 32 <= shape.head_dim <= 64
    assert shape.d_model % shape.n_heads == 0
    assert 2 * shape.d_model <= shape.d_ff <= 4 * shape.d_model


@pytest.mark.parametrize("vocab", [257, 1024, 4096, 8192, 32000])
def test_grid_within_5_percent_for_fixed_vocabs(vocab):
    checked = 0
    for target in TARGETS:
        if vocab * 32 * 1.25 >= target:  # embedding alone would dominate: refused, tested below
            continue
        shape = choose_shape(int(target), vocab)
        assert abs(count_params(shape) / target - 1) <= 0.05, (target, vocab, shape)
        checked += 1
    assert checked > 0


def test_small_models_are_deeper_than_wide_ratio_grows_slowly():
    shallow = choose_shape(1_000_000, 1024)
    deep = choose_shape(100_000_000, 8192)
    assert deep.n_layers > shallow.n_layers
    assert deep.d_model / deep.n_layers < 64  # not GPT-2's 64 width per layer: depth favoured


def test_target_too_small_for_vocab_is_refused_with_the_fix():
    with pytest.raises(SizingError, match="too small for vocab"):
        choose_shape(50_000, 8192)


def test_overrides_are_honoured():
    shape = choose_shape(2_000_000, 1024, n_layers=6, d_model=160, n_heads=5)
    assert (shape.n_layers, shape.d_model, shape.n_heads) == (6, 160, 5)
    assert abs(count_params(shape) / 2_000_000 - 1) <= 0.05
    with pytest.raises(SizingError, match="divisible"):
        choose_shape(2_000_000, 1024, d_model=192, n_heads=5)


@pytest.mark.parametrize("layers", range(1, 9))
def test_every_pinned_depth_fits_the_race_model(layers):
    """--n-layers N at 0.8M parameters, vocab 2048: depths whose widths fall between the grid of 32 (4 layers:
    d_model 112, 4 heads of 28) get a shape too, and the choice on the grid is what it always was (3: 3 x 128)."""
    shape = choose_shape(800_000, 2048, n_layers=layers)
    assert shape.n_layers == layers
    assert abs(count_params(shape) / 800_000 - 1) <= 0.05
    assert shape.d_model % shape.n_heads == 0 and shape.head_dim % 2 == 0
    assert 2 * shape.d_model <= shape.d_ff <= 4 * shape.d_model
    if layers == 3:
        assert (shape.d_model, shape.n_heads, shape.d_ff) == (128, 4, 296)
    if layers == 4:
        assert (shape.d_model, shape.n_heads) == (112, 4)


def test_pinned_depth_that_cannot_fit_names_the_flag_not_the_vocab():
    with pytest.raises(SizingError, match="no shape with --n-layers 32 reaches") as e:
        choose_shape(200_000, 2048, n_layers=32)
    assert "too small for vocab" not in str(e.value)
    with pytest.raises(SizingError, match="too small for vocab"):  # the vocabulary's fix comes first
        choose_shape(20_000, 1024, n_layers=2)


def test_count_params_formula_by_hand():
    s = ModelShape(vocab_size=100, n_layers=2, d_model=32, n_heads=1, d_ff=64)
    embed = 100 * 32
    per_layer = 4 * 32 * 32 + 3 * 32 * 64 + 2 * 32
    assert count_params(s) == embed + 2 * per_layer + 32


def test_flops_per_token_is_6n_plus_attention():
    s = ModelShape(1024, 4, 128, 4, 352)
    assert flops_per_token(s, 64) == 6 * count_params(s) + 12 * 4 * 128 * 64
    assert math.isclose(flops_per_token(s, 1) / (6 * count_params(s)), 1, rel_tol=0.01)


def test_lora_trainable_params_of_the_seed_mistral_run():
    """Seed 002: LoRA r=16 on q_proj and v_proj of Mistral-7B-v0.1 trains 6,815,744 parameters (0.094%)."""
    import json

    from helpers import ROOT

    from slm.io.hf_import import shape_from_hf_config
    from slm.model.sizing import lora_params

    cfg = json.loads((ROOT.parent / "shared" / "models" / "mistral-7b-v0.1" / "config.json").read_text())
    shape = shape_from_hf_config(cfg)
    assert count_params(shape) == 7_241_732_096  # Mistral-7B-v0.1's published count
    assert lora_params(shape, 16, ["q_proj", "v_proj"]) == 6_815_744
    assert f"{lora_params(shape, 16, ['q_proj', 'v_proj']) / count_params(shape):.3%}" == "0.094%"
    assert lora_params(shape, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]) == 13_631_488
    with pytest.raises(SizingError, match="--lora-targets qkv"):
        lora_params(shape, 16, ["qkv"])
