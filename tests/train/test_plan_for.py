"""--plan-for: every device program of a run compiled ahead of time for a GPU or TPU this machine does not have."""

import dataclasses
import json
import subprocess
import sys

import pytest
from helpers import ROOT

from slm.errors import ConfigError
from slm.train.config import Config
from slm.train.plan_for import plan_main

PROGRAMS = ["train step", "eval step", "sample prefill", "sample decode step", "checkpoint save"]


def tiny(tmp_path, target, **kw):
    return Config(use_streaming=True, plan_for=target, target_params=150_000, vocab_size=512, seq_len=64,
                  batch_size=8, output_dir=str(tmp_path), **kw)


def param_bytes(plan):  # float32 params of the shape the plan names: an independent lower bound of any program
    return plan["setting"]["params"] * 4 / 2**20


@pytest.mark.slow
@pytest.mark.parametrize("target", ["a10g-24gb", "v5e-4"])
def test_each_program_kind_compiles_for_the_target_and_plan_json_says_so(tmp_path, target):
    lines = []
    plan = plan_main(tiny(tmp_path, target, gradient_accumulation_steps=2), log=lines.append)
    assert json.loads((tmp_path / "plan.json").read_text()) == plan
    assert {"target", "setting", "programs"} <= plan.keys() and plan["target"] == target
    assert [p["program"] for p in plan["programs"]] == PROGRAMS
    for p in plan["programs"]:
        assert {"program", "planned_mb", "xla_peak_mb", "device_mb", "fits"} <= p.keys()
        assert p["fits"] is True and p["xla_peak_mb"] >= param_bytes(plan), p
        assert p["device_mb"] == plan["usable_mb"]
    train = plan["programs"][0]
    assert train["planned_mb"] > 0 and train["xla_peak_mb"] > plan["programs"][4]["xla_peak_mb"]  # state + activations
    if target.startswith("v5e"):  # like for like: no CUDA context's 600 MB in a TPU's plan (it was 605 MB for 10)
        assert train["xla_peak_mb"] / 3 < train["planned_mb"] < 3 * train["xla_peak_mb"], train
    assert any("train step" in line and "fits" in line for line in lines)
    host = plan["host_rss_mb"]  # the rented machine's RAM: a GPU host's (its allocator table is 1/32 of the pool)
    assert (host is None) == (target == "v5e-4") and any(line.startswith("[plan] host RAM") for line in lines)
    if host:
        assert host["peak"] >= host["allocator_table"] == pytest.approx(plan["usable_mb"] / 32, rel=1e-3)


@pytest.mark.slow
def test_the_gpu_program_is_the_gpus_own_not_the_cpus(tmp_path):
    """The same run compiled for the GPU and for this CPU: different compilers, different buffer assignments
    (a fallback to CPU figures would give equal ones)."""
    import jax

    from slm.train.builder import StepSpec, build, compile_step
    from slm.train.devices import data_mesh
    from slm.train.plan_for import plan_shape, resolved_for

    plan = plan_main(tiny(tmp_path, "h100-80gb"), log=lambda *_: None)
    c = resolved_for(tiny(tmp_path, "h100-80gb"), plan_shape(tiny(tmp_path, "h100-80gb")), "gpu")
    cpu_mb = compile_step(build(StepSpec.from_config(c, plan_shape(c)), data_mesh(8, max_devices=1)))[2]
    assert jax.devices()[0].platform == "cpu"
    assert plan["programs"][0]["xla_peak_mb"] != pytest.approx(cpu_mb, rel=1e-3)


