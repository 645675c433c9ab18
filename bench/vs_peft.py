"""LoRA fine-tuning: this trainer against transformers + peft, side by side in one sitting.

    .venv/bin/python bench/vs_peft.py                      # SmolLM2-135M's shape, vocab 8,192: 111M params
    .venv/bin/python bench/vs_peft.py --steps 25 --ours "" --ours="--base-dtype float32"   # two rows of ours

The base: ../shared/models/smollm2-135m/config.json (a Llama: 30 layers x 576, 9 heads, 3 KV heads) with its
vocabulary cut to --vocab (a byte-level BPE of that size trained here on tinyshakespeare), random weights,
saved by transformers as safetensors into a scratch folder. The run: LoRA rank 16, alpha 32, on q_proj and
v_proj, dropout 0, AdamW, seq 256 x batch 4, tinyshakespeare packed into 256-token rows (the same tokenizer
for all three). The base is stored in bfloat16, as SmolLM2's own; peft holds it in --peft-base-dtype, ours in
its default --base-dtype (bfloat16 under bf16 products, float32 otherwise: slm.train.defaults).

- transformers + peft, float32: `get_peft_model(LoraConfig(...))`, torch.optim.AdamW over the adapters,
  forward + backward + step, one process;
- transformers + peft, bf16 autocast: the same inside `torch.autocast("cpu", torch.bfloat16)` (what HF
  Trainer's `bf16=True` does on CPU);
- ours: `train_optimized.py --use-streaming --init-from BASE --lora-rank 16 --lora-alpha 32 --seq-len 256
  --batch-size 4` with the trainer's defaults otherwise (plus --ours).

Each runs alone (one after the other, in its own process): step time = the wall time between consecutive
step ends, the median over steps --skip+1..--steps; tokens/s = 1,024 / that median; peak RSS = the process's
ru_maxrss (ours: the summary's peak_rss_mb, the same figure). Printed with the host's CPU model; the ratio is
against the faster of the two peft runs, the RSS ratio against that run's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DATA = os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt")
CONFIG = os.path.join(ROOT, "..", "shared", "models", "smollm2-135m", "config.json")
sys.path.insert(0, ROOT)

PEFT_RUN = r'''
import json, resource, sys, time
import numpy as np, torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model

base, data, steps, seq, batch, bf16 = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
base_dtype = getattr(torch, sys.argv[7])
torch.manual_seed(0)
ids = np.array(Tokenizer.from_file(base + "/tokenizer.json").encode(open(data).read()).ids, dtype=np.int64)
rows = ids[: len(ids) // (seq + 1) * (seq + 1)].reshape(-1, seq + 1)
model = AutoModelForCausalLM.from_pretrained(base, dtype=base_dtype)  # peft keeps the adapters float32
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
ends = [time.perf_counter()]
for step in range(steps):
    b = torch.from_numpy(rows[(step * batch) % (len(rows) - batch):][:batch])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=b[:, :-1], labels=b[:, :-1]).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()
    ends.append(time.perf_counter())
print(json.dumps({"step_s": np.diff(ends).tolist(), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "loss": float(loss)}))
'''


def make_base(folder: str, vocab: int, config: str = CONFIG) -> int:
    """A random model of `config`'s shape (default SmolLM2-135M's) with a `vocab`-token BPE, saved by
    transformers; its parameter count."""
    import torch
    import transformers

    from slm.data.tokenizer import train_bpe

    tok = train_bpe([open(DATA).read()], vocab)
    cfg = json.load(open(config))
    cfg.update(vocab_size=tok.get_vocab_size(), bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return sum(p.numel() for p in model.parameters())


def run_peft(base: str, a: argparse.Namespace, bf16: bool) -> dict:
    r = subprocess.run([sys.executable, "-c", PEFT_RUN, base, DATA, str(a.steps), "256", "4", "1" if bf16 else "0",
                        a.peft_base_dtype],
                       capture_output=True, text=True, check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {"median_step_s": median(out["step_s"][a.skip:]), "peak_rss_mb": out["peak_rss_mb"]}


def run_ours(base: str, a: argparse.Namespace, scratch: str, flags: str = "") -> dict:
    run = os.path.join(scratch, f"ours-{len(os.listdir(scratch))}")
    cmd = [sys.executable, os.path.join(ROOT, "train_optimized.py"), "--use-streaming", "--dataset-id", DATA,
           "--init-from", base, "--lora-rank", "16", "--lora-alpha", "32", "--seq-len", "256", "--batch-size", "4",
           "--max-steps", str(a.steps), "--log-every", "1", "--eval-every", "1000000000", "--eval-tokens", "1024",
           "--checkpoint-every", "1000000000", "--output-dir", run, *flags.split()]
    subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    t = [r["elapsed_s"] for r in rows if "loss" in r]
    summary = json.load(open(os.path.join(run, "summary.json")))
    return {"median_step_s": median([b - x for x, b in zip(t, t[1:])][a.skip - 1:]),
            "peak_rss_mb": summary["peak_rss_mb"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the medians")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--model", default="smollm2-135m", help="a config folder of ../shared/models (e.g. qwen3-0.6b)")
    p.add_argument("--peft-base-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the dtype transformers loads the base in (pair it with --ours \"--base-dtype ...\")")
    p.add_argument("--no-autocast", action="store_true",
                   help="skip peft's bf16 autocast run (on a CPU without bf16 products it is the slower peft by far)")
    p.add_argument("--ours", action="append", default=None,
                   help="extra flags for our run (quoted); repeat it for several runs of ours, each a row")
    a = p.parse_args()
    scratch = tempfile.mkdtemp(prefix="vs-peft-")
    base = os.path.join(scratch, "base")
    n = make_base(base, a.vocab, os.path.join(ROOT, "..", "shared", "models", a.model, "config.json"))
    from slm.train.throughput import cpu_model

    print(f"vs transformers + peft, one sitting | {cpu_model()}, {os.cpu_count()} cores | base: {a.model}'s "
          f"shape, vocab {a.vocab:,}: {n / 1e6:.1f}M params, peft's in {a.peft_base_dtype} | LoRA r16 alpha 32 on q_proj,v_proj | seq 256 x "
          f"batch 4 | median of steps {a.skip + 1}-{a.steps}", flush=True)
    plain = f"peft {a.peft_base_dtype}"  # no autocast: the base's own dtype
    results = {plain: run_peft(base, a, False)}
    if not a.no_autocast:
        results["peft bf16 autocast"] = run_peft(base, a, True)
    for flags in a.ours or [""]:
        results[f"ours {flags}".strip()] = run_ours(base, a, scratch, flags)
    faster = min((k for k in results if k.startswith("peft")), key=lambda k: results[k]["median_step_s"])
    print("| run | median step | tokens/s | peak RSS | speed vs the faster peft | RSS vs it |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        speed = results[faster]["median_step_s"] / r["median_step_s"]
        print(f"| {name} | {r['median_step_s'] * 1e3:,.0f} ms | {1024 / r['median_step_s']:,.0f} | "
              f"{r['peak_rss_mb']:,.0f} MB | {speed:.2f}x | {r['peak_rss_mb'] / results[faster]['peak_rss_mb']:.2f}x |")


if __name__ == "__main__":
    main()
