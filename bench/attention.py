"""Causal attention, forward + backward: the blocked attention the model runs (slm.model.attention) against
the whole-square einsum attention it replaced (slm.model.transformer.attend, still the decoder's) and,
with --against REV, against the blocked attention of an earlier git revision.

    .venv/bin/python bench/attention.py                         # the shapes below, the default block
    .venv/bin/python bench/attention.py --blocks 64,128,256     # each block size too
    .venv/bin/python bench/attention.py --bf16                  # bf16 operands, float32 sums
    .venv/bin/python bench/attention.py --devices 2 --against HEAD~1             # as the trainer runs it
    .venv/bin/python bench/attention.py --step --against HEAD~1 --seq 1024 --batch 2   # in the train step

Each row: one jitted value-and-gradient of sum(attention(q, k, v) * w) over random float32 inputs, median of
--repeats calls after a warm-up, the versions alternated in one process; ratios are other / today's.
--devices N splits the batch over N host devices, one per core, as the trainer does (the ops then run on
one core each, where a single device spreads them over all cores: the two regimes rank versions differently).

--step times the trainer's own step (bench/profile_step.py's: from scratch at nanoGPT's 10M shape, or LoRA
with --lora) with today's attention, REV's, and a second copy of today's module (a control: the same program
compiled twice, whose ratio shows the sitting's noise), alternated over --rounds rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = {  # name: (batch, seq, query heads, kv heads, head dim)
    "the main job (1M), seq 128 x 16 a device": (16, 128, 4, 4, 32),
    "nanoGPT's baby shape, seq 64 x 6 a device": (6, 64, 4, 4, 32),
    "LoRA race (SmolLM2-135M), seq 256 x 4": (4, 256, 9, 3, 64),
    "from scratch 10M, seq 256 x 8": (8, 256, 6, 6, 64),
    "from scratch 10M, seq 1,024 x 4": (4, 1024, 6, 6, 64),
    "Qwen3-0.6B, seq 512 x 2": (2, 512, 16, 8, 128),
    "seq 2,048 x 2": (2, 2048, 6, 6, 64),
}


def load_attention(rev: str | None, tag: str):
    """slm/model/attention.py of git revision `rev` (None: today's file) as a separate module named `tag`."""
    path = os.path.join(ROOT, "slm", "model", "attention.py")
    if rev is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="attention-"), f"{tag}.py")
        with open(path, "w") as f:
            f.write(subprocess.run(["git", "show", f"{rev}:slm/model/attention.py"], cwd=ROOT, check=True,
                                   capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location(tag, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(f, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def alone(a: argparse.Namespace) -> None:
    """The attention alone at SHAPES: einsum, REV's blocked (with --against), today's blocked."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from slm.model.attention import causal_attend
    from slm.model.sizing import attention_block
    from slm.model.transformer import attend

    earlier = load_attention(a.against, "attention_against").causal_attend if a.against else None
    split = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    print(f"| shape | block | einsum ms |{f' {a.against} ms |' if earlier else ''} blocked ms | einsum / blocked |"
          f"{f' {a.against} / blocked |' if earlier else ''}")
    print("|---|---|---|---|---|" + ("---|---|" if earlier else ""))
    rng = np.random.default_rng(0)
    for name, (B, L, H, G, K) in ((n, x) for n, x in SHAPES.items() if a.only in n):
        q, w = (jax.device_put(jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32), split) for _ in range(2))
        k, v = (jax.device_put(jnp.asarray(rng.normal(size=(B, L, G, K)), jnp.float32), split) for _ in range(2))
        mask = jnp.tril(jnp.ones((L, L), bool))
        einsum = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v, mask, jnp.float32) * w),
                                            argnums=(0, 1, 2)))
        for block in ([int(b) for b in a.blocks.split(",")] if a.blocks else [attention_block(L)]):
            fs = [einsum] + [jax.jit(jax.value_and_grad(
                lambda q, k, v, f=f: jnp.sum(f(q, k, v, jnp.float32, bf16=a.bf16, block=block) * w),
                argnums=(0, 1, 2))) for f in ([earlier] if earlier else []) + [causal_attend]]
            t = [min(timed(f, (q, k, v), a.repeats) for _ in range(2)) for f in fs]  # best of two medians
            cells = " | ".join(f"{x * 1e3:,.1f}" for x in t)
            ratios = " | ".join(f"{x / t[-1]:.2f}" for x in t[:-1])
            print(f"| {name} | {block} | {cells} | {ratios} |", flush=True)


def step(a: argparse.Namespace) -> None:
    """The trainer's step with today's attention, REV's and a control copy of today's, alternated."""
    import slm.model.transformer as transformer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from profile_step import alternate, build_step

    spec = argparse.Namespace(full=not a.lora, target="10m", model="smollm2-135m", vocab=8192, seq=a.seq,
                              batch=a.batch, devices=a.devices, matmul=None, mixed=False)
    today = transformer.causal_attend
    versions = {"today": today, a.against: load_attention(a.against, "attention_against").causal_attend,
                "today (control copy)": load_attention(None, "attention_copy").causal_attend}
    built = {}
    for name, attend in versions.items():
        transformer.causal_attend = attend  # read when the step is traced, inside build_step
        built[name] = list(build_step(spec))
    transformer.causal_attend = today
    print(built["today"][4])
    medians = alternate(built, a.rounds, a.steps)
    for name, (m, n) in medians.items():
        print(f"| {name} | median step {m * 1e3:,.0f} ms over {n} steps | {m / medians['today'][0]:.3f}x "
              f"today's |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", help="comma-separated block sizes (default: slm.model.sizing.attention_block)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--only", default="", help="the shapes whose name contains this text (e.g. 'main job')")
    p.add_argument("--devices", type=int, default=1, help="host devices, the batch split over them")
    p.add_argument("--against", help="a git revision whose slm/model/attention.py is timed beside today's")
    p.add_argument("--step", action="store_true", help="time the train step instead (needs --against)")
    p.add_argument("--lora", action="store_true", help="with --step: the LoRA race's step (SmolLM2's shape)")
    p.add_argument("--seq", type=int, default=1024, help="with --step")
    p.add_argument("--batch", type=int, default=2, help="with --step")
    p.add_argument("--rounds", type=int, default=6, help="with --step")
    p.add_argument("--steps", type=int, default=5, help="with --step: steps a version runs each round")
    a = p.parse_args()
    if a.step and not a.against:
        p.error("--step compares with --against REV")
    from slm.train.devices import configure_cpu_devices

    configure_cpu_devices(a.devices)
    import jax

    from plan_for_xla import host  # bench/, beside this script

    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {host()}, {len(jax.devices())} jax device(s), bf16 operands: {a.bf16}")
    step(a) if a.step else alone(a)


if __name__ == "__main__":
    main()
