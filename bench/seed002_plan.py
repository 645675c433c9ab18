"""Seed 002's question, answered before the run: does LoRA on Mistral-7B-v0.1 fit a 24 GB GPU, and with what?

    .venv/bin/python bench/seed002_plan.py [--config ../shared/models/mistral-7b-v0.1/config.json] [--budget 24GB]

Pure arithmetic from the config.json alone (slm.memory: no jax, no weights): the seed's first settings
(micro-batch 2 x accumulation 8, seq 512, LoRA r16 on q/k/v/o, no remat, fp16 base), the same with a
bf16 base (like for like with the seed's PyTorch run, whose fp16 weights needed no cast for its fp16
compute), its final settings (1 x 16, seq 256, q/v, remat) and fit_to_budget's choice from the first
settings. "FP16 precision" in the seed is mixed precision here: bf16 compute. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slm.memory.estimate import estimate_memory_usage, fit_to_budget, parse_size

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
FIRST = {"seq_len": 512, "batch_size": 2, "gradient_accumulation_steps": 8, "lora_targets": QKVO,
         "base_dtype": "float16", "gradient_checkpointing": False, "mixed_precision": True, "use_8bit_optimizer": False}
FINAL = {**FIRST, "seq_len": 256, "batch_size": 1, "gradient_accumulation_steps": 16,
         "lora_targets": ("q_proj", "v_proj"), "gradient_checkpointing": True}
SEED = {"first": "~27-28 GB (OOM)", "final": "peak ~23 GB of 24 (nvidia-smi)"}


def row(name: str, config: str, s: dict, budget_mb: float, seed: str) -> str:
    e = estimate_memory_usage(0, s["seq_len"], s["batch_size"], model=config, lora_rank=16, platform="gpu",
                              lora_targets=s["lora_targets"], base_dtype=s["base_dtype"],
                              gradient_accumulation_steps=s["gradient_accumulation_steps"],
                              gradient_checkpointing=s["gradient_checkpointing"],
                              mixed_precision=s["mixed_precision"], use_8bit_optimizer=s["use_8bit_optimizer"])
    state = sum(e[k] for k in ("params_mb", "gradients_mb", "optimizer_state_mb", "accumulation_mb"))
    flags = ", ".join(f for f, on in (("remat", s["gradient_checkpointing"]), ("bf16 compute", s["mixed_precision"]),
                                     ("8-bit", s["use_8bit_optimizer"])) if on) or "-"
    total = e["device_total_mb"]
    verdict = "fits (10% margin)" if total <= 0.9 * budget_mb else "fits" if total <= budget_mb else "does not fit"
    targets = "q,k,v,o" if len(s["lora_targets"]) == 4 else ",".join(t[0] for t in s["lora_targets"])
    return (f"| {name} | {s['batch_size']} x {s['gradient_accumulation_steps']} | {s['seq_len']} | {targets} | "
            f"{s['base_dtype']} | {flags} | {e['trainable_params']:,} | {e['base_params_mb']:,.0f} | "
            f"{e['base_casts_mb']:,.0f} | {state:,.0f} | {e['activations_mb'] + e['logits_mb']:,.0f} | "
            f"{e['runtime_mb']:,.0f} | **{total:,.0f}** ({total / 1024:.1f} GiB) | {verdict} | {seed} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="../shared/models/mistral-7b-v0.1/config.json")
    p.add_argument("--budget", default="24GB")
    a = p.parse_args()
    budget_mb = parse_size(a.budget) / 2**20
    plan = fit_to_budget(a.budget, FIRST["seq_len"], FIRST["batch_size"], FIRST["gradient_accumulation_steps"],
                         model=a.config, lora_rank=16, lora_targets=QKVO, base_dtype="float16", platform="gpu",
                         mixed_precision=True)
    chosen = {**FIRST, "batch_size": plan["batch_size"], "base_dtype": plan["base_dtype"],
              "gradient_accumulation_steps": plan["gradient_accumulation_steps"],
              "gradient_checkpointing": plan["gradient_checkpointing"],
              "mixed_precision": plan["use_mixed_precision"], "use_8bit_optimizer": plan["use_8bit_optimizer"]}
    print(f"LoRA r16 on {a.config}, platform gpu, budget {a.budget} ({budget_mb:,.0f} MB); MB per device\n")
    print("| settings | micro x acc | seq | targets | base | flags | trainable | base | base casts | adapters + state "
          "| activations + logits | CUDA runtime | device total | vs budget | seed 002 reports |")
    print("|---" * 15 + "|")
    print(row("first (seed)", a.config, FIRST, budget_mb, SEED["first"]))
    print(row("first, bf16 base", a.config, {**FIRST, "base_dtype": "bfloat16"}, budget_mb, "-"))
    print(row("final (seed)", a.config, FINAL, budget_mb, SEED["final"]))
    print(row("fit_to_budget from first", a.config, chosen, budget_mb, "-"))
    print(f"\nfit_to_budget: {plan['candidates']} settings fit {a.budget} with a 10% margin at effective batch "
          f"{plan['batch_size'] * plan['gradient_accumulation_steps']}; the cheapest in compute is shown.")


if __name__ == "__main__":
    main()
