"""QLoRA (--base-dtype nf4) against a bfloat16 base: NF4's error on trained weights, the loss curves of LoRA on
each base (same data and steps, several seeds) and their step times, in one sitting.

    .venv/bin/python bench/qlora.py                      # 4M-param base, 300 pretraining steps, LoRA 150 steps, seeds 0 1
    .venv/bin/python bench/qlora.py --base-steps 600 --lora-steps 300 --seeds 0,1,2
    .venv/bin/python bench/qlora.py --decode smollm2-135m   # the sampler's ms a token: NF4's two lookups

The base is pretrained here (tinystories, from scratch) and exported as a LlamaForCausalLM folder, so NF4 meets
trained weights, not a random init. LoRA r16 on every projection then fine-tunes it on tinyshakespeare
(another domain), evaluated on tinyshakespeare_val, once per base dtype and seed. Prints the host's CPU
model, the quantisation error, each arm's eval loss and median step time, and the largest gap between the
two arms' training-loss curves against the seed-to-seed gap of the bfloat16 arm.

`--decode MODEL`: the KV-cache sampler (slm.model.generate.Decoder) of a QLoRA run at a ../shared/models
config's shape (random weights, r16 on q_proj,v_proj), greedy, 48 tokens a round, with the NF4 kernels
dequantised by the pair lookup and by the halves (slm.model.nf4.layout_for), rounds alternated: median ms a token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from slm.train.throughput import cpu_model  # noqa: E402
from train_optimized import Config, train  # noqa: E402

DATA = os.path.join(ROOT, "..", "shared", "data")


def pretrained_base(tmp: str, target_params: int, steps: int) -> str:
    """A from-scratch run on tinystories, exported as a transformers folder; returns the folder."""
    from slm.cli.export import main as export_main

    run = os.path.join(tmp, "base-run")
    train(Config(use_streaming=True, dataset_id=os.path.join(DATA, "tinystories_train.txt"), target_params=target_params,
                 seq_len=128, batch_size=16, max_steps=steps, eval_every=10**9, output_dir=run), log=lambda *_: None)
    folder = os.path.join(tmp, "base")
    assert export_main(["--run", run, "--out", folder]) == 0
    return folder


def quantisation_error(folder: str) -> str:
    """Relative RMS error of NF4 over every block kernel of the folder, and the worst kernel's."""
    from slm.io.hf_import import load_hf_folder
    from slm.model import nf4

    shape, params, _ = load_hf_folder(folder)
    sq_err = sq = 0.0
    worst = 0.0
    for i in range(shape.n_layers):
        for (part, name), (n_in, n_out) in nf4.kernel_shapes(shape).items():
            k = np.asarray(params[f"block_{i}"][part][name]["kernel"], np.float32)
            back = nf4.dequantize(nf4.quantize(k), n_in, n_out)
            e, s = float(((back - k) ** 2).sum()), float((k ** 2).sum())
            sq_err, sq, worst = sq_err + e, sq + s, max(worst, (e / s) ** 0.5)
    return f"NF4 relative RMS error over the base's block kernels: {(sq_err / sq) ** 0.5:.4f} (worst kernel {worst:.4f})"


