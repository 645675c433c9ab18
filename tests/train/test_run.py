"""slm.train.run.train end to end: the stop conditions that end a real run, and what it leaves behind."""

import json
import math

import pytest


def test_max_time_stops_then_evaluates_and_saves(tmp_path, data_dir, monkeypatch):
    """A wall-clock budget: training stops once it is spent, then evaluates, checkpoints and summarises."""
    import time

    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "timed"
    summary = train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True,
                           target_params=150_000, seq_len=64, batch_size=8, eval_tokens=2048, max_time=1.0,
                           log_every=1, output_dir=str(out)), start_time=time.time(), log=lambda *_: None)
    assert summary["stop_reason"] == "--max-time 1s"
    assert summary["steps"] >= 1 and summary["steps"] < 10_000  # repeated the data until the budget, not 1 epoch
    assert summary["eval_loss"] > 0 and (out / "summary.json").exists()
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()] == [str(summary["steps"])]


@pytest.mark.slow
@pytest.mark.parametrize("use_8bit", [False, True])
def test_nonfinite_step_stops_the_run_naming_it_and_saves_nothing_after(tmp_path, data_dir, monkeypatch, use_8bit):
    """A learning rate of 1e30 overflows on the first update: the next step's gradient is non-finite."""
    import time

    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "nan"
    summary = train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True,
                           target_params=150_000, seq_len=64, batch_size=8, eval_tokens=2048, max_steps=20,
                           learning_rate=1e30, warmup_steps=0, log_every=4, checkpoint_every=4,
                           use_8bit_optimizer=use_8bit, output_dir=str(out)),
                    start_time=time.time(), log=lambda *_: None)
    assert summary["stop_reason"].startswith("non-finite loss or gradient at step 2 ")
    assert summary["steps"] == 4
    assert not any(p.name.isdigit() for p in (out / "checkpoints").iterdir())  # nothing saved after step 1
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert all(math.isfinite(r["eval_loss"]) for r in rows if "eval_loss" in r)  # skipped steps left params finite


@pytest.mark.slow
def test_skip_nonfinite_allows_n_bad_steps_then_stops(tmp_path, data_dir, monkeypatch):
    import time

    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    logs = []
    summary = train(Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True,
                           target_params=150_000, seq_len=64, batch_size=8, eval_tokens=2048, max_steps=20,
                           learning_rate=1e30, warmup_steps=0, log_every=1, skip_nonfinite=3,
                           output_dir=str(tmp_path / "skip")), start_time=time.time(), log=logs.append)
    # Step 1's update overflows the params; steps 2, 3, 4 are skipped (logged), step 5 stops the run.
    assert summary["skipped_nonfinite"] == 3 and summary["steps"] == 5
    assert summary["stop_reason"].startswith("non-finite loss or gradient at step 5 ")
    assert sum("skipped (" in line for line in logs) == 3


@pytest.mark.slow
def test_an_epochs_bounded_run_applies_its_trailing_partial_accumulation_and_saves(tmp_path, data_dir, monkeypatch):
    """One epoch of a small file with accumulation 3: the data ends 1 micro-batch into a step, which is
    applied (one more optimizer step, its tokens counted) and checkpointed like any other (issue 14)."""
    import time

    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = tmp_path / "small.txt"
    text.write_text((data_dir / "tinyshakespeare_train.txt").read_text()[:60_000])
    out = tmp_path / "run"
    summary = train(Config(dataset_id=str(text), use_streaming=True, target_params=100_000, seq_len=32, batch_size=4,
                           gradient_accumulation_steps=3, vocab_size=300, eval_tokens=512, output_dir=str(out)),
                    start_time=time.time(), log=lambda *_: None)
    assert summary["stop_reason"] == "epochs done"
    micro = summary["tokens"] // (4 * 32)
    assert micro % 3 == 1  # pinned for this data: the last step is a partial one (1 of 3)
    assert summary["steps"] == micro // 3 + 1
    saved = [p.name for p in (out / "checkpoints").iterdir()]
    assert str(summary["steps"]) in saved and not [n for n in saved if "tmp" in n]
    meta = json.loads((out / "checkpoints" / str(summary["steps"]) / "meta" / "metadata").read_text())
    assert (meta["step"], meta["micro_step"]) == (summary["steps"], micro)


