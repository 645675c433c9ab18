"""slm.train.defaults: every setting the user left unset is chosen in one place, said in one block with its
reason and recorded in config.json; a setting the user gave is never changed."""

import dataclasses
import json

import pytest

from slm.cli.config_file import load_config_file
from slm.model.sizing import choose_shape
from slm.train.config import Config
from slm.train.defaults import resolve_defaults
from train_optimized import train

UNSET = ("learning_rate", "optimizer", "dropout", "matmul_precision", "loss_chunk")
GIVEN = {"learning_rate": 3e-4, "optimizer": "adamw", "dropout": 0.0, "matmul_precision": "float32",
         "loss_chunk": 256}


@pytest.mark.parametrize("given", [(), ("learning_rate",), ("optimizer", "loss_chunk"), tuple(GIVEN)])
def test_a_given_setting_is_kept_and_each_unset_one_chosen_with_a_reason(given):
    c = Config(dataset_id="x.txt", **{k: GIVEN[k] for k in given})
    out, choices = resolve_defaults(c, choose_shape(1_000_000, 2048), "cpu", "bfloat16")
    assert [ch.key for ch in choices] == [k for k in UNSET if k not in given]
    assert all(getattr(out, k) == GIVEN[k] for k in given)
    assert all(getattr(out, k) is not None for k in UNSET)  # complete
    assert all(ch.reason and ch.line().startswith(f"[defaults] --{ch.key.replace('_', '-')} ") for ch in choices)
    assert dataclasses.replace(out, **{k: getattr(c, k) for k in UNSET}) == c  # nothing else touched
    assert c.learning_rate == GIVEN["learning_rate"] if "learning_rate" in given else c.learning_rate is None


def test_a_pretrained_start_and_an_accelerator_get_their_own_defaults():
    shape = choose_shape(5_000_000, 32_000)
    scratch, _ = resolve_defaults(Config(dataset_id="x.txt"), shape, "cpu", "float32")
    tuned, _ = resolve_defaults(Config(dataset_id="x.txt", init_from="some/model"), shape, "gpu", "float32")
    assert (scratch.optimizer, scratch.dropout) == ("muon", 0.1)
    assert (tuned.optimizer, tuned.dropout) == ("adamw", 0.0)  # docs/pretrained.md's measurement
    # the loss chunk follows the precision the user chose, not the default one
    given, _ = resolve_defaults(Config(dataset_id="x.txt", matmul_precision="bfloat16"), choose_shape(1_000_000, 2048),
                                "cpu", "float32")
    default, _ = resolve_defaults(Config(dataset_id="x.txt"), choose_shape(1_000_000, 2048), "cpu", "float32")
    assert given.loss_chunk > 0 and default.loss_chunk == 0


@pytest.mark.parametrize("stored, products, mixed, held", [
    ("bfloat16", "bfloat16", False, "bfloat16"),  # the products round the kernels to bf16 anyway
    ("bfloat16", "float32", True, "bfloat16"),  # so does --use-mixed-precision's compute dtype
    ("bfloat16", "float32", False, "float32"),  # float32 products would keep float32 copies beside it
    ("float32", "bfloat16", False, "float32"),  # rounding a float32 checkpoint would change its norms and embedding
    (None, "bfloat16", False, "float32"),  # mixed or unknown
])
def test_a_lora_base_is_held_in_bfloat16_only_where_no_value_changes(stored, products, mixed, held):
    c = Config(dataset_id="x.txt", init_from="m", lora_rank=8, use_mixed_precision=mixed)
    out, choices = resolve_defaults(c, choose_shape(1_000_000, 2048), "cpu", products, stored)
    assert out.base_dtype == held and [ch.value for ch in choices if ch.key == "base_dtype"] == [held]
    given, choices = resolve_defaults(dataclasses.replace(c, base_dtype="float32"), choose_shape(1_000_000, 2048),
                                      "cpu", products, stored)
    assert given.base_dtype == "float32" and "base_dtype" not in [ch.key for ch in choices]
    full, choices = resolve_defaults(dataclasses.replace(c, lora_rank=None), choose_shape(1_000_000, 2048), "cpu",
                                     products, stored)
    assert full.base_dtype is None and "base_dtype" not in [ch.key for ch in choices]  # no frozen base: not said


@pytest.mark.slow
def test_the_run_says_its_defaults_in_one_block_and_records_them(tmp_path, data_dir):
    logs = []
    out = tmp_path / "run"
    train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=100_000,
                 seq_len=32, batch_size=8, max_steps=1, eval_tokens=2048, learning_rate=2e-3, output_dir=str(out)),
          log=logs.append)
    lines = [i for i, line in enumerate(logs) if line.startswith("[defaults]")]
    assert lines == list(range(lines[0], lines[0] + len(lines)))  # one block
    cfg = json.loads((out / "config.json").read_text())
    assert sorted(cfg["defaults"]) == sorted(k for k in UNSET if k != "learning_rate")
    assert cfg["learning_rate"] == 2e-3 and not any("--learning-rate" in logs[i] for i in lines)
    assert all(cfg[k] is not None for k in UNSET)
    # the run's own config.json repeats it (--config), the defaults record read as a derived key
    values, notes = load_config_file(str(out / "config.json"), Config)
    assert "defaults" not in values and values["optimizer"] == cfg["optimizer"] and notes
