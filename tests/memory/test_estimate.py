"""Memory: the whole-run estimate, its accuracy against XLA, pre-flight refusal, auto-fit, presets, alert, STOP."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import ROOT

from slm.memory.estimate import (
    MB,
    MemoryEstimate,
    device_breakdown,
    estimate_memory_usage,
    host_breakdown,
    parse_size,
)
from slm.memory.fit import fit_candidates, relative_speed
from slm.memory.preflight import MemoryPlan
from slm.model.sizing import choose_shape, count_params, default_vocab_size
from slm.model.transformer import Transformer, init_params
from slm.optim.optimizer import make_optimizer
from slm.train.builder import compiled_memory
from slm.train.step import init_state, make_train_step


def test_seed_call_and_keys_unchanged():
    e = estimate_memory_usage(num_sequences=100000, seq_len=128, batch_size=32)
    assert e["full_load_mb"] == 97.656 and e["memory_savings"] == "88.38%" and "params_mb" not in e
    assert isinstance(e, dict)


@pytest.mark.parametrize("eight,acc", [(False, 1), (True, 4)])
def test_state_terms_are_the_bytes_of_the_state_jax_builds(eight, acc):
    """Parameters, gradients, optimizer state and the accumulator: the bytes of the pytrees flax and optax build
    for that model (eval_shape: nothing allocated), not the formula's own arithmetic re-done."""
    shape = choose_shape(1_000_000, default_vocab_size(1_000_000))  # the vocabulary the estimate assumes
    e = estimate_memory_usage(1000, 128, 32, target_params=1_000_000, optimizer="adamw", use_8bit_optimizer=eight,
                              gradient_accumulation_steps=acc)
    params = jax.eval_shape(lambda: init_params(Transformer(shape), 0, 128))
    opt = jax.eval_shape(make_optimizer(use_8bit=eight, accumulation=acc).init, params)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)) / MB  # noqa: E731
    assert e["params_mb"] == pytest.approx(nbytes(params), rel=1e-3)
    assert e["gradients_mb"] == pytest.approx(nbytes(params), rel=1e-3)  # one gradient per parameter
    assert e["optimizer_state_mb"] + e["accumulation_mb"] == pytest.approx(nbytes(opt), rel=0.01)


def test_the_estimate_scales_as_its_parts_do():
    """Per-token terms follow the tokens per device; replicas, platforms, remat and a full load move the peak
    the way they move memory."""
    e = estimate_memory_usage(1000, 128, 32, target_params=1_000_000)
    assert e["update_mb"] < e["activations_mb"]  # batch 32: the backward pass is the step's peak, not the update
    b2 = estimate_memory_usage(1000, 128, 64, target_params=1_000_000)
    assert abs(b2["activations_mb"] - 2 * e["activations_mb"]) < 0.01  # twice the batch, twice the memory
    d2 = estimate_memory_usage(1000, 128, 64, target_params=1_000_000, devices=2)
    d4 = estimate_memory_usage(1000, 128, 128, target_params=1_000_000, devices=2)
    assert abs(d4["activations_mb"] - 2 * d2["activations_mb"]) < 0.01  # per device: batch / devices
    assert d2["host_rss_mb"] > e["host_rss_mb"] + e["params_mb"]  # each host device holds a replica
    gpu = estimate_memory_usage(1000, 128, 32, target_params=1_000_000, platform="gpu")
    assert gpu["host_rss_mb"] < e["host_rss_mb"]  # device memory is not host RSS there
    assert estimate_memory_usage(1000, 128, 32, target_params=1_000_000, gradient_checkpointing=True)["activations_mb"] \
        < e["activations_mb"]
    full = estimate_memory_usage(10**6, 128, 32, target_params=1_000_000, streaming=False)
    assert full["data_pipeline_mb"] == full["full_load_mb"] > e["data_pipeline_mb"]


def test_estimate_prints_as_a_table_and_stays_a_dict():
    e = estimate_memory_usage(1000, 128, 32, target_params=1_000_000)
    assert isinstance(e, MemoryEstimate) and isinstance(e, dict)
    text = repr(e)
    assert "device_total_mb" in text and len(text.splitlines()) == len(e)
    assert e._repr_html_().startswith("<table>") and "host_rss_mb" in e._repr_html_()


