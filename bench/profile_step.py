"""Where the train step's time goes: a profile of the trainer's own jitted step, summed per part of the model.

    .venv/bin/python bench/profile_step.py                      # the LoRA race's step (bench/vs_peft.py)
    .venv/bin/python bench/profile_step.py --model qwen3-0.6b   # Qwen3-0.6B's shape
    .venv/bin/python bench/profile_step.py --full --target 10m --seq 1024 --batch 2   # from scratch
    .venv/bin/python bench/profile_step.py --full --target baby --seq 64 --batch 12 --vocab 65 --devices 2 \
        --compare-options '{"vw512": {"xla_cpu_prefer_vector_width": "512"}}'   # XLA options, A/B in one process

The step is the one the trainer compiles (slm.train.builder: build + compile_step; LoRA r16 alpha 32 on
q_proj,v_proj over a frozen base (--base-dtype; default the trainer's for a checkpoint stored in bf16:
bfloat16 under bf16 products) of ../shared/models/<model>'s shape with its vocabulary cut to
--vocab, random weights; or with --full a from-scratch model and AdamW), on --devices host devices, with the
host's matmul precision (slm.model.matmul.cpu_has_bf16_dot) unless --matmul says otherwise. It runs --warmup
steps, then --steps steps under jax.profiler.trace; the trace's per-op events (XLA:CPU names each executed
HLO instruction) are summed and mapped to the model through the compiled HLO's metadata (op_name: the
Flax module path; its stack frames: the Python files that made the op). The parts, first rule that matches:

  all-reduce        the gradients' all-reduce over the devices (one combined op: its op_name joins many)
  attention core    ops made in slm/model/attention.py or rope.py: the scores/probability products, masks,
                    softmax, the head-major copies, rotary embeddings (its products and the rest apart)
  LoRA adapters     ops made in slm/model/lora.py
  q/k/v/o proj.     the rest of a module path .../attn/...
  MLP               .../mlp/... (gate/up/down products and SwiGLU)
  RMSNorm           a module path or file with "norm"
  loss, optimizer   slm/model/loss.py (the chunked loss); optax
  other             everything else: the embedding, the output head's product and the loss's logits, casts

An op XLA left without metadata (e.g. a dot it rewrote into a YNNPACK fusion) takes its fused ops', else
its operands' (attention's P.V product is found through the probabilities it multiplies).

Prints the step's median wall time, each part's ms per step and share of the summed op time, and the
coverage (summed op time / wall time: below 1 where the host waits between ops, above 1 where two devices
or overlapping ops run at once). One process, one sitting; the ratios, not the absolute ms, carry between
hosts.

--compare-options times instead the step compiled with sets of XLA compiler options (XLA_FLAGS' names, for
that compile only) against the default and a control copy of the default, --steps steps each in turn for
--rounds rounds: on a host whose speed wanders by ±20% within seconds (the Intel Xeon of 2026-12-06), runs in
separate processes cannot tell a 10% lever from the noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODELS = os.path.join(ROOT, "..", "shared", "models")

INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S+.*?\s([\w\-]+)\((.*)$")
COMPUTATION = re.compile(r"^%?([\w.\-]+)\s.*\{\s*$")
OP_NAME = re.compile(r'op_name="([^"]*)"')
FRAME = re.compile(r"stack_frame_id=(\d+)")
CALLS = re.compile(r"calls=%?([\w.\-]+)")
OPERAND = re.compile(r"%([\w.\-]+)")
GEMM = re.compile(r'custom_call_target="[^"]*(matmul|gemm|dot)', re.I)
TABLE_ROW = re.compile(r"^(\d+) (.*)$")


def stack_files(text: str) -> dict[str, str]:
    """stack_frame_id -> the files of its whole Python stack, innermost first, joined by " < ": the module
    text's FileNames / FileLocations / StackFrames tables (a frame's parent_frame_id p is frame p - 1; 0 ends)."""
    tables: dict[str, dict[str, str]] = defaultdict(dict)
    table = ""
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = line
        elif table and (m := TABLE_ROW.match(line)):
            tables[table][m.group(1)] = m.group(2)
        elif table and line.strip():
            table = ""

    def field(row: str, key: str) -> str:
        return re.search(key + r"=(\d+)", row).group(1)

    files = {}
    for frame in tables["StackFrames"]:
        chain, f, seen = [], frame, set()
        while f in tables["StackFrames"] and f not in seen:
            seen.add(f)
            row = tables["StackFrames"][f]
            location = tables["FileLocations"][field(row, "file_location_id")]
            chain.append(tables["FileNames"][field(location, "file_name_id")].strip('"'))
            f = str(int(field(row, "parent_frame_id")) - 1)
        files[frame] = " < ".join(chain)
    return files


def hlo_ops(text: str) -> dict[str, tuple[str, str, str, bool]]:
    """Each HLO instruction's (opcode, op_name, source files, is a product) from the compiled module's text.
    An op without metadata takes its fused ops', else its operands' (origin); a fusion counts as a product when
    it holds a dot (holds_product)."""
    files = stack_files(text)
    ops: dict[str, tuple[str, str, str, str]] = {}  # name -> (opcode, op_name, source, called computation)
    operands: dict[str, list[str]] = {}
    computations: dict[str, list[str]] = defaultdict(list)
    current = ""
    for line in text.splitlines():
        m = COMPUTATION.match(line)
        if m and "=" not in line.split("{")[0]:
            current = m.group(1)
            continue
        m = INSTRUCTION.match(line)
        if not m:
            continue
        name, opcode = m.group(1), m.group(2)
        if opcode == "custom-call" and GEMM.search(line):  # a library matmul (oneDNN, cuBLAS) counts as a dot
            opcode = "dot"
        op_name, frame, calls = OP_NAME.search(line), FRAME.search(line), CALLS.search(line)
        ops[name] = (opcode, op_name.group(1) if op_name else "", files.get(frame.group(1), "") if frame else "",
                     calls.group(1) if calls else "")
        operands[name] = OPERAND.findall(m.group(3).split("), ")[0])
        computations[current].append(name)

    def holds_product(name: str, depth: int = 0) -> bool:  # a dot, or a fusion (nested) around one
        opcode, _, _, calls = ops[name]
        return opcode in ("dot", "convolution") or depth < 4 and any(
            holds_product(n, depth + 1) for n in computations.get(calls, []))

    def origin(name: str, depth: int = 0) -> tuple[str, str]:  # its metadata, else its fused ops', else its operands'
        _, op_name, source, calls = ops[name]
        if op_name or depth >= 4:
            return op_name, source
        for n in [*reversed(computations.get(calls, [])), *operands.get(name, [])]:
            if n in ops and (found := origin(n, depth + 1))[0]:
                return found
        return "", ""

    return {name: (ops[name][0], *origin(name), holds_product(name)) for name in ops}


def part_of(opcode: str, op_name: str, source: str) -> str:
    """The module docstring's rules, first match wins; `source`: the op's stack files, innermost first."""
    stack = [os.path.basename(f) for f in source.split(" < ")]
    file = stack[0]
    if opcode.startswith("all-reduce"):  # the gradients' (its op_name joins those of every gradient it sums)
        return "all-reduce (devices)"
    if "attention.py" in stack or file == "rope.py":
        return "attention core"
    if "lora.py" in stack:
        return "LoRA adapters"
    if "/attn/" in op_name:
        return "q/k/v/o projections"
    if "/mlp/" in op_name:
        return "MLP"
    if "norm" in op_name.lower() or "norm" in file:
        return "RMSNorm"
    if file == "loss.py":
        return "loss"
    if "optax" in source or "/optim/" in source:
        return "optimizer"
    return "other"


def op_times(trace_dir: str, ops: dict) -> tuple[dict[str, float], int]:
    """Summed microseconds per HLO instruction over the trace's complete events; and how many events named
    an instruction of this program."""
    path = max(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    events = json.load(gzip.open(path))["traceEvents"]
    total: dict[str, float] = defaultdict(float)
    n = 0
    for e in events:
        if e.get("ph") == "X" and e.get("name") in ops:
            total[e["name"]] += float(e.get("dur", 0.0))
            n += 1
    return total, n


def build_step(a: argparse.Namespace, options: dict | None = None):
    """The compiled step (with these XLA compiler options), its state, base and batch (random weights, tokens)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slm.memory.finetune import model_shape
    from slm.model.lora import LoraSpec
    from slm.model.matmul import cpu_has_bf16_dot
    from slm.model.sizing import choose_shape
    from slm.train.builder import StepSpec, build, compile_step, init_state
    from slm.train.defaults import base_dtype_choice
    from slm.train.devices import data_mesh

    if a.full:
        # nanoGPT's shapes at its parameter counts (bench/vs_nanogpt.py: SwiGLU's d_ff sized to match GELU's)
        N, L, D, H = {"10m": (10_646_784, 6, 384, 6), "baby": (800_000, 4, 128, 4)}[a.target]
        shape = choose_shape(N, a.vocab, L, D, H)
    else:
        shape = dataclasses.replace(model_shape(os.path.join(MODELS, a.model)), vocab_size=a.vocab)
    matmul = a.matmul or ("bfloat16" if cpu_has_bf16_dot() else "float32")
    # the base as the trainer holds a checkpoint stored in bf16 (as SmolLM2's and Qwen3's are) by default
    held = a.base_dtype or base_dtype_choice("bfloat16", matmul, a.mixed)[0]
    spec = StepSpec(shape, a.seq, a.batch, lora=None if a.full else LoraSpec(16, 32.0, 0.0, ("q_proj", "v_proj")),
                    matmul=matmul, mixed_precision=a.mixed, base_dtype=held)
    built = build(spec, data_mesh(a.batch, max_devices=a.devices))
    compiled, secs, _ = compile_step(built, options)
    state = init_state(built)
    base = ()
    if built.base_abstract is not None:
        keys = iter(jax.random.split(jax.random.PRNGKey(0), len(jax.tree.leaves(built.base_abstract))))
        base = (jax.tree.map(lambda s: jax.device_put((0.02 * jax.random.normal(next(keys), s.shape)).astype(s.dtype),
                                                      s.sharding), built.base_abstract),)
    ids = np.random.default_rng(0).integers(0, a.vocab, (a.batch, a.seq + 1)).astype(np.int32)
    batch = {k: jax.device_put(jnp.asarray(x), built.batch_sharding)
             for k, x in (("input_ids", ids[:, :-1]), ("targets", ids[:, 1:]))}
    what = (f"{'from scratch ' + a.target if a.full else a.model + ' LoRA r16 q,v'}, {shape.n_layers} x "
            f"{shape.d_model}, {shape.n_heads} heads, vocab {a.vocab:,}, seq {a.seq} x batch {a.batch}, "
            f"{len(built.mesh.devices.flat)} device(s), matmul {matmul}{'' if a.full else ', base ' + held}, "
            f"compile {secs:.0f}s")
    return compiled, state, base, batch, what


