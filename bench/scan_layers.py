"""Compile time and step time of the train step with its layers unrolled (the trainer) or in one `lax.scan`.

    .venv/bin/python bench/scan_layers.py                # ~6 min on 2 cores
    .venv/bin/python bench/scan_layers.py --sizes 1e6,1e7 --hf-models smollm2-135m --reps 2

Issue 17 lists `scan` over layers as a lever for compile time. This measures it before changing the trainer:
the same math written two ways, on the trainer's own `Block` module:
  unrolled: `Transformer.apply`, one copy of the block per layer in the program (what the trainer compiles);
  scanned:  the block's params stacked on a leading layer axis and one block body run by `jax.lax.scan`.
Each is a jitted AdamW step (loss, gradients, `optax.adamw` update; float32, one host device) lowered and
compiled from abstract shapes, so the pretrained sizes (../shared/models config.json files) compile without
their weights. Compile times are the median of --reps fresh compiles, unrolled and scanned alternating.
For --sizes small enough to run here it also times the step (median of --steps after 2 warm-up steps) and
checks that both give the same loss and gradients on the same params.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax

from slm.model.hf_config import shape_from_hf_config
from slm.model.sizing import ModelShape, choose_shape, count_params, default_vocab_size
from slm.model.transformer import (
    Block,
    RMSNorm,
    Transformer,
    init_params,
    mean_nll,
)

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "models")


def stack_blocks(params: dict, n_layers: int) -> dict:
    """The trainer's tree (block_0 .. block_{n-1}) -> {"blocks": leaves stacked on a leading layer axis, rest}."""
    rest = {k: v for k, v in params.items() if not k.startswith("block_")}
    layers = [params[f"block_{i}"] for i in range(n_layers)]
    return {**rest, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def scanned_logits(model: Transformer, params: dict, ids_BxL: jax.Array) -> jax.Array:
    """`Transformer.apply` with the layers in one `lax.scan` over `stack_blocks` params (tied or untied head)."""
    embed_VxD = params["embed"]
    x_BxLxD = jnp.take(embed_VxD, ids_BxL, axis=0).astype(model.dtype)
    block = Block(model.shape, model.dtype)

    def body(x, block_params):
        return block.apply({"params": block_params}, x), None

    x_BxLxD, _ = jax.lax.scan(body, x_BxLxD, params["blocks"])
    x_BxLxD = RMSNorm(model.shape.norm_eps).apply({"params": params["final_norm"]}, x_BxLxD)
    head_VxD = embed_VxD if model.shape.tie_embeddings else params["unembed"]
    return jnp.einsum("bld,vd->blv", x_BxLxD, head_VxD.astype(model.dtype), preferred_element_type=jnp.float32)


def loss_fn(logits_fn, model: Transformer, params, ids_BxL, targets_BxL) -> jax.Array:
    logits = logits_fn(model, params, ids_BxL)
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets_BxL[..., None], -1)[..., 0]
    return mean_nll(nll, targets_BxL)


def unrolled_logits(model: Transformer, params: dict, ids_BxL: jax.Array) -> jax.Array:
    return model.apply({"params": params}, ids_BxL)


def make_step(logits_fn, model: Transformer, tx: optax.GradientTransformation):
    def step(params, opt_state, ids, targets):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(logits_fn, model, p, ids, targets))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return jax.jit(step, donate_argnums=(0, 1))


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def compile_seconds(step, params_abs, opt_abs, batch_abs) -> float:
    jax.clear_caches()
    t = time.perf_counter()
    step.lower(params_abs, opt_abs, *batch_abs).compile()
    return time.perf_counter() - t


