"""Optimizer and schedule levers at a fixed time budget, measured outside the trainer (slm/ is not changed).

    .venv/bin/python bench/levers.py                         # 4 variants x 2 seeds, 280 AdamW steps each (~16 min)
    .venv/bin/python bench/levers.py --steps 100 --seeds 0   # a quick look
    .venv/bin/python bench/levers.py --variants adamw-cosine,muon-cosine --muon-lr 0.01,0.02,0.04

The quality race's setting: tinyshakespeare_train.txt, the trainer's 800K-parameter shape (4 x 128, d_ff 264,
its byte-level BPE of 1,024 tokens trained on the train file), seq 128, batch 32, the trainer's default peak
learning rate for that size (6e-4 * sqrt(125M / N) = 7.5e-3), 100 warm-up steps (not capped: the race's
--max-time run does not know its length; --warmup-cap caps them at 20% as a --max-steps run does), gradient clip 1.0, weight decay
0.1 on matrices, the trainer's StreamingDataLoader (seeded: the same batches for every variant of a seed) and
the trainer's model code; one host device. Scored on the whole val split (tinyshakespeare_val.txt, the trainer's
eval-set packing, non-overlapping 128-token rows) in bits per byte of the file (nats / ln 2 / 111,540).

Optimizers (the schedules built here with optax; Muon's split is the trainer's, slm.optim.muon.partition_muon):
  adamw  the trainer's: clip -> Adam (b1 0.9, b2 0.95, eps 1e-8) -> decoupled weight decay on matrices -> lr.
  muon   clip -> optax.partition: the hidden matrices (attention q, k, v and o; MLP gate, up and down) get
         optax.contrib.muon (Nesterov momentum 0.95, 5 Newton-Schulz steps, its width scaling, weight decay 0.1,
         peak lr --muon-lr); the embedding (= the tied output layer) and the norm scales get the adamw chain
         above with its lr. The fused qkv (D, 3D) and gate_up (D, 2F) kernels are viewed as (D, 3, D) and
         (D, 2, F) so q, k, v, gate and up are orthogonalised as separate matrices.
Schedules (progress = step / the variant's step budget):
  cosine the trainer's: linear warm-up, then cosine from the peak to 10% of it over the rest.
  wsd    warm-up-stable-decay: linear warm-up, the peak until --decay-frac of the budget is left, then linear to 0.

A fixed time budget, without letting other programs' load decide the step count: the budget is --steps
steps of the trainer's AdamW (280: what the quality race's ~93 s gave the trainer on 2026-11-24, quiet),
and every variant gets the same time: steps x (AdamW's step time / its own), both step times measured here
first, interleaved (rounds of one window per optimizer, median over --rounds), so the ratio holds whatever the
load (the schedule choice costs nothing; Muon's Newton-Schulz iterations do). Each variant is trained with every seed (init and data order), and the table gives mean, spread (min-max)
and the difference from adamw-cosine (the trainer's recipe) with its seed spread.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DATA = os.path.join(ROOT, "..", "shared", "data")

import jax
import jax.numpy as jnp
import numpy as np
import optax

from slm.data.heldout import build_eval_set
from slm.data.readers import read_file
from slm.data.sources import resolve_source
from slm.data.stream import StreamingDataLoader
from slm.data.tokenizer import special_ids, train_bpe
from slm.model.sizing import choose_shape, count_params, default_learning_rate
from slm.model.transformer import Transformer, init_params, mean_nll, token_nll
from slm.optim.muon import partition_muon
from slm.train.step import make_eval_step

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=280, help="the time budget, in steps of the trainer's AdamW")
    p.add_argument("--seeds", default="0,1", help="comma list")
    p.add_argument("--variants", default="adamw-cosine,adamw-wsd,muon-cosine,muon-wsd",
                   help="comma list of OPTIMIZER-SCHEDULE (adamw|muon)-(cosine|wsd)")
    p.add_argument("--muon-lr", default="0.02", help="Muon's peak lr (comma list: each is a variant)")
    p.add_argument("--decay-frac", type=float, default=0.2, help="wsd: fraction of the budget spent decaying")
    p.add_argument("--target-params", type=int, default=800_000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps (the trainer's default)")
    p.add_argument("--warmup-cap", action="store_true",
                   help="cap warm-up at 20%% of each variant's steps, as the trainer does for --max-steps runs "
                        "(default: uncapped, as for the quality race's --max-time run)")
    p.add_argument("--rounds", type=int, default=5, help="step-time rounds (median)")
    p.add_argument("--window", type=int, default=20, help="steps per step-time window")
    return p.parse_args()


# ---------------------------------------------------------------- schedules and optimizers

def schedule(kind: str, peak: float, warmup: int, total: int, decay_frac: float):
    """lr(step). `warmup` is used whole, as in a --max-time run (a --max-steps run caps it at 20% of the run:
    pass --warmup-cap to do that here)."""

    def lr(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * (step + 1) / max(warmup, 1)
        if kind == "cosine":  # slm.optim.schedule.lr_at with progress = step / total
            p = jnp.clip((step / total - warmup / total) / (1 - warmup / total), 0.0, 1.0)
            after = peak * (0.1 + 0.9 * 0.5 * (1 + jnp.cos(jnp.pi * p)))
        else:
            left = 1.0 - step / total
            after = peak * jnp.clip(left / decay_frac, 0.0, 1.0)
        return jnp.where(step < warmup, warm, after)

    return lr


def adam_direction(lr, weight_decay: float = 0.1) -> optax.GradientTransformation:
    """AdamW's direction times the (scheduled) rate, not negated: the trainer's AdamW chain with the rate in it."""
    return optax.chain(optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
                       optax.add_decayed_weights(weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
                       optax.scale_by_learning_rate(lr, flip_sign=False))


def make_tx(optimizer: str, adam_lr, muon_lr) -> optax.GradientTransformation:
    """clip -> AdamW, or the trainer's Muon split (slm.optim.muon: Muon at `muon_lr` on the hidden matrices,
    fused kernels as their parts) with AdamW on the rest -> negated into an update, as make_optimizer + the
    train step do."""
    direction = adam_direction(adam_lr)
    if optimizer == "muon":
        direction = partition_muon(direction, muon_lr, weight_decay=0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), direction, optax.scale(-1.0))


# ---------------------------------------------------------------- training

class Setup:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        train = os.path.join(DATA, "tinyshakespeare_train.txt")
        val = os.path.join(DATA, "tinyshakespeare_val.txt")
        self.train = train
        self.tok = train_bpe(read_file(train), 1024)
        self.special = special_ids(self.tok)
        self.shape = choose_shape(a.target_params, self.tok.get_vocab_size())
        self.model = Transformer(self.shape)
        self.n_params = count_params(self.shape)
        self.adam_peak = default_learning_rate(self.n_params)
        self.eval_set = build_eval_set(resolve_source(val).documents(), self.tok, a.seq_len, None, val, self.special)
        with open(val, "rb") as f:
            self.val_bytes = len(f.read())
        self.eval_step = make_eval_step(self.model)

    def loader(self, seed: int) -> StreamingDataLoader:
        return StreamingDataLoader(self.train, self.tok, seq_len=self.a.seq_len, batch_size=self.a.batch_size,
                                   seed=seed, special=self.special, prefetch=2)

    def step_fn(self, tx: optax.GradientTransformation):
        model = self.model

        def step(params, opt_state, ids, targets):
            loss, grads = jax.value_and_grad(lambda p: mean_nll(token_nll(model, p, ids, targets), targets))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return jax.jit(step, donate_argnums=(0, 1))

    def bpb(self, params) -> float:
        es, B, nats = self.eval_set, 64, 0.0
        for i in range(0, len(es.inputs), B):
            x, y, m = es.inputs[i: i + B], es.targets[i: i + B], es.mask[i: i + B]
            if len(x) < B:
                pad = ((0, B - len(x)), (0, 0))
                x, y, m = np.pad(x, pad), np.pad(y, pad), np.pad(m, pad)
            s, _ = self.eval_step(params, x, y, m)
            nats += float(s)
        return nats / math.log(2) / self.val_bytes


def batches(loader: StreamingDataLoader):
    epoch = 0
    while True:
        yield from loader.iter_epoch(epoch)
        epoch += 1


def variant_parts(name: str) -> tuple[str, str, float | None]:
    """'muon@0.02-wsd' -> ('muon', 'wsd', 0.02)."""
    opt, sched = name.split("-")
    lr = float(opt.split("@")[1]) if "@" in opt else None
    return opt.split("@")[0], sched, lr


def step_times(s: Setup, optimizers: list[str]) -> dict:
    """Median seconds per step for each optimizer (its learning rate costs nothing), measured in interleaved
    windows on one fixed batch."""
    batch = next(iter(s.loader(0).iter_epoch(0)))
    ids, targets = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["targets"])
    runs = {}
    for opt in optimizers:
        tx = make_tx(opt, 1e-3, 0.02)
        params = init_params(s.model, 0, s.a.seq_len)
        state = tx.init(params)
        step = s.step_fn(tx)
        for _ in range(3):  # compile, warm up
            params, state, loss = step(params, state, ids, targets)
        loss.block_until_ready()
        runs[opt] = [step, params, state, []]
    for _ in range(s.a.rounds):
        for r in runs.values():
            step, params, state, times = r
            t = time.perf_counter()
            for _ in range(s.a.window):
                params, state, loss = step(params, state, ids, targets)
            loss.block_until_ready()
            times.append((time.perf_counter() - t) / s.a.window)
            r[1], r[2] = params, state
    return {k: statistics.median(r[3]) for k, r in runs.items()}


def train_one(s: Setup, opt: str, sched: str, muon_lr: float | None, steps: int, seed: int) -> dict:
    a = s.a
    warmup = min(a.warmup, steps // 5) if a.warmup_cap else a.warmup
    adam_lr = schedule(sched, s.adam_peak, warmup, steps, a.decay_frac)
    mlr = schedule(sched, muon_lr, warmup, steps, a.decay_frac) if opt == "muon" else None
    tx = make_tx(opt, adam_lr, mlr)
    params = init_params(s.model, seed, a.seq_len)
    state = tx.init(params)
    step = s.step_fn(tx)
    it = batches(s.loader(seed))
    t0 = time.perf_counter()
    losses = []
    for _ in range(steps):
        b = next(it)
        params, state, loss = step(params, state, b["input_ids"], b["targets"])
        losses.append(loss)
    train_loss = float(np.mean(jax.device_get(losses[-20:])))
    wall = time.perf_counter() - t0
    return {"bpb": s.bpb(params), "train_loss": train_loss, "wall_s": wall}


def main() -> None:
    a = parse_args()
    seeds = [int(x) for x in a.seeds.split(",")]
    muon_lrs = [float(x) for x in a.muon_lr.split(",")]
    names = []
    for v in a.variants.split(","):
        opt, sched = v.split("-")
        names += [f"muon@{lr:g}-{sched}" for lr in muon_lrs] if opt == "muon" else [v]
    with open("/proc/loadavg") as f:
        load0 = ", ".join(f.read().split()[:3])
    print(f"levers: {time.strftime('%Y-%m-%d %H:%M')}, jax {jax.__version__}, optax {optax.__version__}, "
          f"{os.cpu_count()} cpus, load average {load0}; budget: the time of {a.steps} AdamW steps; seeds {seeds}", flush=True)
    s = Setup(a)
    sh = s.shape
    print(f"model {s.n_params:,} params ({sh.n_layers}x{sh.d_model}, d_ff {sh.d_ff}, vocab {sh.vocab_size}), "
          f"seq {a.seq_len}, batch {a.batch_size}, adamw peak lr {s.adam_peak:.2e}; val {s.val_bytes:,} bytes", flush=True)
    opts = sorted({variant_parts(n)[0] for n in names} | {"adamw"})
    times = step_times(s, opts)
    base_t = times["adamw"]
    budget = {k: max(1, int(a.steps * base_t / t)) for k, t in times.items()}
    for opt, t in times.items():
        print(f"  step time {opt}: {t * 1e3:.1f} ms (median of {a.rounds} interleaved windows, {t / base_t:.3f}x "
              f"AdamW's) -> {budget[opt]} steps", flush=True)
    results = {n: [] for n in names}
    for seed in seeds:  # seeds outermost: a load change hits every variant of a seed alike
        for n in names:
            opt, sched, mlr = variant_parts(n)
            steps = budget[opt]
            r = train_one(s, opt, sched, mlr, steps, seed)
            r["steps"] = steps
            results[n].append(r)
            print(f"  {n:>18} seed {seed}: {steps} steps, val {r['bpb']:.4f} bits/byte (train loss {r['train_loss']:.3f}, "
                  f"{r['wall_s']:.0f}s)", flush=True)
    with open("/proc/loadavg") as f:
        load1 = ", ".join(f.read().split()[:3])
    base = [r["bpb"] for r in results.get("adamw-cosine", [])]
    print(f"\nload average at the end {load1}\n")
    print(f"| variant | steps (= {a.steps} AdamW steps' time) | val bits/byte, mean (min-max over {len(seeds)} seeds) "
          f"| vs adamw-cosine (per seed: mean, min-max) |")
    print("|---|---|---|---|")
    for n, rs in results.items():
        b = [r["bpb"] for r in rs]
        diff = "-"
        if base and n != "adamw-cosine":
            d = [x - y for x, y in zip(b, base)]
            diff = f"{statistics.mean(d):+.4f} ({min(d):+.4f} to {max(d):+.4f})"
        print(f"| {n} | {rs[0]['steps']} | {statistics.mean(b):.4f} ({min(b):.4f}-{max(b):.4f}) | {diff} |")


if __name__ == "__main__":
    main()
