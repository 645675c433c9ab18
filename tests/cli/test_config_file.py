"""--config FILE: YAML/JSON loading, key and type checks, a run's config.json round trip, the CLI wiring."""

import dataclasses
import json

import pytest

from slm.cli.config_file import NOT_REPRODUCED, load_config_file
from slm.cli.flags import parse_flags
from slm.errors import ConfigFileError
from slm.train.config import DERIVED_KEYS, Config


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_yaml_and_json_load_with_dashes_or_underscores(tmp_path):
    y = _write(tmp_path, "c.yaml", "batch-size: 8\nlearning_rate: 3e-4\nuse-streaming: true\n"
                                   "dataset_id: data.txt\nmax_time: 60\n# a comment\n")
    values, notes = load_config_file(y, Config)
    assert values == {"batch_size": 8, "learning_rate": 3e-4, "use_streaming": True, "dataset_id": "data.txt",
                      "max_time": 60.0}
    assert type(values["max_time"]) is float and notes == []
    j = _write(tmp_path, "c.json", json.dumps({"batch_size": 8, "learning-rate": 0.0003, "use_streaming": True}))
    assert load_config_file(j, Config)[0] == {"batch_size": 8, "learning_rate": 3e-4, "use_streaming": True}
    assert load_config_file(_write(tmp_path, "empty.yaml", "# nothing\n"), Config) == ({}, [])


def test_unknown_key_names_file_and_suggests(tmp_path):
    path = _write(tmp_path, "c.yaml", "batch_size: 8\nlearning_rat: 0.001\n")
    with pytest.raises(ConfigFileError, match=r"c\.yaml: unknown key 'learning_rat'; did you mean 'learning_rate'"):
        load_config_file(path, Config)
    with pytest.raises(ConfigFileError, match="unknown key 'zzz'; see --help"):
        load_config_file(_write(tmp_path, "d.yaml", "zzz: 1\n"), Config)


@pytest.mark.parametrize("text, match", [
    ("batch_size: eight\n", "key 'batch_size': expected an integer, got 'eight'"),
    ("batch_size: 8.5\n", "key 'batch_size': expected an integer, got 8.5"),
    ("use_streaming: 'yes'\n", "key 'use_streaming': expected true or false, got 'yes'"),
    ("use_streaming: 1\n", "key 'use_streaming': expected true or false, got 1"),
    ("preset: off\n", "key 'preset': expected a string, got the boolean False .*quote it"),
    ("seq_len: null\n", "key 'seq_len': null is not allowed"),
    ("max_steps: [1, 2]\n", "key 'max_steps': expected an integer or null"),
])
def test_bad_type_names_key(tmp_path, text, match):
    with pytest.raises(ConfigFileError, match=match):
        load_config_file(_write(tmp_path, "c.yaml", text), Config)


def test_sensible_coercions(tmp_path):
    text = "target_params: 1e6\nweight_decay: 0\nepochs: 2.0\ndataset_config: 2020\nmax_steps: null\n"
    values, _ = load_config_file(_write(tmp_path, "c.yaml", text), Config)
    assert values == {"target_params": 1_000_000, "weight_decay": 0.0, "epochs": 2, "dataset_config": "2020",
                      "max_steps": None}
    assert type(values["weight_decay"]) is float and type(values["target_params"]) is int


@pytest.mark.parametrize("name, text, match", [
    ("c.yaml", "batch_size: 8\nseq_len: [64\n", r"YAML syntax error at line 3"),
    ("c.yaml", "a: 1\n  b: 2\n", r"YAML syntax error at line 2"),
    ("c.json", '{\n  "batch_size": 8,\n  "seq_len": 64,\n}\n', r"JSON syntax error at line 4"),
    ("c.yaml", "- batch_size\n", "top level must be a mapping"),
    ("c.yaml", "batch_size: 8\nbatch_size: 16\n", "line 2.*given twice"),
    ("c.yaml", "batch_size: 8\nbatch-size: 16\n", "given twice"),
    ("c.json", '{"seed": 1, "seed": 2}', "'seed' is given twice"),
])
def test_file_errors_are_one_line(tmp_path, name, text, match):
    with pytest.raises(ConfigFileError, match=match) as e:
        load_config_file(_write(tmp_path, name, text), Config)
    assert "\n" not in str(e.value) and name in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigFileError, match="nope.yaml: cannot read it"):
        load_config_file(str(tmp_path / "nope.yaml"), Config)