def measure(name: str, shape: ModelShape, a: argparse.Namespace, run: bool) -> dict:
    model = Transformer(shape)
    tx = optax.adamw(1e-3, weight_decay=0.1)
    ids = jnp.zeros((1, a.seq_len), jnp.int32)
    params_abs = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ids)["params"])
    stacked_abs = jax.eval_shape(lambda p: stack_blocks(p, shape.n_layers), params_abs)
    batch_abs = [jax.ShapeDtypeStruct((a.batch, a.seq_len), jnp.int32)] * 2
    variants = {"unrolled": (unrolled_logits, params_abs), "scanned": (scanned_logits, stacked_abs)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.reps):
        for k, (fn, p_abs) in variants.items():
            step = make_step(fn, model, tx)
            times[k].append(compile_seconds(step, p_abs, jax.eval_shape(tx.init, p_abs), batch_abs))
    row = {"name": name, "params": count_params(shape), "layers": shape.n_layers, "d_model": shape.d_model,
           **{f"compile_{k}_s": statistics.median(v) for k, v in times.items()}}
    if run:
        row.update(run_both(model, tx, a))
    return row


def run_both(model: Transformer, tx: optax.GradientTransformation, a: argparse.Namespace) -> dict:
    """Median step time of each variant on the same params and batch, and the largest loss/grad difference."""
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, model.shape.vocab_size, (a.batch, a.seq_len)), jnp.int32)
    targets = jnp.roll(ids, -1, axis=1)
    params = init_params(model, 0, a.seq_len)
    stacked = stack_blocks(params, model.shape.n_layers)
    g_unrolled = jax.grad(lambda p: loss_fn(unrolled_logits, model, p, ids, targets))(params)
    g_scanned = jax.grad(lambda p: loss_fn(scanned_logits, model, p, ids, targets))(stacked)
    diff = float(max(jax.tree.leaves(jax.tree.map(
        lambda x, y: jnp.max(jnp.abs(x - y)), stack_blocks(g_unrolled, model.shape.n_layers), g_scanned))))
    out = {"max_grad_diff": diff}
    for k, fn, p in (("unrolled", unrolled_logits, params), ("scanned", scanned_logits, stacked)):
        step = make_step(fn, model, tx)
        p, s = jax.tree.map(jnp.copy, p), tx.init(p)
        times = []
        for i in range(a.steps + 2):
            t = time.perf_counter()
            p, s, loss = step(p, s, ids, targets)
            loss.block_until_ready()
            if i >= 2:
                times.append(time.perf_counter() - t)
        out[f"step_{k}_ms"] = statistics.median(times) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e6,1e7,1e8", help="--target-params sizes to compile, and to run up to --run-below")
    ap.add_argument("--hf-models", default="smollm2-135m,qwen2.5-0.5b,tinyllama-1.1b,mistral-7b-v0.1",
                    help="../shared/models folders to compile (abstract shapes only)")
    ap.add_argument("--run-below", type=float, default=2e7, help="also time steps of --sizes below this")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    print(f"scan_layers: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, jax {jax.__version__}, {os.cpu_count()} cpus, "
          f"batch {a.batch} x seq {a.seq_len}, median of {a.reps} compiles", flush=True)
    jobs = [(f"{float(s):.0e}", choose_shape(int(float(s)), default_vocab_size(int(float(s)))), float(s) < a.run_below)
            for s in a.sizes.split(",") if s]
    for m in (x for x in a.hf_models.split(",") if x):
        with open(os.path.join(MODELS, m, "config.json")) as f:
            jobs.append((m, shape_from_hf_config(json.load(f)), False))
    rows = []
    for name, shape, run in jobs:
        row = measure(name, shape, a, run)
        rows.append(row)
        extra = (f" | step {row['step_unrolled_ms']:.1f} / {row['step_scanned_ms']:.1f} ms "
                 f"(scanned {row['step_unrolled_ms'] / row['step_scanned_ms']:.2f}x), max |grad diff| "
                 f"{row['max_grad_diff']:.1e}") if run else ""
        print(f"{name:16s} {row['params'] / 1e6:8.1f}M {row['layers']:3d} x {row['d_model']:5d} | compile unrolled "
              f"{row['compile_unrolled_s']:6.2f} s, scanned {row['compile_scanned_s']:6.2f} s "
              f"({row['compile_unrolled_s'] / row['compile_scanned_s']:.2f}x faster){extra}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