def test_estimate_imports_no_jax():
    code = ("import sys; from slm.memory.estimate import estimate_memory_usage as e; "
            "e(1000, 128, 32, target_params=10_000_000); assert 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("target,batch,seq,remat,bf16,eight,acc", [
    (300_000, 16, 64, False, False, False, 1),
    (1_000_000, 32, 128, False, True, True, 2),
    (3_000_000, 8, 256, True, False, False, 1),
    (1_000_000, 1, 64, False, False, True, 2),  # micro-batch 1: the 8-bit update's temporaries are the peak
    (1_000_000, 1, 64, False, False, False, 2),  # and MultiSteps' float32 update
])
@pytest.mark.slow
def test_estimate_within_15_percent_of_xla_memory_analysis(target, batch, seq, remat, bf16, eight, acc):
    shape = choose_shape(target, 1024)
    model = Transformer(shape, dtype=jnp.bfloat16 if bf16 else jnp.float32, remat=remat)
    tx = make_optimizer(use_8bit=eight, accumulation=acc)
    state = jax.eval_shape(lambda: init_state(init_params(model, 0, seq), tx))
    spec = jax.eval_shape(lambda: {k: jnp.zeros((batch, seq), jnp.int32) for k in ("input_ids", "targets")})
    xla = compiled_memory(make_train_step(model, tx), state, spec, jnp.float32(1e-3))["peak"]
    est = device_breakdown(shape, seq, batch, mixed_precision=bf16, gradient_checkpointing=remat,
                           use_8bit_optimizer=eight, gradient_accumulation_steps=acc)["total"]
    assert abs(est / xla - 1) <= 0.15, (est / MB, xla / MB)


def test_step_peak_is_the_larger_phase_backward_or_update():
    """At micro-batch 1 the optimizer's update is the step's peak, at a large one the backward pass (XLA agrees
    on both kinds: test_estimate_within_15_percent_of_xla_memory_analysis); fsdp splits the update."""
    shape = choose_shape(50_000_000, 8192)
    small = device_breakdown(shape, 128, 1, use_8bit_optimizer=True, gradient_accumulation_steps=2)
    state = sum(small[k] for k in ("params", "gradients", "optimizer_state", "accumulation"))
    assert small["update"] > small["activations"] + small["logits"] and small["total"] == state + small["update"]
    big = device_breakdown(shape, 512, 8, use_8bit_optimizer=True, gradient_accumulation_steps=2)
    assert big["total"] == state + big["activations"] + big["logits"]
    dp = device_breakdown(shape, 128, 1, gradient_accumulation_steps=2, devices=4)
    fsdp = device_breakdown(shape, 128, 1, gradient_accumulation_steps=2, devices=4, fsdp=True)
    assert fsdp["update"] < dp["update"] / 2 and fsdp["gathered_params"] == 4 * count_params(shape)


def test_host_peak_counts_compile_leftovers_and_checkpoint_staging():
    shape = choose_shape(20_000_000, 4096)
    fp32 = device_breakdown(shape, 128, 4, gradient_accumulation_steps=2)
    eight = device_breakdown(shape, 128, 4, use_8bit_optimizer=True, gradient_accumulation_steps=2)
    h32 = host_breakdown(shape, fp32, 2, "cpu", 11.3)
    h8 = host_breakdown(shape, eight, 2, "cpu", 11.3, use_8bit_optimizer=True)
    assert h8["runtime"] > h32["runtime"]  # the 8-bit step compiles to a larger program (its leftovers)
    state32 = (fp32["params"] + fp32["optimizer_state"] + fp32["accumulation"]) / MB
    assert h32["checkpoint_staging"] > state32  # the save's copy of one replica, beside the next step
    gpu = host_breakdown(shape, fp32, 2, "gpu", 11.3)
    assert gpu["devices"] == 0 and gpu["checkpoint_staging"] == h32["checkpoint_staging"]  # staged in host RAM
    # The issue's run: 20M, seq 256, micro-batch 4 x 16, 8-bit, 2 devices peaked at 2,080 MB (2,054 earlier)
    # with no save mid-run; the old formula said 1,677. The whole-run estimate must be above it.
    issue = device_breakdown(shape, 256, 2, use_8bit_optimizer=True, gradient_accumulation_steps=16)
    assert host_breakdown(shape, issue, 2, "cpu", 11.7, use_8bit_optimizer=True)["total"] > 2080


def test_auto_fit_candidates_keep_the_effective_batch_fastest_first():
    shape = choose_shape(20_000_000, 4096)
    budget = 4 * 2**30
    found = fit_candidates(shape, 256, 64, 1, budget, max_devices=2, platform="cpu", data_mb=11.7, optimizer="muon")
    assert {c["devices"] for c in found} == {1, 2} and {c["checkpoint_sync"] for c in found} == {False, True}
    for c in found:  # whether they fit once run: tests/train/test_prepare.py measures the chosen one's peak
        assert c["batch_size"] * c["gradient_accumulation_steps"] == 64
    assert [c["rank"] for c in found] == sorted((c["rank"] for c in found), reverse=True)  # fastest first


