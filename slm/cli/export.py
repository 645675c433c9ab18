"""`python export_hf.py --run RUN_DIR --out OUT_DIR` (or `slm-export`): a run as a Hugging Face folder.

The folder (config.json, model.safetensors, tokenizer) loads offline with transformers'
`AutoModelForCausalLM.from_pretrained(OUT_DIR)`; slm.io.hf_export says how the weights map.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from slm.cli.common import Parser, run_main
from slm.errors import ExportError
from slm.io.hf_export import WEIGHTS, write_export
from slm.train.builder import load_run


def build_parser() -> argparse.ArgumentParser:
    p = Parser(error_class=ExportError, description="Write a run's checkpoint as a Hugging Face LlamaForCausalLM folder "
                            "(config.json, model.safetensors, tokenizer).")
    p.add_argument("--run", required=True, metavar="DIR", help="a run's output dir (config.json, tokenizer.json, "
                   "checkpoints/)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write (created; must be empty unless "
                   "--force)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the newest)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out, replacing the files "
                   "this tool writes")
    return p


def validate(args: argparse.Namespace) -> None:
    if args.step is not None and args.step < 0:
        raise ExportError(f"--step {args.step}: must be >= 0")
    if not os.path.isdir(args.run):
        raise ExportError(f"--run {args.run}: no such directory")
    if os.path.exists(args.out):
        if not os.path.isdir(args.out):
            raise ExportError(f"--out {args.out}: exists and is not a directory")
        if os.listdir(args.out) and not args.force:
            raise ExportError(f"--out {args.out}: exists and is not empty; choose a new folder or pass --force")
    if os.path.abspath(args.out) == os.path.abspath(args.run):
        raise ExportError(f"--out {args.out}: is the run directory itself; choose another folder")


def run(args: argparse.Namespace, err: Any = sys.stderr) -> list[str]:
    validate(args)
    loaded = load_run(args.run, args.step)  # its RunErrors are one-line messages too
    shape, config = loaded.shape, loaded.config
    max_positions = max(int(config.get("seq_len") or 0), 1)
    try:
        written = write_export(args.out, loaded.params, shape, max_positions, tokenizer=loaded.tokenizer, special=loaded.special,
                               tokenizer_file=os.path.join(args.run, "tokenizer.json"),
                               metadata={"step": str(loaded.step)})
    except OSError as e:
        raise ExportError(f"--out {args.out}: could not write ({e.strerror or e})") from None
    size = os.path.getsize(os.path.join(args.out, WEIGHTS))
    print(f"[export_hf] step {loaded.step} of {args.run} -> {args.out}: LlamaForCausalLM "
          f"{shape.n_layers}x{shape.d_model} ({shape.n_heads} heads, ffn {shape.d_ff}, vocab {shape.vocab_size}), "
          f"{size / 1e6:.1f} MB float32; files: {', '.join(written)}", file=err)
    return written


def main(argv: list[str] | None = None) -> int:
    return run_main(lambda: run(build_parser().parse_args(argv)))
