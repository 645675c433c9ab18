"""`python generate.py --run RUN_DIR --prompt TEXT` (or `slm-generate`): sample from a trained run.

Loads the run's newest (or `--step`) checkpoint and tokenizer, and streams the continuation to stdout as it
is produced (slm.model.generate.Decoder: a KV cache, two compiled programs), then one line on stderr with
prefill time and decode tokens/s. The prompt follows the token documents start after in training (the
end-of-text token, or the tokenizer's bos), and generation stops at the next end-of-text unless --ignore-eot.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp

from slm.cli.common import Parser, run_main
from slm.data.tokenizer import TextStream, sample_start
from slm.errors import GenerateError
from slm.model.generate import Decoder
from slm.model.transformer import Transformer
from slm.train.builder import load_run


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description="Sample from a trained run with a KV cache, streaming tokens as they come.",
               formatter_class=argparse.ArgumentDefaultsHelpFormatter, error_class=GenerateError)
    p.add_argument("--run", required=True, metavar="DIR", help="a run's output dir (config.json, tokenizer.json, "
                   "checkpoints/)")
    p.add_argument("--prompt", default="", help="text to continue; empty starts a new document")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to load (default: the newest)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="softmax temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=40, metavar="K", help="sample among the K most likely tokens; 0 is off")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the most likely tokens whose probability sums to P (nucleus); 1 is off")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same text")
    p.add_argument("--num-samples", type=int, default=1, metavar="N", help="independent samples, one after another")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--ignore-eot", action="store_true",
                   help="keep going past an end-of-text token instead of stopping there")
    return p


def validate(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        raise GenerateError(f"--temperature {args.temperature}: must be a finite number >= 0 (0 is greedy)")
    if args.top_k < 0:
        raise GenerateError(f"--top-k {args.top_k}: must be >= 0 (0 is off)")
    if not 0 < args.top_p <= 1:
        raise GenerateError(f"--top-p {args.top_p}: must be in (0, 1] (1 is off)")
    if args.num_samples < 1:
        raise GenerateError(f"--num-samples {args.num_samples}: must be at least 1")
    if args.step is not None and args.step < 0:
        raise GenerateError(f"--step {args.step}: must be >= 0")
    if not os.path.isdir(args.run):
        raise GenerateError(f"--run {args.run}: no such directory")


def run(args: argparse.Namespace, out: Any = None, err: Any = None) -> None:
    """Load, sample and stream to `out` (stdout), warnings and the speed line to `err` (stderr)."""
    out, err = out or sys.stdout, err or sys.stderr
    validate(args)
    loaded = load_run(args.run, args.step)  # its RunErrors are one-line messages too
    tokenizer, config = loaded.tokenizer, loaded.config
    model = Transformer(loaded.shape, dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32)
    eot = loaded.special.eos  # None: a tokenizer with no end-of-text token, generation runs to the end
    prompt_ids = loaded.special.start + tokenizer.encode(args.prompt, add_special_tokens=False).ids
    prompt_ids = prompt_ids or sample_start(tokenizer, loaded.special)
    total = len(prompt_ids) + args.max_new_tokens
    seq_len = config.get("seq_len")
    if seq_len and total > seq_len:
        print(f"warning: {len(prompt_ids)} prompt tokens (with the start token) + --max-new-tokens "
              f"{args.max_new_tokens} = {total} positions, beyond the run's trained --seq-len {seq_len}; "
              f"text past position {seq_len} may degrade", file=err)

    decoder = Decoder(model)
    decoder.compiled(loaded.params, 1, len(prompt_ids), args.max_new_tokens, args.top_k)  # before timing
    timings: dict = {}
    base_key = jax.random.PRNGKey(args.seed)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            out.write(f"{'' if i == 0 else chr(10)}--- sample {i + 1}/{args.num_samples} ---\n")
        out.write(args.prompt)
        out.flush()
        text = TextStream(tokenizer, prompt_ids)
        for token_B in decoder.stream(loaded.params, prompt_ids, args.max_new_tokens,
                                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                      key=jax.random.fold_in(base_key, i), timings=timings):
            if int(token_B[0]) == eot and not args.ignore_eot:
                break
            delta = text.push(int(token_B[0]))
            if delta:
                out.write(delta)
                out.flush()
        out.write(text.flush() + "\n")
        out.flush()

    n = args.num_samples
    per_sample = f" (mean of {n} samples)" if n > 1 else ""
    decode_s, n_decode = timings["decode_s"], timings["decode_tokens"]
    rate = f"{n_decode / decode_s:,.1f} tokens/s" if decode_s > 0 else "n/a tokens/s"
    print(f"[generate] step {loaded.step} | prefill {len(prompt_ids)} prompt tokens: "
          f"{timings['prefill_s'] / n * 1e3:.1f} ms to first token{per_sample} | decode {n_decode} tokens in "
          f"{decode_s:.2f} s: {rate} | compile {decoder.compile_s:.1f} s | {jax.devices()[0].platform}", file=err)


def main(argv: list[str] | None = None) -> int:
    return run_main(lambda: run(build_parser().parse_args(argv)))