def test_auto_fit_takes_the_fastest_fitting_lever_not_the_smallest_micro_batch():
    """More room: a larger micro-batch (faster per token); a save that waits is used only where the background
    save's copy is what does not fit; one device where two replicas do not fit."""
    shape = choose_shape(20_000_000, 4096)
    fit = lambda gb, **kw: fit_candidates(shape, 256, 64, 1, int(gb * 2**30), max_devices=2, platform="cpu",  # noqa
                                          data_mb=11.7, optimizer="muon", **kw)
    tight, roomy = fit(2)[0], fit(6)[0]
    assert roomy["batch_size"] > tight["batch_size"] >= 2
    assert roomy["speed"] > tight["speed"]
    assert not fit(6, checkpoint_sync="off")[0]["checkpoint_sync"] and fit(6, checkpoint_sync="on")[0]["checkpoint_sync"]
    short = fit(2, saves_beside_steps=False)  # a run that ends before its first save: no copy beside a step
    assert len(short) >= len(fit(2, checkpoint_sync="off"))
    assert all(c["devices"] == 1 for c in fit(2) if c["batch_size"] == 1)


# Held-out timings: the speed model was fitted at 20M and 50M params, seq 256 (2026-11-25); these were timed after
# it at 5M params, seq 128, effective batch 32 (bench/fit_speed.py --target-params 5000000 --seq-len 128
# --batch-size 32 --micro 1,4,16,32 --remat 0 --eight 0 --repeats 9; 2026-11-26 09:36, 2-core AMD EPYC Zen 3).
# (micro-batch, host devices): tokens/s.
HELD_OUT_5M_SEQ128 = {(1, 1): 1147, (4, 1): 1888, (4, 2): 2148, (16, 1): 1708, (16, 2): 2183, (32, 1): 1695,
                      (32, 2): 1870}


