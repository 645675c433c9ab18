"""`python export_hf.py --run RUN_DIR --out OUT [--format hf|peft|gguf]` (or `slm-export`): deploy a run.

  hf    (default) a Hugging Face folder (config.json, model.safetensors, tokenizer) that transformers'
        `AutoModelForCausalLM.from_pretrained(OUT)` loads; a LoRA run's adapters are folded in
        (slm.io.hf_export says how the weights map).
  peft  a LoRA run's adapters as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) that
        `peft.PeftModel.from_pretrained(base, OUT)` loads on the run's --init-from model (slm.io.peft_export).
  gguf  one .gguf file (OUT names it) for llama.cpp / ollama / LM Studio, tokenizer embedded, --gguf-type
        f16 (default), q8_0 or f32; a LoRA run is written merged (slm.io.gguf_export).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from slm.cli.common import Parser, run_main
from slm.errors import ExportError, TokenizerError

FORMATS = ("hf", "peft", "gguf")


def build_parser() -> argparse.ArgumentParser:
    from slm.io.gguf_export import GGUF_TYPES

    p = Parser(error_class=ExportError, description="Write a run's checkpoint as a Hugging Face folder (Llama, Qwen2 or Qwen3) "
               "(--format hf, the default), a PEFT LoRA adapter folder (--format peft) or a GGUF file for llama.cpp "
               "(--format gguf).")
    p.add_argument("--run", required=True, metavar="DIR", help="a run's output dir (config.json, tokenizer.json, "
                   "checkpoints/)")
    p.add_argument("--out", required=True, metavar="PATH", help="folder to write (created; must be empty unless "
                   "--force); with --format gguf, the .gguf file to write")
    p.add_argument("--format", choices=FORMATS, default="hf", help="hf: a transformers folder (LoRA folded in); "
                   "peft: a LoRA run's adapters for peft; gguf: one file for llama.cpp (default: hf)")
    p.add_argument("--gguf-type", choices=GGUF_TYPES, default=None, help="weight type of --format gguf: f16 "
                   "(default), q8_0 (8-bit blocks, ~half the size) or f32")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the newest)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out (or over an existing "
                   ".gguf), replacing the files this tool writes")
    return p


def validate(args: argparse.Namespace) -> None:
    if args.step is not None and args.step < 0:
        raise ExportError(f"--step {args.step}: must be >= 0")
    if args.gguf_type is not None and args.format != "gguf":
        raise ExportError(f"--gguf-type {args.gguf_type}: only with --format gguf")
    if not os.path.isdir(args.run):
        raise ExportError(f"--run {args.run}: no such directory")
    if args.format == "gguf":
        if not args.out.endswith(".gguf"):
            raise ExportError(f"--out {args.out}: with --format gguf, name the file to write (e.g. "
                              f"{os.path.join(args.out, 'model.gguf')})")
        if os.path.isdir(args.out):
            raise ExportError(f"--out {args.out}: is a directory; name the .gguf file to write")
        if os.path.exists(args.out) and not args.force:
            raise ExportError(f"--out {args.out}: exists; choose a new file or pass --force")
        return
    if os.path.exists(args.out):
        if not os.path.isdir(args.out):
            raise ExportError(f"--out {args.out}: exists and is not a directory")
        if os.listdir(args.out) and not args.force:
            raise ExportError(f"--out {args.out}: exists and is not empty; choose a new folder or pass --force")
    if os.path.abspath(args.out) == os.path.abspath(args.run):
        raise ExportError(f"--out {args.out}: is the run directory itself; choose another folder")


def _hf(args: argparse.Namespace, err: Any) -> list[str]:
    from slm.io.hf_export import WEIGHTS, write_export
    from slm.train.builder import load_run

    loaded = load_run(args.run, args.step)  # its RunErrors are one-line messages too
    shape, config = loaded.shape, loaded.config
    written = write_export(args.out, loaded.params, shape, _max_positions(config), tokenizer=loaded.tokenizer,
                           special=loaded.special, tokenizer_file=os.path.join(args.run, "tokenizer.json"),
                           metadata={"step": str(loaded.step)})
    size = os.path.getsize(os.path.join(args.out, WEIGHTS))
    with open(os.path.join(args.out, "config.json")) as f:
        arch = json.load(f)["architectures"][0]  # Llama, Qwen2 or Qwen3 (slm.io.hf_export.hf_config)
    print(f"[export_hf] step {loaded.step} of {args.run} -> {args.out}: {arch} "
          f"{shape.n_layers}x{shape.d_model} ({shape.n_heads} heads, ffn {shape.d_ff}, vocab {shape.vocab_size}), "
          f"{size / 1e6:.1f} MB float32; files: {', '.join(written)}", file=err)
    return written


def _peft(args: argparse.Namespace, err: Any) -> list[str]:
    from slm.io.peft_export import ADAPTER_WEIGHTS, write_peft
    from slm.train.builder import load_run

    loaded = load_run(args.run, args.step, fold_lora=False)  # the adapters only: the base is not read
    if loaded.lora is None:
        raise ExportError(f"--format peft: {args.run} is not a LoRA run (it trained all its weights); export it "
                          f"with --format hf or --format gguf")
    base, revision = loaded.config.get("init_from"), loaded.config.get("init_revision")
    if base and os.path.isdir(base):
        base = os.path.abspath(base)
    written = write_peft(args.out, loaded.adapters, loaded.shape, loaded.lora, base, revision,
                         metadata={"step": str(loaded.step)})
    lora, size = loaded.lora, os.path.getsize(os.path.join(args.out, ADAPTER_WEIGHTS))
    print(f"[export_hf] step {loaded.step} of {args.run} -> {args.out}: PEFT LoRA r={lora.rank} alpha={lora.alpha:g} "
          f"on {','.join(lora.targets)} over {base}{f'@{revision[:12]}' if revision else ''}, {size / 1e6:.2f} MB "
          f"float32; files: {', '.join(written)}", file=err)
    if base and os.path.isdir(os.path.join(base, "checkpoints")):
        print(f"[export_hf] note: the base {base} is a run of this trainer: export it with --format hf and load "
              f"the adapter on that folder", file=err)
    return written


def _gguf(args: argparse.Namespace, err: Any) -> list[str]:
    from slm.data.instruction import load_chat_template
    from slm.io.gguf_export import write_gguf
    from slm.train.builder import load_run

    loaded = load_run(args.run, args.step)  # a LoRA run comes folded into its base
    gguf_type = args.gguf_type or "f16"
    try:
        template = load_chat_template(os.path.join(args.run, "tokenizer.json"))
    except TokenizerError:  # no chat template: a plain language model
        template = None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    shape = loaded.shape
    arch = write_gguf(args.out, loaded.params, shape, _max_positions(loaded.config), loaded.tokenizer, loaded.special,
                      gguf_type, name=os.path.basename(os.path.normpath(args.run)), chat_template=template)
    print(f"[export_hf] step {loaded.step} of {args.run} -> {args.out}: GGUF {arch} {gguf_type}, "
          f"{shape.n_layers}x{shape.d_model} ({shape.n_heads} heads, ffn {shape.d_ff}, vocab {shape.vocab_size}), "
          f"{os.path.getsize(args.out) / 1e6:.1f} MB, tokenizer embedded"
          f"{' with its chat template' if template else ''}", file=err)
    return [os.path.basename(args.out)]


def _max_positions(config: dict) -> int:
    return max(int(config.get("seq_len") or 0), 1)


def run(args: argparse.Namespace, err: Any = None) -> list[str]:
    """Export on the host CPU whatever the machine has: merging adapters or dequantising an NF4 base makes a
    full-precision copy of the model, which belongs in host memory, not beside nothing on a GPU's (the
    device plan, --plan-for, counts no export program). `err`: where the summary goes, sys.stderr as it is at
    the call (a default bound at import kept the first caller's stream: a notebook's or a test's, closed since)."""
    err = sys.stderr if err is None else err
    from slm.train.devices import import_jax_quietly, start_backend

    validate(args)
    import_jax_quietly()
    start_backend()
    import jax

    try:
        with jax.default_device(jax.devices("cpu")[0]):
            return {"hf": _hf, "peft": _peft, "gguf": _gguf}[args.format](args, err)
    except OSError as e:
        raise ExportError(f"--out {args.out}: could not write ({e.strerror or e})") from None


def main(argv: list[str] | None = None) -> int:
    return run_main(lambda: run(build_parser().parse_args(argv)))
