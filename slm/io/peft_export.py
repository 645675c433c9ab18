"""Write a LoRA run's adapters as a Hugging Face PEFT adapter folder (`export_hf.py --format peft`).

The folder holds adapter_config.json and adapter_model.safetensors, as `peft.PeftModel.save_pretrained`
writes them, so `peft.PeftModel.from_pretrained(base, OUT_DIR)` (or `AutoPeftModelForCausalLM`, which reads
the base's id from the config) loads it on the run's --init-from model. Pure numpy: no torch or peft here.

Layout (slm.model.lora): the adapter of Hugging Face projection `t` in block i is `<t>_lora_a` (in, r) and
`<t>_lora_b` (r, out) in block_i/attn or block_i/mlp, applied as x A B * alpha / r on the columns of the fused
kernel that are `t` (target_columns). PEFT's lora_A and lora_B are torch Linears, weights (out, in):
    block_i/attn/q_proj_lora_a (in, r)  -> base_model.model.model.layers.i.self_attn.q_proj.lora_A.weight (r, in)
    block_i/attn/q_proj_lora_b (r, out) -> base_model.model.model.layers.i.self_attn.q_proj.lora_B.weight (out, r)
    block_i/mlp/up_proj_lora_a ...      -> base_model.model.model.layers.i.mlp.up_proj.lora_A.weight ...
PEFT scales by lora_alpha / r (use_rslora false), as the trainer does, and its dropout is the trainer's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from slm.errors import ExportError
from slm.io.hf_export import save_tensors, write_json
from slm.model.sizing import ModelShape

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_SUBLAYER = {"attn": "self_attn", "mlp": "mlp"}
_MARK = "_lora_"  # slm.model.lora.MARK (not imported: that module needs jax, and this one is pure numpy)


def peft_state_dict(adapters: Mapping[str, Any], shape: ModelShape) -> dict[str, np.ndarray]:
    """The run's adapters tree ({block_i: {attn|mlp: {<target>_lora_a|b: array}}}) -> PEFT's names and layouts."""
    out: dict[str, np.ndarray] = {}
    for block, modules in adapters.items():
        i = int(block.removeprefix("block_"))
        if not 0 <= i < shape.n_layers:
            raise ExportError(f"adapter {block}: the run has {shape.n_layers} layers")
        for module, arrays in modules.items():
            for name, x in arrays.items():
                target, _, ab = name.rpartition(_MARK)
                key = f"base_model.model.model.layers.{i}.{_SUBLAYER[module]}.{target}.lora_{ab.upper()}.weight"
                out[key] = np.ascontiguousarray(np.asarray(x, dtype=np.float32).T)
    if not out:
        raise ExportError("the run's checkpoint holds no LoRA adapters")
    return out


def adapter_config(lora: Any, base: str, revision: str | None) -> dict:
    """adapter_config.json for a LoraSpec (rank, alpha, dropout, targets); PEFT fills the other fields with its
    defaults. `base` is the run's --init-from (a hub id, or a local folder) and `revision` its pinned commit."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "revision": revision,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft(out_dir: str, adapters: Mapping[str, Any], shape: ModelShape, lora: Any, base: str,
               revision: str | None = None, metadata: Mapping[str, str] | None = None) -> list[str]:
    """Write the adapter folder; returns the file names written."""
    tensors = peft_state_dict(adapters, shape)
    os.makedirs(out_dir, exist_ok=True)
    save_tensors(os.path.join(out_dir, ADAPTER_WEIGHTS), tensors, metadata)
    write_json(os.path.join(out_dir, ADAPTER_CONFIG), adapter_config(lora, base, revision))
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
