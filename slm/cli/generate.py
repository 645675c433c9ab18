"""`python generate.py --run RUN_DIR --prompt TEXT` (or `slm-generate`): sample from a trained run, or
`--chat` with it in its chat template.

Loads the run's newest (or `--step`) checkpoint and tokenizer, and streams the continuation to stdout as it
is produced (slm.model.generate.Decoder: a KV cache, two compiled programs), then one line on stderr with
prefill time and decode tokens/s. The prompt follows the token documents start after in training (the
end-of-text token, or the tokenizer's bos), and generation stops at the next end-of-text unless --ignore-eot.
With --chat the conversation is rendered exactly as transformers' apply_chat_template(add_generation_prompt=True)
renders it (slm.data.chat), each reply stops at the template's end-of-turn token, and without --prompt the
terminal holds a conversation that keeps its turns.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from slm.train.devices import import_jax_quietly, start_backend

import_jax_quietly()  # before jax's first import: a --plan-for GPU plugin's native noise held back

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from slm.cli.common import Parser, run_main
from slm.data.chat import run_chat_template
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
                   help="keep going past an end-of-text (or, with --chat, end-of-turn) token instead of stopping there")
    p.add_argument("--chat", action="store_true",
                   help="chat in the run's chat template (a chat model's, kept from --init-from/--tokenizer): "
                        "--prompt is the user's message; without --prompt, an interactive conversation on stdin")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before the first turn")
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
    if args.system is not None and not args.chat:
        raise GenerateError("--system: only with --chat (it is the conversation's system message)")
    if args.chat and args.num_samples > 1:
        raise GenerateError("--num-samples with --chat: a conversation takes one reply a turn; leave --num-samples at 1")
    if not os.path.isdir(args.run):
        raise GenerateError(f"--run {args.run}: no such directory")


def run(args: argparse.Namespace, out: Any = None, err: Any = None, stdin: Any = None) -> None:
    """Load, sample (or chat) and stream to `out` (stdout), warnings and the speed line to `err` (stderr);
    an interactive --chat reads the user's turns from `stdin`."""
    out, err, stdin = out or sys.stdout, err or sys.stderr, stdin or sys.stdin
    validate(args)
    start_backend()
    # a LoRA run: its base as trained (NF4 codes, bf16...) beside the adapters, never a folded float32 copy
    loaded = load_run(args.run, args.step, held_base=True)  # its RunErrors are one-line messages too
    nf4 = loaded.lora is not None and loaded.config.get("base_dtype") == "nf4"
    model = Transformer(loaded.shape, dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32,
                        lora=loaded.lora, nf4=nf4)
    decoder, timings = Decoder(model), {}
    if args.chat:
        _chat(args, loaded, decoder, timings, out, err, stdin)
    else:
        _sample(args, loaded, decoder, timings, out, err)
    n, decode_s, n_decode = max(timings.get("replies", 1), 1), timings["decode_s"], timings["decode_tokens"]
    per = f" (mean of {n} {'turns' if args.chat else 'samples'})" if n > 1 else ""
    rate = f"{n_decode / decode_s:,.1f} tokens/s" if decode_s > 0 else "n/a tokens/s"
    print(f"[generate] step {loaded.step} | prefill {timings['prompt_tokens'] // n} prompt tokens: "
          f"{timings['prefill_s'] / n * 1e3:.1f} ms to first token{per} | decode {n_decode} tokens in "
          f"{decode_s:.2f} s: {rate} | compile {decoder.compile_s:.1f} s | {jax.devices()[0].platform}", file=err)


def _sample(args: argparse.Namespace, loaded: Any, decoder: Decoder, timings: dict, out: Any, err: Any) -> None:
    """Continue --prompt (or start a new document) --num-samples times."""
    tokenizer, special = loaded.tokenizer, loaded.special
    prompt_ids = special.start + tokenizer.encode(args.prompt, add_special_tokens=False).ids
    prompt_ids = prompt_ids or sample_start(tokenizer, special)
    _warn_past_seq_len(loaded.config, len(prompt_ids), args.max_new_tokens, err)
    decoder.compiled(loaded.params, 1, len(prompt_ids), args.max_new_tokens, args.top_k)  # before timing
    stop = set() if args.ignore_eot or special.eos is None else {special.eos}
    for i in range(args.num_samples):
        if args.num_samples > 1:
            out.write(f"{'' if i == 0 else chr(10)}--- sample {i + 1}/{args.num_samples} ---\n")
        out.write(args.prompt)
        _reply(args, loaded, decoder, prompt_ids, stop, i, timings, out)
    timings["replies"] = args.num_samples


def _chat(args: argparse.Namespace, loaded: Any, decoder: Decoder, timings: dict, out: Any, err: Any,
          stdin: Any) -> None:
    """Each user turn rendered with the run's chat template, as transformers' apply_chat_template(
    add_generation_prompt=True) renders it; the reply stops at the template's end-of-turn token (or eos)
    and joins the conversation. --prompt is one turn; without it, turns are read from stdin."""
    template = run_chat_template(args.run, loaded.tokenizer, loaded.special)
    ends = (template.end_of_turn(loaded.tokenizer), loaded.special.eos)
    stop = set() if args.ignore_eot else {i for i in ends if i is not None}
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turns = [args.prompt] if args.prompt else _user_turns(stdin, err)
    for i, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        ids = template.encode(loaded.tokenizer, messages)
        _warn_past_seq_len(loaded.config, len(ids), args.max_new_tokens, err)
        reply = _reply(args, loaded, decoder, ids, stop, i, timings, out)
        messages.append({"role": "assistant", "content": reply})
        timings["replies"] = i + 1


def _user_turns(stdin: Any, err: Any) -> Any:
    """Lines typed at a `> ` prompt (on stderr, so stdout holds only replies), until an empty input ends
    (Ctrl-D) or `/exit`; blank lines are skipped."""
    print("[generate] chat: type a message and press Enter; Ctrl-D or /exit ends", file=err)
    while True:
        err.write("> ")
        err.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            err.write("\n" if not line else "")
            return
        if line.strip():
            yield line.rstrip("\n")


def _reply(args: argparse.Namespace, loaded: Any, decoder: Decoder, prompt_ids: list[int], stop: set[int],
           index: int, timings: dict, out: Any) -> str:
    """Stream one continuation of `prompt_ids` to `out` until a `stop` token or --max-new-tokens; returns its text."""
    text, said = TextStream(loaded.tokenizer, prompt_ids), []
    key = jax.random.fold_in(jax.random.PRNGKey(args.seed), index)
    out.flush()
    for token_B in decoder.stream(loaded.params, prompt_ids, args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, key=key, timings=timings):
        if int(token_B[0]) in stop:
            break
        said.append(text.push(int(token_B[0])))
        out.write(said[-1])
        out.flush()
    said.append(text.flush())
    out.write(said[-1] + "\n")
    out.flush()
    return "".join(said)


def _warn_past_seq_len(config: dict, prompt_tokens: int, max_new_tokens: int, err: Any) -> None:
    seq_len, total = config.get("seq_len"), prompt_tokens + max_new_tokens
    if seq_len and total > seq_len:
        print(f"warning: {prompt_tokens} prompt tokens (with the start token) + --max-new-tokens "
              f"{max_new_tokens} = {total} positions, beyond the run's trained --seq-len {seq_len}; "
              f"text past position {seq_len} may degrade", file=err)


def main(argv: list[str] | None = None) -> int:
    return run_main(lambda: run(build_parser().parse_args(argv)))
