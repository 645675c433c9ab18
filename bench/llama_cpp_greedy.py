"""llama.cpp's greedy continuation of a prompt against ours, token for token, from an f16 GGUF export (issue 16).

    .venv/bin/python bench/llama_cpp_greedy.py                    # trains a small run first (~1 min)
    .venv/bin/python bench/llama_cpp_greedy.py --run runs/<run>   # an existing run

Also checks that llama.cpp, from the file alone, tokenizes each prompt exactly as we do.
Needs llama-cpp-python (not a project requirement: it compiles llama.cpp from source, which took this 2-core
VM tens of minutes; see docs/deploy.md). Writes the run as `--format gguf --gguf-type f16`, loads it with
llama_cpp.Llama (its own tokenizer from the file, no Hugging Face files), and for a few prompts compares
llama.cpp's greedy tokens (top-k 1, temperature 0) with generate_ids(temperature=0) on our float32 params.
The prompt ids are ours ([bos] + the run's encoding), handed to both as ids. f16 weights against float32
can flip a near-tie; the script prints the first position where the two differ, if any.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PROMPTS = ["First Citizen:\nBefore we proceed", "ROMEO:\nBut soft", "KING HENRY:\nOnce more unto"]


def train_small(out: str) -> None:
    subprocess.run([sys.executable, os.path.join(ROOT, "train_optimized.py"), "--use-streaming", "--dataset-id",
                    os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare_train.txt"), "--target-params",
                    "800000", "--seq-len", "128", "--batch-size", "32", "--max-steps", "300", "--eval-every", "300",
                    "--eval-tokens", "4096", "--output-dir", out], check=True, stdout=subprocess.DEVNULL)


def ours(run_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from slm.model.generate import generate_ids
    from slm.model.transformer import Transformer
    from slm.train.builder import load_run

    run = load_run(run_dir)
    model = Transformer(run.shape)
    return [generate_ids(model, run.params, p, n, temperature=0.0)[0].tolist() for p in prompts]


def theirs(gguf: str, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[list[int]]]:
    """(llama.cpp's greedy tokens for each prompt, its own tokenization of each prompt text, bos added)."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=512, n_threads=2, verbose=False)
    own = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in PROMPTS]
    out = []
    for p in prompts:
        llm.reset()
        toks = []
        for t in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            toks.append(int(t))
            if len(toks) == n:
                break
        out.append(toks)
    return out, own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="a run dir (default: train a 0.8M-param model for 300 steps first)")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run or os.path.join(tmp, "run")
        if not args.run:
            train_small(run_dir)
        gguf = os.path.join(tmp, "model.gguf")
        subprocess.run([sys.executable, os.path.join(ROOT, "export_hf.py"), "--run", run_dir, "--out", gguf,
                        "--format", "gguf", "--gguf-type", "f16"], check=True, stderr=subprocess.DEVNULL)
        from slm.train.builder import load_run

        run = load_run(run_dir)
        start = run.special.start if hasattr(run.special, "start") else []
        prompts = [list(start) + run.tokenizer.encode(p).ids for p in PROMPTS]
        a, (b, own) = ours(run_dir, prompts, args.tokens), theirs(gguf, prompts, args.tokens)
    tok_same = sum(x == y for x, y in zip(prompts, own))
    print(f"{tok_same}/{len(PROMPTS)} prompts tokenized by llama.cpp from the GGUF alone exactly as ours ([bos] + ids)")
    same = 0
    for text, x, y in zip(PROMPTS, a, b):
        first = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        same += first is None
        print(f"{text!r}: {'identical' if first is None else f'first difference at token {first}'} "
              f"({len(x)} tokens)\n  ours:      {run.tokenizer.decode(x)!r}\n  llama.cpp: {run.tokenizer.decode(y)!r}")
    print(f"{same}/{len(PROMPTS)} greedy continuations identical token for token (f16 GGUF vs float32 ours)")


if __name__ == "__main__":
    main()
