"""Fine-tuning memory plans from a config.json alone: seed 002's Mistral-7B LoRA on a 24 GB GPU, and the planner."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from helpers import ROOT

from slm.errors import ConfigError
from slm.memory.estimate import MB, estimate_memory_usage, fit_candidates, fit_to_budget
from slm.memory.finetune import GPU_RUNTIME_MB, Finetune, model_shape
from slm.model.hf_config import shape_from_hf_config
from slm.model.sizing import count_params

MISTRAL = ROOT.parent / "shared" / "models" / "mistral-7b-v0.1" / "config.json"
SMOLLM2 = ROOT.parent / "shared" / "models" / "smollm2-135m" / "config.json"
GPU_24GB = 24 * 1024  # MB
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Seed 002's settings (../shared/seeds/002_*): "FP16 precision" is mixed precision here (bf16 compute).
FINAL = {"lora_rank": 16, "lora_targets": ["q_proj", "v_proj"], "base_dtype": "float16", "gradient_checkpointing": True,
         "gradient_accumulation_steps": 16, "mixed_precision": True, "platform": "gpu"}
FIRST = {**FINAL, "lora_targets": QKVO, "gradient_checkpointing": False, "gradient_accumulation_steps": 8}


def test_seed_002_trainable_params_from_the_config_alone():
    for model in (str(MISTRAL), MISTRAL.parent, json.loads(MISTRAL.read_text())):
        e = estimate_memory_usage(0, 256, 1, model=model, **FINAL)
        assert e["trainable_params"] == 6_815_744 and e["model_params"] == 7_241_732_096
    assert abs(e["params_mb"] - 4 * 6_815_744 / MB) < 1e-3  # float32 adapters
    assert abs(e["base_params_mb"] - 2 * 7_241_732_096 / MB) < 1e-3  # the frozen float16 base
    assert abs(e["optimizer_state_mb"] - 8 * 6_815_744 / MB) < 0.01 and e["accumulation_mb"] > 0


def test_seed_002_final_settings_fit_24gb_and_first_settings_do_not():
    final = estimate_memory_usage(0, 256, 1, model=MISTRAL, **FINAL)
    assert final["device_total_mb"] < 0.9 * GPU_24GB  # fits with the 10% margin --auto-fit keeps
    assert final["runtime_mb"] == GPU_RUNTIME_MB and final["base_casts_mb"] < 1024  # remat: one layer's casts
    # XLA:GPU's own compile of the first settings for an A10G (docs/memory.md, "Seed 002, answered by XLA:GPU"):
    # 18,175 MB, and 17,647 with a bf16 base (no cast copies), both over the 17,271 MB jax gives a program there.
    first = estimate_memory_usage(0, 512, 2, model=MISTRAL, **FIRST)
    assert first["device_total_mb"] - GPU_RUNTIME_MB == pytest.approx(18_175, rel=0.1)
    bf16 = estimate_memory_usage(0, 512, 2, model=MISTRAL, **{**FIRST, "base_dtype": "bfloat16"})
    assert bf16["base_casts_mb"] == 0 and bf16["device_total_mb"] < first["device_total_mb"]
    assert bf16["device_total_mb"] - GPU_RUNTIME_MB == pytest.approx(17_647, rel=0.1)


def test_seed_002_final_settings_with_an_nf4_base_plan_under_7gb():
    """QLoRA (issue 33): the blocks' kernels at 4.5 bits a weight, the embedding and head bfloat16, the norms
    float32; the seed's final run then plans to under 7 GB, and the planner picks nf4 for an 8 GB card when
    allowed it."""
    shape = model_shape(MISTRAL)
    nf4 = estimate_memory_usage(0, 256, 1, model=MISTRAL, **{**FINAL, "base_dtype": "nf4"})
    kernels = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    want = kernels * (0.5 + 4 / 64) + 2 * 2 * 32000 * 4096 + 4 * (count_params(shape) - kernels - 2 * 32000 * 4096)
    assert nf4["base_params_mb"] == pytest.approx(want / MB, abs=1e-3)  # the breakdown is rounded to kB
    assert nf4["device_total_mb"] <= 7 * 1024 < estimate_memory_usage(0, 256, 1, model=MISTRAL, **FINAL)["device_total_mb"]
    plan = fit_to_budget("8GB", 256, 1, 16, model=MISTRAL, lora_rank=16, base_dtype="float16", platform="gpu",
                         allow_base_dtypes=["bfloat16", "nf4"])
    assert plan["base_dtype"] == "nf4" and plan["device_total_mb"] <= 0.9 * 8 * 1024


def test_planner_fits_the_first_settings_into_24gb_keeping_the_effective_batch():
    plan = fit_to_budget("24GB", 512, 2, 8, model=MISTRAL, **{k: v for k, v in FIRST.items()
                                                               if k not in ("gradient_accumulation_steps",)})
    assert plan["batch_size"] * plan["gradient_accumulation_steps"] == 16
    assert plan["base_dtype"] == "float16"  # kept: the user did not allow another
    assert plan["device_total_mb"] <= 0.9 * GPU_24GB and plan["predicted_peak_mb"] == pytest.approx(plan["device_total_mb"])
    assert plan["trainable_params"] == 13_631_488 and plan["candidates"] >= 1
    # The settings themselves give that figure again.
    again = estimate_memory_usage(0, 512, plan["batch_size"], model=MISTRAL, lora_rank=16, lora_targets=QKVO,
                                  base_dtype="float16", platform="gpu",
                                  gradient_accumulation_steps=plan["gradient_accumulation_steps"],
                                  mixed_precision=plan["use_mixed_precision"],
                                  gradient_checkpointing=plan["gradient_checkpointing"],
                                  use_8bit_optimizer=plan["use_8bit_optimizer"])
    assert again["device_total_mb"] == plan["device_total_mb"]


def test_planner_changes_the_base_dtype_only_when_allowed():
    shape = model_shape(MISTRAL)
    ft = Finetune(16, tuple(QKVO), "float16")
    kept = fit_candidates(shape, 512, 2, 8, 24 << 30, max_devices=1, platform="gpu", data_mb=11.3, finetune=ft)
    assert kept and {c["base_dtype"] for c in kept} == {"float16"}
    both = fit_candidates(shape, 512, 2, 8, 24 << 30, max_devices=1, platform="gpu", data_mb=11.3, finetune=ft,
                          base_dtypes=("bfloat16",))
    assert {c["base_dtype"] for c in both} == {"float16", "bfloat16"} and len(both) > len(kept)
    # The fastest predicted comes first (on an accelerator the largest micro-batch that fits);
    # the user's own setting is among the candidates and wins only a near tie.
    own = fit_candidates(shape, 256, 1, 16, 24 << 30, max_devices=1, platform="gpu", data_mb=11.3,
                         finetune=Finetune(16, ("q_proj", "v_proj"), "float16"), user=(False, True, True))
    assert own[0]["batch_size"] == max(c["batch_size"] for c in own) > 1
    assert any(c["batch_size"] == 1 and c["gradient_checkpointing"] and c["use_mixed_precision"] for c in own)
    with pytest.raises(ConfigError, match="nothing fits 8GB"):
        fit_to_budget("8GB", 512, 2, 8, model=MISTRAL, lora_rank=16, base_dtype="float16")


def test_full_fine_tuning_of_a_config_is_todays_formula_for_that_shape():
    shape = model_shape(MISTRAL)
    for platform, remat in (("cpu", False), ("cpu", True), ("gpu", True)):
        ft = estimate_memory_usage(0, 256, 2, model=MISTRAL, platform=platform, gradient_checkpointing=remat)
        same = estimate_memory_usage(0, 256, 2, shape=shape, platform=platform, gradient_checkpointing=remat)
        assert ft["trainable_params"] == count_params(shape) and "base_params_mb" not in ft
        assert {k: v for k, v in ft.items() if k not in ("trainable_params", "model_params")} == same
    cpu = estimate_memory_usage(0, 256, 2, shape=shape)
    gpu = estimate_memory_usage(0, 256, 2, shape=shape, platform="gpu")
    assert "runtime_mb" not in cpu and gpu["runtime_mb"] == GPU_RUNTIME_MB
    # the state is the same; XLA:GPU's fused step keeps far fewer activations than XLA:CPU's (the GPU fit)
    assert gpu["params_mb"] == cpu["params_mb"] and gpu["optimizer_state_mb"] == cpu["optimizer_state_mb"]
    assert gpu["activations_mb"] < 0.8 * cpu["activations_mb"]


def test_a_full_fine_tune_over_tpu_chips_plans_8bit_state_no_lower_than_float32_moments():
    """libtpu's FSDP step holds more with 8-bit AdamW state than with float32 moments (TinyLlama at 4 layers over 8
    v5e chips: 2,080 MB a chip against 933; with 8-bit leaves updated in chunks 1,345 MiB against 826,
    docs/memory.md): the plan must not promise 8-bit state saves memory
    there, as it does on one device; the gradients are reduce-scattered (a shard a chip, not the whole 4N)."""
    shape = replace(model_shape(ROOT.parent / "shared" / "models" / "tinyllama-1.1b"), n_layers=4)

    def plan(eight_bit: bool, devices: int = 8, platform: str = "tpu") -> dict:
        return estimate_memory_usage(0, 768, devices, shape=shape, platform=platform, mixed_precision=True,
                                     gradient_checkpointing=True, use_8bit_optimizer=eight_bit, devices=devices,
                                     sharding="fsdp" if devices > 1 else "dp", optimizer="adamw")

    assert plan(True)["device_total_mb"] > plan(False)["device_total_mb"]
    assert plan(True, 1)["device_total_mb"] < plan(False, 1)["device_total_mb"]
    assert plan(False)["gradients_mb"] == pytest.approx(4 * count_params(shape) / 8 / MB, rel=1e-3)


def test_base_casts_follow_the_compute_dtype():
    def e(**kw) -> float:
        return estimate_memory_usage(0, 256, 1, model=MISTRAL, lora_rank=16, **kw)["base_casts_mb"]

    assert e(base_dtype="bfloat16", mixed_precision=True, platform="gpu") == 0  # bf16 weights, bf16 matmuls
    assert e(base_dtype="float32", platform="gpu") == 0
    # XLA:GPU (bench/lora_fit_accel.py's compiles): a 16-bit base's casts fuse into its matmuls (about a kernel's
    # copy at a time, remat or not); a float32 base narrowed to bf16 keeps most of every block without remat.
    no_remat = e(base_dtype="float16", mixed_precision=True, platform="gpu")
    assert no_remat < 0.05 * e(base_dtype="float32", mixed_precision=True, platform="gpu")
    # XLA:CPU runs bf16 dots in float32: float32 copies of the whole base, remat or not (fitted).
    assert e(base_dtype="bfloat16") == e(base_dtype="bfloat16", gradient_checkpointing=True) > 2 * no_remat * 0.9


def test_bad_fine_tuning_arguments_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such config.json"):
        estimate_memory_usage(0, 256, 1, model=tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="only a frozen LoRA base"):
        estimate_memory_usage(0, 256, 1, model=MISTRAL, base_dtype="float16")
    with pytest.raises(ConfigError, match="base_dtype 'int8'"):
        estimate_memory_usage(0, 256, 1, model=MISTRAL, lora_rank=16, base_dtype="int8")


# Published parameter counts (the models' cards and the hub's safetensors metadata): an independent reference
# for the shapes read from the config.json files alone. Qwen3-0.6B's card: 0.44B non-embedding + its
# 151,936 x 1,024 tied embedding (its safetensors store the head too: 751,632,384).
PUBLISHED = {"mistral-7b-v0.1": 7_241_732_096, "llama-3.2-1b": 1_235_814_400, "tinyllama-1.1b": 1_100_048_384,
             "qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920, "smollm2-135m": 134_515_008,
             "gemma-3-1b": 999_885_952}


def test_a_config_json_alone_gives_the_published_parameter_count_and_the_plan_imports_no_jax():
    from slm.model.sizing import count_params

    for name, published in PUBLISHED.items():
        cfg = json.loads((ROOT.parent / "shared" / "models" / name / "config.json").read_text())
        assert count_params(shape_from_hf_config(cfg)) == published, name
    code = ("import sys; from slm.memory.estimate import fit_to_budget; "
            f"fit_to_budget('24GB', 512, 2, 8, model={str(MISTRAL)!r}, lora_rank=16, base_dtype='float16'); "
            "assert 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("remat,mixed,base,targets,seq,batch", [
    (True, False, "bfloat16", ("q_proj", "v_proj"), 256, 1),
    (False, True, "float16", ("q_proj", "k_proj", "v_proj", "o_proj"), 128, 2),
    (True, True, "float32", ("q_proj", "v_proj", "down_proj"), 256, 1),
])
@pytest.mark.slow
def test_lora_estimate_within_10_percent_of_the_compiled_lora_step(remat, mixed, base, targets, seq, batch):
    """The trainer's own LoRA step (slm.train.builder), compiled at abstract shapes on one CPU device."""
    from slm.model.lora import LoraSpec
    from slm.train.builder import StepSpec, build, compile_step
    from slm.train.devices import data_mesh

    shape = replace(model_shape(SMOLLM2), n_layers=2)  # smollm2-135m's widths and vocab, 2 layers: ~5 s to compile
    spec = StepSpec(shape, seq, batch, 1, mixed, remat, lora=LoraSpec(16, 32.0, 0.0, targets), base_dtype=base)
    _, _, xla_mb = compile_step(build(spec, data_mesh(batch, max_devices=1)))
    est = estimate_memory_usage(0, seq, batch, model=shape, lora_rank=16, lora_targets=targets, base_dtype=base,
                                mixed_precision=mixed, gradient_checkpointing=remat)
    assert abs(est["device_total_mb"] / xla_mb - 1) <= 0.10, (est["device_total_mb"], xla_mb)