def run(compiled, state, base, batch, steps: int) -> tuple[object, list[float]]:
    """`steps` steps; each one's wall time (synchronised at its end)."""
    import jax
    import numpy as np

    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, metrics = compiled(state, batch, np.float32(1e-4), *base)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    return state, times


def alternate(built: dict[str, list], rounds: int, steps: int, warmup: int = 1) -> dict[str, tuple[float, int]]:
    """Each variant's [compiled, state, base, batch, ...] run `steps` steps a round, each leading a round in turn
    (the host's speed wanders by the second: interleaving puts every variant in the same moments): the median
    step in seconds of each, and how many steps it is over (each one's first `warmup` calls left out)."""
    times: dict[str, list[float]] = {name: [] for name in built}
    names = list(built)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            compiled, state, base, batch = built[name][:4]
            state, t = run(compiled, state, base, batch, steps + (warmup if r == 0 else 0))
            built[name][1] = state
            times[name] += t[warmup:] if r == 0 else t
    return {name: (statistics.median(t), len(t)) for name, t in times.items()}


def compare_options(a: argparse.Namespace) -> None:
    """The step compiled with each set of XLA options in --compare-options against the default and a control
    copy of it (the same program compiled twice: the noise floor), steps interleaved in one process."""
    variants = {"default": None, "default (control copy)": None, **json.loads(a.compare_options)}
    built = {name: list(build_step(a, options)) for name, options in variants.items()}
    print(f"{time.strftime('%Y-%m-%d %H:%M')} | {built['default'][4]}")
    medians = alternate(built, a.rounds, a.steps, a.warmup)
    for name, (m, n) in medians.items():
        print(f"| {name} | {json.dumps(variants[name] or {})} | median step {m * 1e3:,.1f} ms over {n} steps | "
              f"{medians['default'][0] / m:.3f}x the default's speed |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="a config folder of ../shared/models (LoRA)")
    p.add_argument("--full", action="store_true", help="a from-scratch model (--target) instead of LoRA")
    p.add_argument("--target", default="10m", choices=("10m", "baby"), help="with --full: nanoGPT's shapes")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--devices", type=int, default=1, help="host devices (the batch is split over them)")
    p.add_argument("--matmul", choices=("float32", "bfloat16"), default=None, help="default: the host's")
    p.add_argument("--mixed", action="store_true", help="bf16 activations (--use-mixed-precision)")
    p.add_argument("--base-dtype", choices=("float32", "bfloat16"), default=None,
                   help="LoRA's frozen base; default: the trainer's for a checkpoint stored in bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=0, help="also list the N heaviest ops with their part and op_name")
    p.add_argument("--compare-options", default=None, metavar="JSON",
                   help='instead of a profile, time the step compiled with XLA compiler options against the default, '
                        'interleaved in one process, e.g. \'{"vw512": {"xla_cpu_prefer_vector_width": "512"}}\'')
    p.add_argument("--rounds", type=int, default=30, help="with --compare-options: rounds of --steps steps each")
    a = p.parse_args()
    from slm.train.devices import configure_cpu_devices

    configure_cpu_devices(a.devices)
    if a.compare_options:
        return compare_options(a)
    import jax

    from slm.train.throughput import cpu_model

    compiled, state, base, batch, what = build_step(a)
    ops = hlo_ops(compiled.as_text())
    state, _ = run(compiled, state, base, batch, a.warmup)
    trace_dir = tempfile.mkdtemp(prefix="profile-step-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        state, times = run(compiled, state, base, batch, a.steps)
    total, events = op_times(trace_dir, ops)
    parts: dict[tuple[str, bool], float] = defaultdict(float)
    for name, us in total.items():
        opcode, op_name, source, product = ops[name]
        parts[(part_of(opcode, op_name, source), product)] += us / 1e3 / a.steps
    wall = statistics.median(times) * 1e3
    summed = sum(parts.values())
    print(f"{time.strftime('%Y-%m-%d %H:%M')} | {cpu_model()}, {os.cpu_count()} cores | {what}")
    print(f"median step {wall:,.0f} ms over {a.steps} profiled steps; op events {events:,}, summed "
          f"{summed:,.0f} ms a step (coverage {summed / wall:.2f})")
    print("| part (forward + backward) | ms/step | share |")
    print("|---|---|---|")
    names = sorted({k for k, _ in parts}, key=lambda k: -(parts[(k, True)] + parts[(k, False)]))
    for name in names:
        both = parts[(name, True)] + parts[(name, False)]
        print(f"| {name} | {both:,.0f} | {both / summed:.0%} |")
        if name == "attention core":
            for product, label in ((True, "its products"), (False, "the rest: masks, softmax, copies, rope")):
                print(f"| · {label} | {parts[(name, product)]:,.0f} | {parts[(name, product)] / summed:.0%} |")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:a.top]:
        opcode, op_name, source, _ = ops[name]
        print(f"  {us / 1e3 / a.steps:8,.1f} ms  {name}  [{part_of(opcode, op_name, source)}]  {op_name}")


if __name__ == "__main__":
    main()