@pytest.mark.slow
def test_a_target_too_small_refuses_naming_the_program_and_a_change_that_fits(tmp_path, monkeypatch):
    import slm.train.plan_for as plan_for

    measured, lines, measure = [], [], plan_for.measure
    monkeypatch.setattr(plan_for, "measure", lambda name, *a, **k: measured.append(name) or measure(name, *a, **k))
    # batch 256: at 128 the blocked attention brought the step to 15,087 MB, inside v5e's 16 GB (issue 42)
    c = Config(use_streaming=True, plan_for="v5e-1", target_params=2_000_000, vocab_size=2048, seq_len=1024,
               batch_size=256, output_dir=str(tmp_path))
    with pytest.raises(ConfigError) as e:
        plan_main(c, log=lines.append)
    # each program compiled once for the plan, and the search compiles each candidate's train step once: the
    # one that fits is not compiled again beside its other programs
    failed = sum("does not fit once compiled" in line for line in lines)
    assert measured.count("train step") == 2 + failed and measured.count("eval step") == 2, (measured, lines)
    msg = str(e.value)
    assert "\n" not in msg and "train step" in msg and "this fits once compiled:" in msg, msg
    fix = msg.split("this fits once compiled: ")[1].split(" (or")[0].split()
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["programs"][0]["fits"] is False and plan["programs"][0]["xla_peak_mb"] > 16 * 1024  # > v5e's HBM
    # the suggestion is a command that works: the same plan with its flags added (a later flag wins) fits
    argv = ["--use-streaming", "--plan-for", "v5e-1", "--target-params", "2000000", "--vocab-size", "2048",
            "--seq-len", "1024", "--batch-size", "256", "--output-dir", str(tmp_path / "fixed"), *fix]
    run = subprocess.run([sys.executable, str(ROOT / "train_optimized.py"), *argv], capture_output=True, text=True,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr


def test_without_the_compiler_it_says_which_pip_command_adds_it(monkeypatch, tmp_path):
    import slm.train.aot as aot

    monkeypatch.setattr(aot, "plugin_installed", lambda platform: False)
    for target, extra in (("a10g-24gb", "plan-gpu"), ("v5e-8", "plan-tpu")):
        with pytest.raises(ConfigError) as e:
            plan_main(tiny(tmp_path, target), log=lambda *_: None)
        assert "pip install" in str(e.value) and extra in str(e.value) and "\n" not in str(e.value)


def test_a_cpu_run_with_the_compilers_installed_prints_nothing_new(tmp_path):
    """jax's CUDA plugin writes "Could not find cuda drivers" natively at import, and libtpu warns at backend
    start, on a machine with neither: the trainer's entry points hold both back."""
    code = ("from slm.train.devices import import_jax_quietly, start_backend\n"
            "import_jax_quietly(); start_backend()\n"
            "import jax, jax.numpy as jnp\n"
            "print(jax.devices()[0].platform, float(jax.jit(lambda x: x * 2)(jnp.ones(())))) \n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "JAX_PLATFORMS"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert run.returncode == 0 and run.stdout.split() == ["cpu", "2.0"], run.stderr
    assert run.stderr == ""


def test_a_gpu_plan_after_the_notebook_started_jax_its_own_way(tmp_path):
    """A notebook that ran `jax.devices()` first, with no JAX_PLATFORMS, on a machine without CUDA: jax's CUDA
    plugin failed its runtime check then and was never registered, and the plan said "topology not implemented
    for cuda". It compiles for the GPU all the same."""
    code = ("import jax\n"
            "jax.devices()\n"
            "from slm.train.plan_for import plan_for\n"
            f"p = plan_for('h100-80gb', log=lambda *_: None, train_only=True, target_params=150_000, vocab_size=512, "
            f"seq_len=64, batch_size=8, output_dir={str(tmp_path)!r})\n"
            "print(p['device'], p['programs'][0]['program'], p['programs'][0]['fits'])\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "JAX_PLATFORMS"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[-1] == "NVIDIA H100 80GB HBM3 train step True"


@pytest.mark.slow
def test_a_head_wider_than_cudnn_takes_takes_the_einsum_attention_on_a_gpu(tmp_path):
    """Gemma 3's heads are 256 wide; jax's cuDNN attention takes at most 128, and refused the model on a GPU
    (NotImplementedError at the first step) until --plan-for compiled one. Now it plans, and fits."""
    import jax.numpy as jnp

    from slm.model.transformer import fused_attention_fits

    assert fused_attention_fits(jnp.bfloat16, "gpu", 128) and not fused_attention_fits(jnp.bfloat16, "gpu", 256)
    config = json.loads((ROOT.parent / "shared" / "models" / "gemma-3-1b" / "config.json").read_text())
    config.update(num_hidden_layers=6, vocab_size=1024)  # Gemma 3 1B's heads (256 wide); layer 6 is global
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps(config))
    plan = plan_main(Config(use_streaming=True, plan_for="a10g-24gb", init_from=str(tmp_path / "gemma"), seq_len=128,
                            batch_size=2, use_mixed_precision=True, output_dir=str(tmp_path / "plan")),
                     log=lambda *_: None)
    assert all(p["fits"] for p in plan["programs"]), plan["programs"]


def compiled_peak_for(spec, target: str, devices: int = 1) -> float:
    """XLA's peak (bytes a device) of `spec`'s train step compiled for the first `devices` of a compile-only
    `target`: the independent reference the arithmetic is held to."""
    import numpy as np
    from jax.sharding import Mesh

    from slm.memory.targets import load_target
    from slm.train.aot import compile_only, target_devices
    from slm.train.builder import build, compile_step, compiled_peak

    with compile_only():
        mesh = Mesh(np.array(target_devices(load_target(target))[:devices]), ("data",))
        return compiled_peak(compile_step(build(spec, mesh))[0])


def device_part(est: dict) -> int:
    """The arithmetic's device figure less its CUDA runtime term (GPU only), which no XLA buffer holds."""
    return est["total"] - est.get("runtime", 0)


@pytest.mark.slow
@pytest.mark.parametrize("mixed", [True, False])
def test_the_arithmetic_for_a_tpu_is_within_10_percent_of_xlas_compile(mixed):
    """A from-scratch step's device figure for a TPU (slm.memory.estimate's "tpu" terms) against libtpu's own
    buffer assignment for a compile-only v5e chip, at a shape and token count the terms were not fitted on (5
    layers of 768, 12 heads of 64, vocab 6,144, seq 1,024 x 4, bf16 or float32 compute, AdamW). On XLA:CPU's
    terms, which a TPU was planned on before, the arithmetic was about twice XLA's figure (bf16; float32 until
    2026-11-29: +92.5%; +2.6% on its own terms)."""
    from slm.memory.estimate import device_breakdown
    from slm.model.sizing import ModelShape
    from slm.train.builder import StepSpec

    shape = ModelShape(vocab_size=6144, n_layers=5, d_model=768, n_heads=12, d_ff=2048)
    xla = compiled_peak_for(StepSpec(shape, 1024, 4, 1, mixed, False, optimizer="adamw", platform="tpu"), "v5e-1")
    est = device_breakdown(shape, 1024, 4, mixed_precision=mixed, optimizer="adamw", platform="tpu")
    assert device_part(est) == pytest.approx(xla, rel=0.1)


@pytest.mark.slow
def test_a_data_parallel_muon_step_over_eight_tpu_chips_is_planned_within_10_percent():
    """Muon's update over a v5e-8, data parallel, where it is the step's peak (2 x 512 tokens a chip): libtpu
    holds the hidden matrices whole on every chip several times over (TPU_DP_MUON_UPDATE); the terms that
    shared the work out by the chips planned it ~40% under. A width and depth the term was not fitted on."""
    from slm.memory.estimate import device_breakdown
    from slm.model.sizing import ModelShape
    from slm.train.builder import StepSpec

    shape = ModelShape(vocab_size=4096, n_layers=4, d_model=768, n_heads=12, d_ff=2048)
    xla = compiled_peak_for(StepSpec(shape, 512, 16, 1, True, False, optimizer="muon", platform="tpu"), "v5e-8", 8)
    est = device_breakdown(shape, 512, 2, devices=8, mixed_precision=True, optimizer="muon", platform="tpu")
    assert device_part(est) == pytest.approx(xla, rel=0.1)


def held_out_step(target: str, remat: bool, mixed: bool, base: str, devices: int = 1,
                  model: str = "llama-3.2-1b", fsdp: bool = True, **changes: int) -> tuple[float, float]:
    """(the arithmetic's device figure less its runtime term, the target compiler's peak) of a LoRA step at a
    shape no accelerator term was fitted on: `model`'s at 3 layers (and `changes`), seq 768 x 1 a device, r8 on
    q,k,v,o; devices > 1: the base split over them (FSDP), or with `fsdp` False whole on each (data parallel);
    base "full": a full fine-tune (every weight trained)."""
    fsdp = fsdp and devices > 1
    import dataclasses

    from slm.memory.estimate import device_breakdown
    from slm.memory.finetune import Finetune, model_shape
    from slm.memory.targets import load_target
    from slm.model.lora import LoraSpec
    from slm.train.builder import StepSpec

    targets, platform = ("q_proj", "k_proj", "v_proj", "o_proj"), load_target(target).platform
    shape = dataclasses.replace(model_shape(ROOT.parent / "shared" / "models" / model), n_layers=3, **changes)
    spec = StepSpec(shape, 768, devices, 1, mixed, remat, sharding="fsdp" if fsdp else "dp",
                    lora=None if base == "full" else LoraSpec(8, 16.0, 0.0, targets),
                    base_dtype="float32" if base == "full" else base, platform=platform)
    xla = compiled_peak_for(spec, target, devices)
    est = device_breakdown(shape, 768, 1, mixed_precision=mixed, gradient_checkpointing=remat,
                           finetune=None if base == "full" else Finetune(8, targets, base), platform=platform,
                           devices=devices, fsdp=fsdp)
    return device_part(est), xla


@pytest.mark.slow
@pytest.mark.parametrize("remat, mixed, base", [(False, False, "float32"), (False, True, "float32"),
                                                (False, True, "float16"), (True, False, "bfloat16"),
                                                (True, True, "nf4")])
def test_the_lora_arithmetic_for_a_gpu_is_within_10_percent_of_xlas_compile(remat, mixed, base):
    """The LoRA step's device figure for a GPU (slm.memory.finetune's accelerator terms) against XLA:GPU's own
    buffer assignment for a compile-only H100, at the held-out shape (held_out_step). Before the GPU's own LoRA
    terms the arithmetic was 1.2-2.5x XLA's figure here."""
    est, xla = held_out_step("h100-80gb", remat, mixed, base)
    assert est == pytest.approx(xla, rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("remat, mixed, base", [(True, True, "float32"), (True, True, "nf4"),
                                                (False, False, "float32")])
def test_the_lora_arithmetic_for_a_tpu_is_within_10_percent_of_xlas_compile(remat, mixed, base):
    """The same held-out LoRA step with remat under mixed precision, and without either (the flags' default),
    against libtpu's compile for a v5e chip: slm.memory.finetune's TPU terms were fitted on other shapes
    (SmolLM2-135M, Qwen2.5-0.5B, Mistral-7B). On XLA:CPU's terms, which a TPU's LoRA was planned on before, the
    fitted shapes were -46% .. +159% off with remat under mixed precision (2026-11-28, libtpu's HBM figure: +0.7%
    float32, -7.0% nf4 here), -53% .. +167% without either (2026-11-29: +3.8% here; the full 16 layers +12.7%)."""
    est, xla = held_out_step("v5e-1", remat, mixed, base)
    assert est == pytest.approx(xla, rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("remat, mixed", [(True, True), (False, False)])
def test_a_qlora_step_on_each_of_several_tpu_chips_is_planned_within_10_percent_of_xlas_compile(remat, mixed):
    """An nf4 base whole on each of 4 v5e chips (data parallel), remat under mixed precision and the flags' default
    (neither), at the held-out shape: libtpu fuses the dequantisation into the matmuls there, where one chip holds
    ~3-4 kernels of it lane-padded (slm.memory.finetune.TPU_DP_NF4_KERNELS). On the one chip's terms the arithmetic
    was +14.2% / +31.8% here (2026-12-06). In float32 each chip held every layer's broadcast nf4 scales from the
    forward to the backward until they depended on the layer's input (slm.model.nf4.dequantize_halves): libtpu's
    figure here 1,346 MB then, 1,092 now."""
    est, xla = held_out_step("v5e-8", remat, mixed, "nf4", devices=4, fsdp=False)
    assert est == pytest.approx(xla, rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("base", ["bfloat16", "nf4"])
def test_the_lora_arithmetic_for_a_base_split_over_tpu_chips_is_within_15_percent_of_xlas_compile(base):
    """A LoRA base split over a v5e-8's chips (FSDP), remat under mixed precision: Qwen3-0.6B's shape, which
    slm.memory.finetune's TPU_FSDP_LORA was not fitted on, against libtpu's compile. Before those terms the
    arithmetic counted one block gathered (XLA:CPU's way); libtpu also holds every block's shard again, a tied
    embedding gathered and activations gathered over the chips (2026-11-28: see docs/memory.md)."""
    est, xla = held_out_step("v5e-8", True, True, base, devices=8, model="qwen3-0.6b")
    assert est == pytest.approx(xla, rel=0.15)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [8, 4, 1])
def test_a_full_fine_tune_on_tpu_chips_is_planned_within_15_percent_of_xlas_compile(devices):
    """Every weight trained, split over a v5e-8's chips (FSDP) or on one, remat under mixed precision: Qwen3-0.6B's
    shape, which slm.memory.finetune's TPU_FSDP_FULL and TPU_FULL_UPDATE were not fitted on, against libtpu's
    compile. On XLA:CPU's terms (over the chips the whole model gathered and whole gradients; on one an update
    of 4N) the arithmetic was 2-4x libtpu's figure over the chips and 6-16% under it on one (2026-11-28: see
    docs/memory.md)."""
    est, xla = held_out_step("v5e-8", True, True, "full", devices=devices, model="qwen3-0.6b")
    assert est == pytest.approx(xla, rel=0.15)


@pytest.mark.slow
def test_a_full_fine_tune_whose_width_is_not_whole_tpu_lanes_is_planned_within_10_percent_of_xlas_compile():
    """Qwen3-0.6B's shape narrowed to 960 wide (7.5 x 128 lanes, as SmolLM2's 576 is 4.5) on one v5e chip: libtpu
    holds about two more float32 copies of the blocks and of the embedding at the update. On the whole-lane terms
    alone the arithmetic was ~30% under its figure (2026-11-28: see docs/memory.md)."""
    est, xla = held_out_step("v5e-8", True, True, "full", model="qwen3-0.6b", d_model=960)
    assert est == pytest.approx(xla, rel=0.10)


@pytest.mark.slow
@pytest.mark.parametrize("model, layers, accumulation", [("gemma-3-1b", 4, 1), ("smollm2-135m", 30, 2)])
def test_a_full_fine_tune_on_a_gpu_is_planned_within_6_percent_of_xlas_compile(model, layers, accumulation):
    """Every weight trained on one GPU (remat, bf16 compute, AdamW with float32 moments, 512 tokens a micro-step)
    at shapes GPU_MIXED_GRADIENTS was not fitted on: XLA:GPU keeps the blocks' gradients bf16 (accumulating, adds
    them into the float32 sum as they come). With float32 gradients the arithmetic read these -13.4% and +15.9%
    (2026-12-05: see docs/memory.md)."""
    from slm.memory.estimate import device_breakdown
    from slm.memory.finetune import model_shape
    from slm.train.builder import StepSpec

    shape = dataclasses.replace(model_shape(ROOT.parent / "shared" / "models" / model), n_layers=layers)
    xla = compiled_peak_for(StepSpec(shape, 512, accumulation, accumulation, True, True, optimizer="adamw",
                                     platform="gpu"), "h100-80gb")
    est = device_breakdown(shape, 512, 1, mixed_precision=True, gradient_checkpointing=True, optimizer="adamw",
                           platform="gpu", gradient_accumulation_steps=accumulation)
    assert device_part(est) == pytest.approx(xla, rel=0.06)


def test_the_search_skips_only_an_8bit_twin_of_a_setting_too_far_over_to_be_saved_by_its_state():
    """--auto-fit's search compiles Mistral-7B's A10G step 70-150 s a candidate. A failed setting with 8-bit
    optimizer state added lowers XLA's peak by about the state it saves (seed 002's LoRA: 81 and 73 MB for the
    78 MB planned; up to 2.05x the saving elsewhere), so that twin is passed over only when the failed one was
    over by more than three times that."""
    from slm.train.plan_for import eight_bit_twin

    seed = Config(use_streaming=True, lora_rank=16, batch_size=4, gradient_accumulation_steps=4,
                  gradient_checkpointing=True)
    twin = dataclasses.replace(seed, use_8bit_optimizer=True)
    # candidate 3 of the seed's search: planned 15,551, XLA 16,215 against the 14,680 MB limit (1,535 over)
    assert "candidate 3" in eight_bit_twin(twin, 15_473, [(3, seed, 15_551, 16_215 - 14_680)])
    assert eight_bit_twin(twin, 15_473, [(3, seed, 15_551, 200)]) is None  # 2.05 x 78 MB = 160 MB: it could fit
    other = dataclasses.replace(twin, batch_size=2, gradient_accumulation_steps=8)  # another lever changed too
    assert eight_bit_twin(other, 15_069, [(3, seed, 15_551, 1_535)]) is None
    assert eight_bit_twin(seed, 15_551, [(4, twin, 15_473, 1_454)]) is None  # dropping 8-bit adds memory


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_8bit_state_lowers_a_gpu_step_and_is_planned_within_10_percent_of_xlas_compile(accumulation):
    """A full step with 8-bit Adam state on a GPU, a vocabulary as large as a pretrained model's (the largest leaf):
    XLA:GPU's compile holds less than the float32-state step (under optax.apply_if_finite's cond it held more:
    every leaf's update and new moments at once; accumulating, under LazyMultiSteps' cond: 1,020 MB), and the
    arithmetic's device figure (GPU_ADAM8_LARGEST_LEAF) is within 10% of it. 2026-11-30, jax 0.10.2: 510 vs 694 MB
    float32, plan 0.98x; 2 micro-batches 615 vs 772, plan 0.99x."""
    from slm.memory.estimate import device_breakdown
    from slm.model.sizing import ModelShape
    from slm.train.builder import StepSpec

    shape = ModelShape(vocab_size=32768, n_layers=8, d_model=512, n_heads=8, d_ff=1536)  # 38% of it the embedding
    xla = {e: compiled_peak_for(StepSpec(shape, 256, 1, accumulation, True, True, e, optimizer="adamw",
                                         platform="gpu"), "h100-80gb") for e in (False, True)}
    assert xla[True] < 0.85 * xla[False]
    est = device_breakdown(shape, 256, 1, mixed_precision=True, gradient_checkpointing=True, optimizer="adamw",
                           use_8bit_optimizer=True, platform="gpu", gradient_accumulation_steps=accumulation)
    assert device_part(est) == pytest.approx(xla[True], rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_8bit_state_lowers_a_tpu_step(accumulation):
    """A full step with 8-bit Adam state on a TPU, 90% of the model a pretrained-sized vocabulary's embedding:
    libtpu's compile holds less than the float32-state step. Updating each 8-bit leaf whole under the cond it
    held ~48 bytes an element (2026-12-03, v5e: 3,896 / 4,011 MB against 1,619 / 1,514 float32); in chunks
    under `where` 1,294 / 1,175 (0.80x / 0.78x)."""
    from slm.model.sizing import ModelShape
    from slm.train.builder import StepSpec

    shape = ModelShape(vocab_size=131072, n_layers=2, d_model=512, n_heads=8, d_ff=1536)
    xla = {e: compiled_peak_for(StepSpec(shape, 256, 1, accumulation, True, True, e, optimizer="adamw",
                                         platform="tpu"), "v5e-1") for e in (False, True)}
    assert xla[True] < 0.9 * xla[False]