def test_relative_speed_picks_the_fastest_of_held_out_timings():
    """What --auto-fit takes from the model is its first choice: on timings it was not fitted to, that choice
    is the measured fastest (within 5%), and micro-batch 1 (the fixed costs' worst case) is last in both.
    Not asserted, because it does not hold: the full order (4 sequences on two devices measured 1.14x one
    device at 256 tokens a device, where the model expects a gain only from 1,024)."""
    def predicted(key):
        return relative_speed(128, key[0] // key[1], key[1], params=5_000_000)

    best = max(HELD_OUT_5M_SEQ128.values())
    assert HELD_OUT_5M_SEQ128[max(HELD_OUT_5M_SEQ128, key=predicted)] >= 0.95 * best
    assert min(HELD_OUT_5M_SEQ128, key=predicted) == min(HELD_OUT_5M_SEQ128, key=HELD_OUT_5M_SEQ128.get) == (1, 1)


def _plan(base_rss_mb=None, platform="cpu", **kw):
    est = estimate_memory_usage(0, 128, 32, target_params=1_000_000, devices=2, gradient_accumulation_steps=2)
    if base_rss_mb is not None:
        kw["base_rss_mb"] = base_rss_mb
    return MemoryPlan(est, 170.0, 2.0, platform, 2, 2, 11.3, 20_000.0, None, **kw)


def test_preflight_peak_is_deterministic_whatever_rss_reads():
    """The runtime term is the formula's: RSS after the compile moves by 100+ MB between runs and must not move
    the decision; only a base far above it (a notebook kernel holding data of its own) replaces it."""
    plan = _plan(base_rss_mb=450.0)
    staging = plan.estimate["checkpoint_staging_mb"]
    runtime = plan.estimate["framework_mb"]
    assert plan.runtime_mb == runtime
    assert plan.estimated_peak_rss_mb == pytest.approx(runtime + 11.3 + 2 * 170 + plan.slack_mb + staging)
    assert plan.predicted_peak_mb == plan.estimated_peak_rss_mb and plan.refusal is None
    assert _plan(base_rss_mb=300.0).estimated_peak_rss_mb == plan.estimated_peak_rss_mb
    rec = plan.record()
    assert rec["base_rss_mb"] == 450.0 and rec["formula_peak_rss_mb"] == round(plan.estimate["host_rss_mb"], 1)
    assert f"(runtime {runtime:,.0f} (measured now 450) + data 11.3 + devices 340" in plan.describe()[1]
    kernel = _plan(base_rss_mb=5_000.0)
    assert kernel.runtime_mb == 5_000.0
    assert _plan().base_rss_mb > 10  # measured by default: this process's RSS when the plan is made
    gpu = _plan(base_rss_mb=450.0, platform="gpu")
    assert gpu.estimated_peak_rss_mb == pytest.approx(runtime + 11.3 + plan.slack_mb + staging)
    assert gpu.predicted_peak_mb == 170.0


def test_the_weights_load_is_the_peak_only_where_it_is_higher_and_a_refusal_then_says_so():
    """--init-from: a read whose transient stays under the steps' leaves the prediction as it was; a larger one
    becomes the peak (on CPU beside the weights placed by then, on a GPU without them), and a budget between
    the two refuses naming the load, with a fix that reads less instead of the steps' levers."""
    plain = _plan(base_rss_mb=450.0)
    assert _plan(base_rss_mb=450.0, load_mb=1.0).estimated_peak_rss_mb == plain.estimated_peak_rss_mb
    big = _plan(base_rss_mb=450.0, load_mb=5_000.0, load_layer_mb=1.0)
    assert big.stepping_rss_mb == plain.estimated_peak_rss_mb < big.estimated_peak_rss_mb == big.loading_rss_mb
    gpu = _plan(base_rss_mb=450.0, platform="gpu", load_mb=5_000.0, load_layer_mb=1.0)
    assert gpu.loading_rss_mb < big.loading_rss_mb  # nothing placed on the host
    assert f"{big.loading_rss_mb:,.0f} MB while the weights load" in big.describe()[1]
    big.budget_mb = (big.stepping_rss_mb + big.loading_rss_mb) / 2
    assert "while its weights load" in big.refusal and "the weights' read is the peak" in big.refusal
    assert "--use-8bit-optimizer" not in big.refusal
    assert big.record()["loading_rss_mb"] == round(big.loading_rss_mb, 1)


def test_a_save_that_waits_is_chosen_only_when_the_copy_does_not_fit():
    plan = _plan(base_rss_mb=450.0, staging_alone_mb=0.0)
    full = plan.estimated_peak_rss_mb
    plan.budget_mb = full + 1
    plan.settle_sync("auto")
    assert not plan.checkpoint_sync and plan.refusal is None
    plan.budget_mb = full - plan.estimate["checkpoint_staging_mb"] / 2
    plan.settle_sync("auto")
    assert plan.checkpoint_sync and plan.refusal is None and plan.staging_mb == 0.0
    plan.settle_sync("off")
    assert not plan.checkpoint_sync and plan.refusal is not None
    assert plan.refusal.startswith(plan.shortfall + "; ") and "--auto-fit" not in plan.shortfall  # the fix apart
    short = _plan(base_rss_mb=450.0, staging_alone_mb=0.0, saves_beside_steps=False)
    assert short.staging_mb == 0.0 and short.estimated_peak_rss_mb < full


def test_estimate_memory_usage():
    est = estimate_memory_usage(num_sequences=100000, seq_len=128, batch_size=32)
    assert {"full_load_mb", "streaming_mb", "memory_savings"} <= set(est)
    assert est["full_load_mb"] == round(100000 * 128 * 2 * 4 / 2**20, 3) == 97.656
    assert est["streaming_mb"] < est["full_load_mb"]
    assert est["memory_savings"].endswith("%")
    assert float(est["memory_savings"][:-1]) == pytest.approx(100 * (1 - est["streaming_mb"] / est["full_load_mb"]),
                                                               abs=0.01)
    big = estimate_memory_usage(num_sequences=1_000_000, seq_len=128, batch_size=32)
    assert big["full_load_mb"] == round(1_000_000 * 128 * 8 / 2**20, 3)
    assert big["full_load_mb"] == pytest.approx(10 * est["full_load_mb"], abs=0.01)  # linear in num_sequences
    assert big["streaming_mb"] == est["streaming_mb"]
    assert float(big["memory_savings"][:-1]) > float(est["memory_savings"][:-1])
    no_buffer = estimate_memory_usage(100000, 128, 32, shuffle_buffer_size=0)
    assert no_buffer["streaming_mb"] < est["streaming_mb"]


@pytest.mark.parametrize("text,expected", [
    ("8GB", 8 * 2**30), ("8gib", 8 * 2**30), ("1.5G", int(1.5 * 2**30)), ("512MB", 512 * MB),
    ("800MiB", 800 * MB), ("2048", 2048 * MB), (" 2 gb ", 2 * 2**30), ("64k", 64 * 1024),
    ("1TB", 2**40), ("100B", 100), (".5g", 2**29), ("0.25m", MB // 4),
])
def test_parse_size_good(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["8XB", "", "GB", "-1GB", "0", "1.2.3G", "8 G B", "nan", "inf", "1e3MB", "8GBs"])
def test_parse_size_bad(text):
    with pytest.raises(ValueError) as e:
        parse_size(text)
    assert str(e.value) == f"--memory-budget {text!r}: use a size like 8GB or 512MB"


def test_parse_size_flag_in_message():
    with pytest.raises(ValueError, match=r"^--budget '8XB': use a size like 8GB or 512MB$"):
        parse_size("8XB", flag="--budget")