def _resolved_config(**changes) -> dict:
    """A dict shaped like the trainer's config.json (slm.train.run.write_config)."""
    c = Config(dataset_id="data.txt", use_streaming=True, batch_size=8, gradient_accumulation_steps=4,
               learning_rate=1.2e-3, vocab_size=1024, stride=64, seq_len=64, warmup_steps=12, max_time=120.0,
               memory_budget="4GB", preset="limited-ram", output_dir="runs/x", **changes)
    return {**dataclasses.asdict(c), "dataset": "data.txt", "eval_dataset": "data.txt (held-out head)",
            "model": {"n_layers": 4, "d_model": 128}, "params": 1_000_000, "model_flops_per_token": 6e6,
            "optimizer_state_bytes": 8_000_000, "memory_plan": {"estimated_peak_rss_mb": 100.0},
            "held_out_documents": 3, "device": "TFRT_CPU_0", "devices": 2, "jax_version": "0.4.30"}


def test_resolved_config_round_trip(tmp_path):
    resolved = _resolved_config()
    path = _write(tmp_path, "config.json", json.dumps(resolved, indent=2))
    values, notes = load_config_file(path, Config)
    assert not DERIVED_KEYS & set(values)
    expected = {f.name: resolved[f.name] for f in dataclasses.fields(Config) if f.name not in NOT_REPRODUCED}
    assert values == expected
    assert Config(**{**dataclasses.asdict(Config()), **values}) == dataclasses.replace(
        Config(**{k: resolved[k] for k in expected}), output_dir=None, preset=None)
    assert len(notes) == 1 and "--output-dir, --preset" in notes[0]
    # a run that used --tokenizer: vocab_size comes with the file (--tokenizer with --vocab-size is refused)
    path = _write(tmp_path, "config2.json", json.dumps(_resolved_config(tokenizer="runs/x/tokenizer.json")))
    values, _ = load_config_file(path, Config)
    assert values["tokenizer"] == "runs/x/tokenizer.json" and "vocab_size" not in values


def test_a_config_json_older_than_a_setting_repeats_the_run_as_it_ran(tmp_path):
    """A run saved before --dropout / --matmul-precision / ... existed: --config gives it what it used then
    (BEFORE_THE_SETTING, as a resume does), not today's defaults, and says which."""
    from slm.train.config import BEFORE_THE_SETTING

    old = {k: v for k, v in _resolved_config().items() if k not in BEFORE_THE_SETTING}
    values, notes = load_config_file(_write(tmp_path, "config.json", json.dumps(old)), Config)
    assert {k: values[k] for k in BEFORE_THE_SETTING} == BEFORE_THE_SETTING
    assert "dropout=0.0" in notes[0] and "dropout_from_epoch=0" in notes[0]
    values, notes = load_config_file(_write(tmp_path, "new.json", json.dumps(_resolved_config(dropout=0.1))), Config)
    assert values["dropout"] == 0.1 and "predates" not in notes[0]


def test_derived_keys_are_not_config_fields():
    assert not DERIVED_KEYS & {f.name for f in dataclasses.fields(Config)}


def test_cli_wiring_flag_beats_file_beats_default(tmp_path):
    path = _write(tmp_path, "c.yaml", "batch_size: 8\nseq-len: 256\nuse_streaming: true\n")
    values, explicit, notes = parse_flags(["--config", path, "--batch-size", "4"])
    config = Config(**values)  # no stray "config" key
    assert (config.batch_size, config.seq_len, config.use_streaming) == (4, 256, True)
    assert config.learning_rate is None and config.seed == 0  # untouched defaults
    assert explicit == {"batch_size", "seq_len", "use_streaming"} and notes == []
    # a boolean from the file can be turned off on the command line
    values, _, _ = parse_flags(["--config", path, "--no-use-streaming"])
    assert values["use_streaming"] is False
    # without --config: as before
    values, explicit, _ = parse_flags(["--seed", "3"])
    assert Config(**values) == Config(seed=3) and explicit == {"seed"}


def test_cli_wiring_repeats_a_resolved_run(tmp_path):
    resolved = _resolved_config()
    path = _write(tmp_path, "config.json", json.dumps(resolved))
    values, explicit, notes = parse_flags(["--config", path, "--max-time", "30"])
    config = Config(**values)
    assert config.max_time == 30.0 and config.output_dir is None and config.preset is None
    assert (config.learning_rate, config.stride, config.vocab_size, config.warmup_steps) == (1.2e-3, 64, 1024, 12)
    assert "batch_size" in explicit and "output_dir" not in explicit and notes


def test_no_flags_give_the_defaults_and_nothing_explicit():
    values, explicit, notes = parse_flags([])
    assert Config(**values) == Config() and explicit == set() and notes == []
