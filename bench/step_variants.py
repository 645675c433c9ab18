"""Model-code levers for step speed, in one process, interleaved: where a step's time goes, and attention and
cross-entropy variants against the trainer's own.

    .venv/bin/python bench/step_variants.py                  # nanoGPT's baby shape: 4 x 128, vocab 65, seq 64, batch 12
    .venv/bin/python bench/step_variants.py --target-params 800000 --seq-len 128 --batch-size 32
    .venv/bin/python bench/step_variants.py --floor-only     # phases and the matmul floor only

The trainer's jitted step (AdamW, one host device per core, the batch split, a sync per step as the trainer
does on multi-device CPU). First the phases of the base step (forward, forward + backward, the optimizer
update, the whole step; median of 7 rounds of 30 calls) and its floor: the step's matrix products alone, at
its shapes, split over the devices as the step is (`--floor-only` stops there). Then slm.model.transformer's
attention or per-token loss swapped for a variant:

  base        the trainer's einsum attention with a where-mask; logsumexp minus a gathered target logit
  sdpa        jax.nn.dot_product_attention(implementation="xla", is_causal=True)
  bias        an additive -1e30 mask instead of where
  ce_optax    optax.softmax_cross_entropy_with_integer_labels
  ce_onehot   the target logit by a one-hot product (no gather, whose gradient is a scatter)

Each variant's first loss is printed (the same math: they must agree to float rounding); then --rounds
rounds of 30 steps per variant, interleaved, and each variant's median against base's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slm.train.devices import configure_cpu_devices  # noqa: E402

configure_cpu_devices()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from slm.model.matmul import bf16_linear  # noqa: E402
import slm.model.transformer as T  # noqa: E402
import slm.train.step as S  # noqa: E402
from slm.model.sizing import ModelShape, choose_shape  # noqa: E402
from slm.optim.optimizer import make_optimizer  # noqa: E402
from slm.train.devices import data_mesh, shardings  # noqa: E402

BASE_ATTEND, BASE_NLL = T.attend, T.token_nll


def sdpa(q, k, v, mask, dtype):
    if mask.ndim == 2 and q.shape[2] == k.shape[2]:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla").astype(dtype)
    return BASE_ATTEND(q, k, v, mask, dtype)


def bias_attend(q, k, v, mask, dtype):
    K = q.shape[-1]
    logits = jnp.einsum("bqhk,bshk->bhqs", q * (K**-0.5), k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits + jnp.where(mask, 0.0, -1e30).astype(jnp.float32), axis=-1).astype(dtype)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v)


def ce_optax(model, params, ids, targets, dropout_rng=None):
    logits = model.apply({"params": params}, ids)
    return jnp.where(targets >= 0, optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0)), 0.0)


def ce_onehot(model, params, ids, targets, dropout_rng=None):
    logits = model.apply({"params": params}, ids)
    hot = jax.nn.one_hot(jnp.maximum(targets, 0), logits.shape[-1], dtype=logits.dtype)
    return jnp.where(targets >= 0, jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * hot, axis=-1), 0.0)


VARIANTS = {"base": (BASE_ATTEND, BASE_NLL), "sdpa": (sdpa, BASE_NLL), "bias": (bias_attend, BASE_NLL),
            "ce_optax": (BASE_ATTEND, ce_optax), "ce_onehot": (BASE_ATTEND, ce_onehot)}


def median_ms(f, rounds: int, n: int = 30) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            jax.block_until_ready(f())
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times) * 1e3


def phases(shape, batch, rep, rounds: int, matmul: str = "float32") -> None:
    """Forward, forward + backward, optimizer update and the whole step of the base model."""
    model, tx = T.Transformer(shape, matmul=matmul), make_optimizer()
    params = jax.device_put(T.init_params(model, 0, batch["input_ids"].shape[1]), rep)
    loss = lambda p, x, y: T.mean_nll(T.token_nll(model, p, x, y), y)  # noqa: E731 (batch as arguments: split)
    fwd, grad = jax.jit(loss), jax.jit(jax.value_and_grad(loss))
    x, y = batch["input_ids"], batch["targets"]
    grads, opt_state = grad(params, x, y)[1], jax.device_put(tx.init(params), rep)
    update = jax.jit(lambda g, s, p: tx.update(g, s, p))
    state, step = jax.device_put(S.init_state(params, tx), rep), S.make_train_step(model, tx)
    holder = [state]

    def whole():
        holder[0], m = step(holder[0], batch, np.float32(1e-3))
        return m["loss"]

    for name, f in (("forward", lambda: fwd(params, x, y)), ("forward + backward", lambda: grad(params, x, y)),
                    ("optimizer update", lambda: update(grads, opt_state, params)), ("whole step", whole)):
        f()
        print(f"  {name:>20}: {median_ms(f, rounds):.2f} ms", flush=True)


def gemm_floor(shape, batch, rep, rounds: int, matmul: str = "float32") -> float:
    """The step's matrix products alone, as one jitted program on the same split batch: per linear layer the
    forward x @ W and the backward dY @ W^T and x^T @ dY (whose batch contraction all-reduces over the
    devices, as the gradients do); per head the score and value products, forward and backward. Nothing
    else (no softmax, norms, activations, loss or optimizer): a step cannot be faster than this. With `matmul`
    bfloat16 the linear layers' three products are the trainer's own (slm.model.matmul.bf16_linear and its
    VJP); attention's stay float32, as in the model."""
    B, L = batch["input_ids"].shape
    D, F, V, H, K = shape.d_model, shape.d_ff, shape.vocab_size, shape.n_heads, shape.head_dim
    G = shape.kv_heads
    linears = [(D, (H + 2 * G) * K), (H * K, D), (D, 2 * F), (F, D)] * shape.n_layers + [(D, V)]
    rng = np.random.default_rng(0)
    ws = [jax.device_put(rng.standard_normal(io, np.float32) * 0.02, rep) for io in linears]
    split = batch["input_ids"].sharding
    xs = [jax.device_put(rng.standard_normal((B, L, i), np.float32), split) for i, _ in linears]
    ys = [jax.device_put(rng.standard_normal((B, L, o), np.float32), split) for _, o in linears]
    q = jax.device_put(rng.standard_normal((B, H, L, K), np.float32), split)

    @jax.jit
    def products(ws, xs, ys, q):
        acc = jnp.float32(0)
        for w, x, dy in zip(ws, xs, ys):
            if matmul == "bfloat16":
                y, vjp = jax.vjp(bf16_linear, x, w)
                dx, dw = vjp(dy)
            else:
                y, dx, dw = x @ w, dy @ w.T, jnp.einsum("bli,blo->io", x, dy)
            acc += y[0, 0, 0] + dx[0, 0, 0] + dw[0, 0]
        # q stands in for q, k, v and d(out): s = q k^T, o = s v; dp = do v^T, dv = s^T do, dq = dp k, dk = dp^T q
        for _ in range(shape.n_layers):
            s = jnp.einsum("bhqk,bhsk->bhqs", q, q)
            o = jnp.einsum("bhqs,bhsk->bhqk", s, q)
            ds = jnp.einsum("bhqk,bhsk->bhqs", o, q)
            dv = jnp.einsum("bhqs,bhqk->bhsk", s, o)
            dq = jnp.einsum("bhqs,bhsk->bhqk", ds, q)
            dk = jnp.einsum("bhqs,bhqk->bhsk", ds, q)
            acc += o[0, 0, 0, 0] + dv[0, 0, 0, 0] + dq[0, 0, 0, 0] + dk[0, 0, 0, 0]
        return acc

    f = lambda: products(ws, xs, ys, q)  # noqa: E731
    f()
    ms = median_ms(f, rounds)
    flops = 6 * sum(i * o for i, o in linears) * B * L + shape.n_layers * 12 * B * H * L * L * K
    print(f"  {'matmuls only':>20}: {ms:.2f} ms ({flops / ms / 1e6:.1f} GFLOP/s on {flops / 1e9:.2f} GFLOP: the "
          f"step's floor at the rate XLA runs these shapes)", flush=True)
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-params", type=int, default=None, help="choose_shape(N, 1024) (default: nanoGPT's baby)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--floor-only", action="store_true", help="the phases and the matmul floor, no variants")
    p.add_argument("--matmul-precision", default="float32", choices=("float32", "bfloat16"),
                   help="the trainer's --matmul-precision for the phases and the floor (the variants: float32)")
    a = p.parse_args()
    shape = (choose_shape(a.target_params, 1024) if a.target_params
             else ModelShape(n_layers=4, d_model=128, n_heads=4, d_ff=344, vocab_size=65))
    mesh = data_mesh(a.batch_size)
    rep, split = shardings(mesh)
    ids = np.random.default_rng(0).integers(0, shape.vocab_size, (a.batch_size, a.seq_len + 1)).astype(np.int32)
    batch = {"input_ids": jax.device_put(ids[:, :-1], split), "targets": jax.device_put(ids[:, 1:], split)}
    print(f"step_variants: {time.strftime('%Y-%m-%d %H:%M')}, {shape}, seq {a.seq_len}, batch {a.batch_size}, "
          f"{mesh.devices.size} devices, {a.matmul_precision} matmuls", flush=True)
    phases(shape, batch, rep, a.rounds, a.matmul_precision)
    gemm_floor(shape, batch, rep, a.rounds, a.matmul_precision)
    if a.floor_only:
        return
    runs = {}
    for name, (attend, nll) in VARIANTS.items():
        T.attend, S.token_nll = attend, nll  # read when the step is traced (its first call, below)
        model, tx = T.Transformer(shape), make_optimizer()
        state = jax.device_put(S.init_state(T.init_params(model, 0, a.seq_len), tx), rep)
        step = S.make_train_step(model, tx)
        state, m = step(state, batch, np.float32(1e-3))
        runs[name] = {"step": step, "state": state, "times": [], "loss0": float(m["loss"])}
    T.attend, S.token_nll = BASE_ATTEND, BASE_NLL
    for _ in range(a.rounds):
        for r in runs.values():
            t = time.perf_counter()
            for _ in range(30):
                r["state"], m = r["step"](r["state"], batch, np.float32(1e-3))
                m["loss"].block_until_ready()
            r["times"].append((time.perf_counter() - t) / 30)
    base = statistics.median(runs["base"]["times"])
    for name, r in runs.items():
        med = statistics.median(r["times"])
        print(f"  {name:>12}: {med * 1e3:.2f} ms (first loss {r['loss0']:.5f}) | {base / med:.3f}x base's speed")


if __name__ == "__main__":
    main()