@pytest.mark.slow
def test_bf16_matmuls_train_as_float32_does_and_a_run_may_switch_on_resume(tmp_path, data_dir, monkeypatch):
    """--matmul-precision bfloat16 (slm/model/matmul.py) through the trainer's sharded step: the same losses
    as float32 to bf16 rounding, recorded in config.json, and adjustable when a run is resumed."""
    import time

    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    common = dict(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                  seq_len=64, batch_size=8, eval_tokens=2048, log_every=1, checkpoint_every=6)
    runs = {}
    for precision in ("float32", "bfloat16"):
        logs = []
        out = tmp_path / precision
        runs[precision] = train(Config(**common, max_steps=6, matmul_precision=precision, output_dir=str(out)),
                                start_time=time.time(), log=logs.append)
        assert json.load(open(out / "config.json"))["matmul_precision"] == precision
        assert any(f"2048^3 {precision} matmul" in str(line) for line in logs)  # MFU's peak in the run's dtype
    assert abs(runs["bfloat16"]["eval_loss"] - runs["float32"]["eval_loss"]) < 0.01
    resumed = train(Config(**common, max_steps=8, matmul_precision="bfloat16", resume="latest",
                           output_dir=str(tmp_path / "float32")), start_time=time.time(), log=lambda *_: None)
    assert resumed["steps"] == 8
    assert json.load(open(tmp_path / "float32" / "config.json"))["matmul_precision"] == "bfloat16"


@pytest.mark.slow
def test_dropout_from_epoch_1_leaves_the_first_pass_alone_and_drops_out_once_the_data_repeats(tmp_path, data_dir,
                                                                                               monkeypatch):
    """The default, dropout 0.1 from epoch 1 (written to config.json): epoch 0's losses are those of the run
    with --dropout 0, bit for bit (its step has no masks); from the first step of epoch 1 the step with
    dropout (compiled then, and said so in the log) trains, so every later loss differs."""
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    common = dict(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=100_000,
                  seq_len=32, batch_size=8, max_examples=40, shuffle_buffer_size=20, eval_tokens=512, log_every=1,
                  eval_every=10**6, checkpoint_every=10**6, epochs=2, seed=1)
    rows, logs = {}, {}
    for name, kw in {"plain": dict(dropout=0.0), "later": {}}.items():
        logs[name] = []
        train(Config(**common, **kw, output_dir=str(tmp_path / name)), log=logs[name].append)
        rows[name] = [r for r in map(json.loads, open(tmp_path / name / "metrics.jsonl")) if "loss" in r]
    plain, later = rows["plain"], rows["later"]
    assert [r["step"] for r in plain] == [r["step"] for r in later] and {r["epoch"] for r in later} == {0, 1}
    first = [(r["loss"], q["loss"]) for r, q in zip(plain, later) if r["epoch"] == 0]
    second = [(r["loss"], q["loss"]) for r, q in zip(plain, later) if r["epoch"] == 1]
    assert len(first) >= 3 and all(a == b for a, b in first)
    assert len(second) >= 3 and all(a != b for a, b in second)
    switched = [str(line) for line in logs["later"] if "[dropout]" in str(line)]
    assert len(switched) == 1 and "epoch 1 begins: dropout 0.1" in switched[0]
    assert not any("[dropout]" in str(x) for x in logs["plain"])
    saved = json.load(open(tmp_path / "later" / "config.json"))
    assert (saved["dropout"], saved["dropout_from_epoch"]) == (0.1, 1)