def lora_run(tmp: str, folder: str, dtype: str, seed: int, steps: int) -> tuple[dict, list[float], float]:
    """(summary, training loss per step, median step ms) of one LoRA run."""
    out = os.path.join(tmp, f"lora-{dtype}-{seed}")
    s = train(Config(use_streaming=True, init_from=folder, dataset_id=os.path.join(DATA, "tinyshakespeare_train.txt"),
                     eval_dataset_id=os.path.join(DATA, "tinyshakespeare_val.txt"), seq_len=128, batch_size=8,
                     lora_rank=16, lora_alpha=32, base_dtype=dtype, max_steps=steps, seed=seed,
                     learning_rate=2e-3, eval_every=10**9, log_every=1, output_dir=out,
                     lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"), log=lambda *_: None)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    losses = [r["loss"] for r in rows if "loss" in r]
    times = [1e3 * 8 * 128 / r["tokens_per_sec"] for r in rows if r.get("tokens_per_sec")][5:]  # past warm-up
    return s, losses, statistics.median(times) if times else float("nan")


def decode_speed(model_dir: str, rounds: int = 3, tokens: int = 48) -> None:
    from slm.train.devices import import_jax_quietly

    import_jax_quietly()
    import jax

    from slm.memory.finetune import model_shape
    from slm.model import decode, nf4
    from slm.model.generate import Decoder, generate_ids
    from slm.model.lora import LoraSpec, merge, split
    from slm.model.transformer import Transformer, init_params

    shape = model_shape(os.path.join(ROOT, "..", "shared", "models", model_dir))
    lora = LoraSpec(16, 32.0, 0.0, ("q_proj", "v_proj"))
    base, adapters = split(jax.tree.map(np.asarray, init_params(Transformer(shape, lora=lora), 0, 8)))
    held, model = merge(nf4.quantize_params(base), adapters), Transformer(shape, lora=lora, nf4=True)
    decoders, times = {}, {"pairs": [], "halves": []}
    for layout in times:  # the decoder's layout is chosen when it traces: each Decoder compiles its own
        decode.layout_for = lambda platform, decoding=False, layout=layout: layout
        decoders[layout] = Decoder(model)
        generate_ids(model, held, [1, 2, 3, 4], 4, decoder=decoders[layout])
    for _ in range(rounds):
        for layout, d in decoders.items():
            t = time.perf_counter()
            generate_ids(model, held, [1, 2, 3, 4], tokens, decoder=d, temperature=0.0)
            times[layout].append((time.perf_counter() - t) / tokens * 1e3)
    pairs, halves = (statistics.median(times[k]) for k in ("pairs", "halves"))
    rounds_ms = {k: ", ".join(f"{x:.1f}" for x in v) for k, v in times.items()}
    print(f"{model_dir} QLoRA sampler, {jax.default_backend()}: pairs {pairs:.1f} ms a token, halves {halves:.1f} "
          f"(pairs / halves {pairs / halves:.2f}x; rounds: pairs {rounds_ms['pairs']}, halves {rounds_ms['halves']})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-params", type=int, default=4_000_000)
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--lora-steps", type=int, default=150)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--base", default=None, metavar="DIR", help="a base folder from an earlier run (skips pretraining)")
    p.add_argument("--decode", default=None, metavar="MODEL", help="time the sampler's NF4 lookups instead")
    a = p.parse_args()
    print(f"host: {cpu_model()}, {time.strftime('%Y-%m-%d')}")
    if a.decode:
        return decode_speed(a.decode)
    tmp = tempfile.mkdtemp(prefix="qlora_")
    folder = a.base or pretrained_base(tmp, a.target_params, a.base_steps)
    print(quantisation_error(folder))
    curves: dict = {}
    print("| base | seed | eval loss | final train loss (mean of last 10) | median step ms |")
    print("|---|---|---|---|---|")
    for seed in (int(s) for s in a.seeds.split(",")):
        for dtype in ("bfloat16", "nf4"):
            s, losses, ms = lora_run(tmp, folder, dtype, seed, a.lora_steps)
            curves[(dtype, seed)] = np.asarray(losses)
            print(f"| {dtype} | {seed} | {s['eval_loss']:.4f} | {np.mean(losses[-10:]):.4f} | {ms:.1f} |", flush=True)
    seeds = sorted({k[1] for k in curves})
    arm_gap = max(float(np.abs(curves[("nf4", s)] - curves[("bfloat16", s)])[10:].mean()) for s in seeds)
    seed_gap = float(np.abs(curves[("bfloat16", seeds[0])] - curves[("bfloat16", seeds[-1])])[10:].mean())
    print(f"mean |nf4 - bf16| training loss past step 10, same seed (worst seed): {arm_gap:.4f}; "
          f"bf16 seed {seeds[0]} vs seed {seeds[-1]}: {seed_gap:.4f}")


if __name__ == "__main__":
    main()