@pytest.mark.parametrize("mixed,base", [(False, "nf4"), (True, "bfloat16")])
@pytest.mark.slow
def test_gemma3_block_estimate_within_10_percent_of_the_compiled_lora_step(mixed, base):
    """Gemma 3's block (sandwich norms, 256-wide q/k-normed heads, GeGLU) keeps more per layer than a Llama's:
    its widths at 4 layers, a 16K vocabulary so the layers dominate (-19% before GEMMA_BLOCK_BYTES)."""
    from slm.model.lora import LoraSpec
    from slm.train.builder import StepSpec, build, compile_step
    from slm.train.devices import data_mesh

    shape = replace(model_shape(ROOT.parent / "shared" / "models" / "gemma-3-1b"), n_layers=4, vocab_size=16384)
    targets = ("q_proj", "v_proj")
    spec = StepSpec(shape, 256, 1, 1, mixed, True, lora=LoraSpec(16, 32.0, 0.0, targets), base_dtype=base)
    _, _, xla_mb = compile_step(build(spec, data_mesh(1, max_devices=1)))
    est = estimate_memory_usage(0, 256, 1, model=shape, lora_rank=16, lora_targets=targets, base_dtype=base,
                                mixed_precision=mixed, gradient_checkpointing=True)
    assert abs(est["device_total_mb"] / xla_mb - 1) <= 0.10, (est["device_total_mb"], xla_mb)
