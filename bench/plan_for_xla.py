"""The device memory arithmetic against XLA's own figure for a GPU or TPU target, compiled on this CPU (--plan-for).

    .venv/bin/python bench/plan_for_xla.py sweep --target h100-80gb [--rows scratch,lora,qlora,full] [--models ...]
    .venv/bin/python bench/plan_for_xla.py sweep --target v5e-8 --reuse sweep.md   # re-estimate its rows, no compile
    .venv/bin/python bench/plan_for_xla.py sweep --target v5e-8 --rows full --fsdp  # full fine-tunes over the 8 chips
    .venv/bin/python bench/plan_for_xla.py muon-dp --target v5e-8   # Muon's update over a TPU slice's chips
    .venv/bin/python bench/plan_for_xla.py eight-bit --target v5e-1  # 8-bit state's step against float32's
    .venv/bin/python bench/plan_for_xla.py gpu-grads      # full fine-tunes' gradients on a GPU: the fit's compiles
    .venv/bin/python bench/plan_for_xla.py sampler        # seed 002's QLoRA sampler on an A10G: before / after
    .venv/bin/python bench/plan_for_xla.py seed002        # seed 002's settings on an A10G 24 GB, and a 1B on v5e-8
    .venv/bin/python bench/plan_for_xla.py device-plan --out bench/out/plan.json    # --plan-for h100-80gb, here
    python3 bench/plan_for_xla.py device --out $OUT/device.json          # on a lent GPU: compiled there, and run
    python3 bench/plan_for_xla.py device --trainer-order --out $OUT/order.json --rows Gemma   # compiles as the trainer
    python3 bench/plan_for_xla.py device --train-only --rows AdamW --out $OUT/eight.json  # the 8-bit pairs' steps
    .venv/bin/python bench/plan_for_xla.py device-compare bench/out/plan.json bench/out/device.json [more.json]

`sweep`: each row is the trainer's train step for the target (slm.train.plan_for.compile_programs, the program
--plan-for compiles), against estimate_memory_usage(..., platform=the target's)'s device figure less its
runtime term (the CUDA context, which XLA's buffers do not hold). From scratch at 1M/10M/100M/350M/1B x seq
512/2048 (8 sequences a device, bf16 compute, the default optimizer), and LoRA r16 on q_proj,v_proj with a
bf16 base, QLoRA (nf4 base) and full fine-tunes (Muon) of every config.json in ../shared/models (1 sequence of
512 a device, remat, bf16 compute), and with --rows lora-default LoRA at the flags' defaults (a float32 base
and products, no remat), --rows scratch-f32 from scratch in float32 (the flags' default). On a several-device
target, runs whose state does not fit one device are FSDP (--fsdp: every row). Prints a markdown table; the goal
is within +-10% on every row.

`device-plan` / `device` / `device-compare`: --plan-for's compile-only figures against a real GPU. Each row
(DEVICE_ROWS) is a run --plan-for h100-80gb plans (slm.train.plan_for.compile_programs: train step, eval step,
sampler prefill and decode step, each XLA's peak per device plus the state resident beside it). `device-plan`
compiles them here for compile-only H100 devices. `device`, on a machine with a GPU, compiles the same programs
for that GPU (autotuning on, its cuDNN), places the resident state (zeros), reads the allocator's peak, then runs
the programs in the trainer's order (train step twice with the state donated, eval, prefill, decode) and reads
it after each: what a run of that setting holds. Each row runs in its own process (`device-row`), so each peak is
that row's. `device-compare` prints the plan's figure and the device compile's for the train step and the
largest program, against the measured peak. `device --trainer-order` compiles in the trainer's own order
instead (the train step and the eval's sampler on an empty card, as pre-flight does; the state placed; the eval
step compiled beside it and the sample drawn, as the first eval does; a run from scratch's step with dropout,
compiled when its epoch begins) and reads the allocator after each: XLA:GPU's autotuning allocates scratch on
the card while it compiles, which no program's memory analysis holds. It also times the sample's decode as
pre-flight compiled it (autotuned) against a sampler compiled later (autotuning off on a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slm.train.devices import import_jax_quietly  # noqa: E402

import_jax_quietly()

from slm.memory.targets import load_target  # noqa: E402
from slm.train.config import Config  # noqa: E402

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "models")
SCRATCH = (1_000_000, 10_000_000, 100_000_000, 350_000_000, 1_000_000_000)


def host() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def rows(kinds: list[str], models: list[str], sizes: tuple[int, ...] = SCRATCH) -> list[tuple[str, dict]]:
    out = []
    # bf16 compute (the sweep's default), and float32, the flags' default
    for kind, suffix, extra in (("scratch", "", {}), ("scratch-f32", ", float32", {"use_mixed_precision": False})):
        if kind in kinds:
            out += [(f"{n // 1_000_000:,}M from scratch, seq {s}{suffix}",
                     dict(target_params=n, seq_len=s, batch_size=8, **extra)) for n in sizes for s in (512, 2048)]
    ft = dict(seq_len=512, batch_size=1, gradient_checkpointing=True)
    for m in models:
        folder = os.path.join(MODELS, m)
        if "lora" in kinds:
            out.append((f"{m} LoRA r16 q,v bf16 base", dict(init_from=folder, lora_rank=16, base_dtype="bfloat16", **ft)))
        if "lora-default" in kinds:  # the flags' defaults on a GPU: float32 base and products, no remat
            out.append((f"{m} LoRA r16 q,v float32, no remat", dict(init_from=folder, lora_rank=16, seq_len=512,
                                                                    batch_size=1, use_mixed_precision=False)))
        if "qlora" in kinds:
            out.append((f"{m} QLoRA r16 q,v nf4 base", dict(init_from=folder, lora_rank=16, base_dtype="nf4", **ft)))
        if "full" in kinds:
            out.append((f"{m} full fine-tune", dict(init_from=folder, **ft)))
    return out


def estimate_device_mb(c: Config, shape, target) -> float:
    """--plan-for's planned figure less its runtime term (a GPU's CUDA context, which XLA's buffers do not hold)."""
    from slm.train.plan_for import planned

    est = planned(c, shape, target)
    return est["device_total_mb"] - est.get("runtime_mb", 0.0)


def reused(path: str) -> dict[str, tuple[str, float]]:
    """name: (sharding, XLA MB) of the rows of an earlier sweep's table (its printed markdown) that compiled."""
    out = {}
    if path:
        with open(path) as f:
            for line in f:
                cells = [x.strip() for x in line.split("|")[1:-1]]
                if len(cells) == 7 and cells[2] in ("dp", "fsdp") and cells[4].replace(",", "").replace(".", "").isdigit():
                    out[cells[0]] = (cells[2], float(cells[4].replace(",", "")))
    return out


def sweep(a: argparse.Namespace) -> None:
    from slm.train.aot import compile_only, target_devices
    from slm.train.devices import start_backend
    from slm.model.sizing import count_params
    from slm.train.plan_for import compile_programs, plan_shape, resolved_for

    start_backend()
    target = load_target(a.target)
    devices = target_devices(target)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {host()}, target {target.name} ({target.count} x "
          f"{target.facts['device']})\n")
    print("| run | params | sharding | estimate MB | XLA MB | estimate / XLA | compile s |")
    print("|---|---|---|---|---|---|---|")
    worst, earlier = (0.0, ""), reused(a.reuse)
    sizes = tuple(int(float(x.rstrip("M")) * 1e6) for x in a.sizes.split(","))
    for name, kw in rows(a.rows.split(","), a.models.split(","), sizes):
        if a.reuse and name not in earlier:
            continue
        c = Config(**{"use_streaming": True, "plan_for": target.name, "use_mixed_precision": True, **kw})
        c = dataclasses.replace(c, batch_size=c.batch_size * target.count)
        shape = plan_shape(c)
        c = resolved_for(c, shape, target.platform)
        est = estimate_device_mb(c, shape, target)
        if name in earlier or a.fsdp or (target.count > 1 and est > 0.8 * target.usable_mb()[0]):
            c = dataclasses.replace(c, sharding=earlier[name][0] if name in earlier else "fsdp")
            est = estimate_device_mb(c, shape, target)
        t0 = time.time()
        if name in earlier:  # XLA's figure from the earlier table (the same program: it does not depend on the estimate)
            xla, note = earlier[name][1], "from --reuse"
        else:
            with compile_only():
                _, xla, note, _ = compile_programs(c, shape, devices, target, train_only=True)[0]
        if xla is None or xla != xla or xla == float("inf"):
            print(f"| {name} | {count_params(shape) / 1e6:,.0f}M | {c.sharding} | {est:,.0f} | - ({note}) | - | "
                  f"{time.time() - t0:.0f} |", flush=True)
            continue
        ratio = est / xla
        worst = max(worst, (abs(ratio - 1), name))
        print(f"| {name} | {count_params(shape) / 1e6:,.0f}M | {c.sharding} | {est:,.0f} | {xla:,.0f} | {ratio:.3f} "
              f"({(ratio - 1) * 100:+.1f}%) | {time.time() - t0:.0f} |", flush=True)
    print(f"\nworst row: {worst[1]} ({worst[0] * 100:.1f}% off)")


def sampler(a: argparse.Namespace) -> None:
    """Seed 002's QLoRA run on an A10G: the sampler's peak as it was (the whole NF4 base dequantised to float32
    and the adapters folded in outside jit, then a plain float32-kernel decoder) against now (the decoder applies
    the codes and the adapters as held), and the eval step's (unchanged: it always applied the codes)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, SingleDeviceSharding

    from slm.model.generate import Decoder
    from slm.model.nf4 import dequantize_params
    from slm.model.transformer import Transformer
    from slm.train.aot import compile_only, target_devices
    from slm.train.builder import StepSpec, build
    from slm.train.devices import start_backend
    from slm.train.builder import compiled_peak as program_peak
    from slm.train.plan_for import MB, compile_programs, device_bytes, plan_shape, resolved_for

    start_backend()
    target = load_target("a10g-24gb")
    devices = target_devices(target)
    c = Config(use_streaming=True, plan_for=target.name, init_from=os.path.join(MODELS, "mistral-7b-v0.1"),
               lora_rank=16, base_dtype="nf4", seq_len=256, batch_size=1, gradient_accumulation_steps=16,
               gradient_checkpointing=True, use_mixed_precision=True)
    shape = plan_shape(c)
    c = resolved_for(c, shape, "gpu")
    one = SingleDeviceSharding(devices[0])
    with compile_only():
        now = {r[0]: r[1] for r in compile_programs(c, shape, devices, target)}
        built = build(dataclasses.replace(StepSpec.from_config(c, shape), platform="gpu"),
                      Mesh(np.array(devices), ("data",)))
        resident = device_bytes(built.abstract) + device_bytes(built.base_abstract)
        # before: every block kernel dequantised to float32 (fold then added the adapters into them), the other
        # leaves (embeddings, norms) shared with the resident base
        dense = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                             jax.eval_shape(lambda b: dequantize_params(b, shape), built.base_abstract))
        shared = device_bytes({k: v for k, v in built.base_abstract.items() if not k.startswith("block_")})
        prefill, step = Decoder(Transformer(shape, dtype=built.model.dtype, platform="gpu")).compiled(
            dense, 1, 1, c.seq_len - 1, 40)
        before = {name: (program_peak(x) + resident - shared) / MB
                  for name, x in (("sample prefill", prefill), ("sample decode step", step))}
    usable = target.usable_mb()[0]
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {host()}: Mistral-7B QLoRA (seed 002's final settings, nf4 base) on "
          f"{target.name}; a program may use {usable:,.0f} MB, a verdict keeps 10% free\n")
    print("| program | before: float32 copy of the base, MB | now, MB | fits, before / now |")
    print("|---|---|---|---|")
    for name in ("eval step", "sample prefill", "sample decode step"):
        b = before.get(name, now[name])
        print(f"| {name} | {b:,.0f} | {now[name]:,.0f} | {b <= 0.9 * usable} / {now[name] <= 0.9 * usable} |")


FIT_SHAPES = ((2, 128, 4, 344, 2048), (4, 128, 2, 344, 8192), (2, 256, 8, 688, 2048), (4, 256, 4, 688, 4096),
              (3, 192, 6, 512, 4096))  # layers, width, heads, MLP width, vocab
FIT_TOKENS = ((8, 256), (4, 1024), (16, 512), (2, 2048))  # micro-batch, seq
# A TPU's: its layouts pad narrow arrays and its fixed costs (~20-60 MB) swamp 2-4 layers of 128-wide models, so
# the widths and head dims of the sizes people train there, at 2 and 6 layers (per-layer terms apart from the rest).
TPU_FIT_SHAPES = ((2, 384, 12, 1024, 4096), (6, 384, 12, 1024, 4096), (2, 512, 8, 1376, 8192),
                  (6, 512, 8, 1376, 8192), (2, 1024, 8, 2752, 8192), (6, 1024, 8, 2752, 8192))
TPU_FIT_TOKENS = ((8, 512), (4, 1024), (8, 2048))


def relative_nnls(X, y, scale=None):
    """Non-negative coefficients minimising the squares of the errors relative to `scale` (default y): least
    squares on X / scale against y / scale, dropping the most negative coefficient until none is (an active-set
    loop; a handful of columns)."""
    import numpy as np

    scale = y if scale is None else scale
    A, b, keep = X / scale[:, None], y / scale, list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        coef[keep] = np.linalg.lstsq(A[:, keep], b, rcond=None)[0]
        if coef.min() >= 0:
            return coef
        keep.remove(int(np.argmin(coef)))


def fit(a: argparse.Namespace) -> None:
    """The activation coefficients (a, b, c, e, k) of slm.memory.estimate for one target's compiler: XLA's peak
    of the from-scratch train step (AdamW, one device) less the state's 16N bytes, fitted by relative least
    squares over 5 shapes x 4 token counts, for each (remat, mixed precision); k is a constant (workspaces).
    A TPU's: 6 wider shapes (2 and 6 layers) x 3 token counts, the errors relative to the whole peak (beyond
    the state, 2-layer steps hold as little as 60 MB, which relative errors on that part would favour)."""
    import numpy as np
    from jax.sharding import Mesh

    from slm.memory.finetune import CHUNKED_BYTES_PER_D
    from slm.model.sizing import ModelShape, count_params, logit_columns, visible_keys
    from slm.train.aot import compile_only, target_devices
    from slm.train.builder import StepSpec, build, compile_step
    from slm.train.devices import start_backend
    from slm.train.builder import compiled_peak as program_peak

    start_backend()
    target = load_target(a.target)
    mesh = Mesh(np.array(target_devices(target)[:1]), ("data",))
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {host()}, target {target.name}")
    for remat in (False, True):
        for mixed in (False, True):
            if a.only and a.only != f"{remat},{mixed}":
                continue
            X, y, whole = [], [], []
            tpu = target.platform == "tpu"
            for L, D, H, F, V in TPU_FIT_SHAPES if tpu else FIT_SHAPES:
                shape = ModelShape(vocab_size=V, n_layers=L, d_model=D, n_heads=H, d_ff=F)
                for B, S in TPU_FIT_TOKENS if tpu else FIT_TOKENS:
                    spec = StepSpec(shape, S, B, 1, mixed, remat, optimizer="adamw", platform=target.platform)
                    with compile_only():
                        peak = program_peak(compile_step(build(spec, mesh))[0])
                    T, cols = B * S, logit_columns(V, None, target.platform)
                    X.append([T * L * D, T * L * F, T * L * H * visible_keys(S), T * (cols + (CHUNKED_BYTES_PER_D * D / cols
                                                                                 if cols < V else 0)), 1.0])
                    y.append(peak - 16 * count_params(shape))
                    whole.append(peak)
                    if a.verbose:
                        print(f"  L{L} D{D} H{H} F{F} V{V} B{B} S{S}: XLA {peak / 2**20:,.1f} MB, beyond the state "
                              f"{y[-1] / 2**20:,.1f} MB", flush=True)
            X, y, whole = np.array(X, float), np.array(y, float), np.array(whole, float)
            coef = relative_nnls(X, y, whole if tpu else None)
            err = (X @ coef - y) / (whole if tpu else y)
            print(f"(remat {remat}, mixed {mixed}): ActivationCoefficients({', '.join(f'{c:.2f}' for c in coef[:4])}, "
                  f"{coef[4] / 2**20:.1f} * MB) "
                  f"worst {np.abs(err).max() * 100:.1f}% over {len(y)}", flush=True)


DEVICE_FT = dict(seq_len=512, batch_size=1, gradient_checkpointing=True)
DEVICE_ROWS = {  # name: Config keywords (bf16 compute, the default optimizer, as bench/plan_for_xla.py's sweep)
    "10M scratch seq 512 x 8": dict(target_params=10_000_000, seq_len=512, batch_size=8),
    "100M scratch seq 2048 x 8": dict(target_params=100_000_000, seq_len=2048, batch_size=8),
    "350M scratch seq 2048 x 8": dict(target_params=350_000_000, seq_len=2048, batch_size=8),
    "Qwen3-0.6B LoRA r16 bf16 base": dict(init_from="qwen3-0.6b", lora_rank=16, base_dtype="bfloat16", **DEVICE_FT),
    "Qwen3-0.6B QLoRA r16 nf4": dict(init_from="qwen3-0.6b", lora_rank=16, base_dtype="nf4", **DEVICE_FT),
    "Qwen3-0.6B QLoRA r16 nf4, seq 256": dict(init_from="qwen3-0.6b", lora_rank=16, base_dtype="nf4",
                                              **{**DEVICE_FT, "seq_len": 256}),
    "SmolLM2-135M QLoRA r16 nf4": dict(init_from="smollm2-135m", lora_rank=16, base_dtype="nf4", **DEVICE_FT),
    # sliding-window layers: the blocked causal_attend on the GPU, not cuDNN's fused kernel
    "Gemma-3-1B QLoRA r16 nf4": dict(init_from="gemma-3-1b", lora_rank=16, base_dtype="nf4", **DEVICE_FT),
    "Llama-3.2-1B full fine-tune": dict(init_from="llama-3.2-1b", **DEVICE_FT),
    "Mistral-7B QLoRA seed 002 (1 x 256, remat)": dict(init_from="mistral-7b-v0.1", lora_rank=16, base_dtype="nf4",
                                                        seq_len=256, batch_size=1, gradient_checkpointing=True),
    # pairs with and without 8-bit Adam state: the allocator's drop against the planned saving (--auto-fit's twin rule)
    **{f"{name}{', 8-bit' if eight else ''}": {**kw, "use_8bit_optimizer": eight} for name, kw in (
        ("20M scratch AdamW seq 512 x 8, remat", dict(target_params=20_000_000, seq_len=512, batch_size=8,
                                                     gradient_checkpointing=True, optimizer="adamw")),
        ("100M scratch AdamW seq 2048 x 8", dict(target_params=100_000_000, seq_len=2048, batch_size=8,
                                                 optimizer="adamw")),
        ("Qwen3-0.6B full fine-tune AdamW", dict(init_from="qwen3-0.6b", optimizer="adamw", **DEVICE_FT)))
       for eight in (False, True)},
}
DEVICE_TARGET = "h100-80gb"


def device_config(name: str, models: str):
    from slm.train.config import Config
    from slm.train.plan_for import plan_shape, resolved_for

    kw = dict(DEVICE_ROWS[name])
    if "init_from" in kw:
        kw["init_from"] = os.path.join(models, kw["init_from"])
    c = Config(use_streaming=True, plan_for=DEVICE_TARGET, use_mixed_precision=True, **kw)
    shape = plan_shape(c)
    return resolved_for(c, shape, "gpu"), shape


def device_chosen(rows: str) -> list[str]:
    """The rows whose name holds one of the comma-separated `rows` (all when empty)."""
    return [n for n in DEVICE_ROWS if not rows or any(r in n for r in rows.split(","))]


def device_plan(a: argparse.Namespace) -> None:
    from slm.train.aot import compile_only, target_devices
    from slm.train.devices import start_backend
    from slm.train.plan_for import compile_programs

    start_backend()
    target = load_target(DEVICE_TARGET)
    devices, out = target_devices(target), {}
    if a.rows and os.path.exists(a.out):  # more rows into a plan already made
        with open(a.out) as f:
            out = json.load(f)["rows"]
    for name in device_chosen(a.rows):
        c, shape = device_config(name, a.models)
        with compile_only():
            out[name] = {r[0]: r[1] for r in compile_programs(c, shape, devices, target, train_only=a.train_only)}
        print(name, {k: round(v, 1) for k, v in out[name].items() if v is not None}, flush=True)
    with open(a.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "target": DEVICE_TARGET, "rows": out}, f, indent=1)


def zeros_for(compiled, first=None):
    """Zero arguments for a compiled program, laid out as it expects; `first` stands in for its first argument
    (the params the trainer shares with its state)."""
    import jax
    import numpy as np

    args, _ = compiled.args_info
    shardings, _ = compiled.input_shardings
    rest = slice(0 if first is None else 1, None)  # never allocate a copy of what `first` stands in for
    flat, tree = jax.tree.flatten(tuple(args[rest]), is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    made = [jax.device_put(np.zeros(x.shape, x.dtype), s)
            for x, s in zip(flat, jax.tree.leaves(tuple(shardings[rest])))]
    made = tuple(jax.tree.unflatten(tree, made))
    return made if first is None else (first, *made)


def materialise(tree, device):
    """Zeros for a tree of ShapeDtypeStructs, each on its sharding (or `device`)."""
    import jax
    import numpy as np

    return jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype), getattr(x, "sharding", None) or device),
                        tree)


def in_use(device, key: str = "peak_bytes_in_use") -> float:
    """The allocator's figure in MB (nan where the backend keeps none, as on a CPU)."""
    return (device.memory_stats() or {}).get(key, float("nan")) / 2**20


def this_machine():
    """(the device the row runs on, the target its programs are compiled for: DEVICE_TARGET, or on a CPU a dry run
    of this script's own code)."""
    import jax

    device, target = jax.devices()[0], load_target(DEVICE_TARGET)
    return device, dataclasses.replace(target, platform="cpu") if device.platform == "cpu" else target


def device_row(name: str, models: str, train_only: bool = False) -> dict:
    """Compile the row's programs for this machine's GPU, run them on zeros, read the allocator's peak (the train
    step's alone with `train_only`)."""
    import jax
    import numpy as np

    from slm.model.lora import merge
    from slm.train.builder import compiled_peak
    from slm.train.plan_for import MB, compile_programs

    c, shape = device_config(name, models)
    device, target = this_machine()
    keep: dict = {}
    compiled = {r[0]: r[1] for r in compile_programs(c, shape, [device], target, train_only=train_only, keep=keep)}
    built, peaks = keep["built"], {}
    step = keep["train step"]
    batch = {k: jax.ShapeDtypeStruct((c.batch_size, c.seq_len), np.int32, sharding=built.batch_sharding)
             for k in ("input_ids", "targets")}  # compile_step's arguments, as the trainer passes them
    state = jax.block_until_ready(materialise(built.abstract, device))
    peaks["placing the trained state"] = in_use(device)  # each part's own transfer peak, to tell which one
    base = () if built.base_abstract is None else (jax.block_until_ready(materialise(built.base_abstract, device)),)
    peaks["placing the frozen base"] = in_use(device)
    args = (state, materialise(batch, device), np.float32(0), *base)
    jax.block_until_ready(args)
    peaks["resident"] = in_use(device, "bytes_in_use")
    peaks["placing the state"] = in_use(device)  # host-to-device transfers' own peak, before any program runs
    for i in range(2):  # the state donated into the next step, as the trainer does
        out = step(*args)
        jax.block_until_ready(out)
        args = (out[0], *args[1:])
        peaks["train step" if i else "train step, first call"] = in_use(device)
    state = args[0]
    params = state.params if built.base_abstract is None else merge(args[-1], state.params)
    for prog in () if train_only else ("eval step", "sample prefill", "sample decode step"):
        out = keep[prog](*zeros_for(keep[prog], params))
        jax.block_until_ready(out)
        del out
        peaks[prog] = in_use(device)
    xla = {k: compiled_peak(v) / MB for k, v in keep.items() if k != "built"}
    m = step.memory_analysis()
    parts = {k: getattr(m, f"{k}_size_in_bytes") / MB for k in ("argument", "output", "temp", "alias")}
    return {"device": device.device_kind, "jax": jax.__version__, "compiled_mb": compiled, "xla_peak_mb": xla,
            "measured_peak_mb": peaks, "train_step_parts_mb": parts,
            "bytes_limit_mb": in_use(device, "bytes_limit")}


def allocator(device) -> dict:
    """The allocator's peak and current MB and its count of allocations so far (nan on a CPU)."""
    return {"peak_mb": in_use(device), "in_use_mb": in_use(device, "bytes_in_use"),
            "allocations": (device.memory_stats() or {}).get("num_allocs", float("nan"))}


def trainer_order_row(name: str, models: str) -> dict:
    """The trainer's own order: the train step and the eval sample's decoder compiled in pre-flight on an empty
    card, the state placed, then the eval step compiled beside it and the sample drawn (as Evaluator does at the
    first eval). The allocator read after each: an autotuning compile shows as allocations while nothing runs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slm.model.lora import merge
    from slm.train.builder import compile_step, compiled_peak, with_dropout
    from slm.train.evaluate import SAMPLE_TOP_K, sampler_ahead
    from slm.train.plan_for import compile_programs
    from slm.train.step import make_eval_step

    c, shape = device_config(name, models)
    (device, target), keep, seen = this_machine(), {}, {}
    seen["backend started"] = allocator(device)
    compile_programs(c, shape, [device], target, train_only=True, keep=keep)
    seen["train step compiled (pre-flight)"] = allocator(device)
    built = keep["built"]
    decoder = sampler_ahead(built, [0], c.seq_len)
    seen["sampler compiled (pre-flight)"] = allocator(device)
    base = () if built.base_abstract is None else (materialise(built.base_abstract, device),)
    state = jax.block_until_ready(materialise(built.abstract, device))
    jax.block_until_ready(base)
    seen["state placed"] = allocator(device)
    params = state.params if built.base_abstract is None else merge(base[0], state.params)
    batch = [jax.ShapeDtypeStruct((c.batch_size, c.seq_len), d, sharding=built.batch_sharding)
             for d in (jnp.int32, jnp.int32, jnp.float32)]
    evaluate = make_eval_step(built.model).lower(params, *batch).compile()
    seen["eval step compiled beside the state"] = allocator(device)
    jax.block_until_ready(evaluate(params, *materialise(batch, device)))
    seen["eval step run"] = allocator(device)
    for _ in decoder.stream(params, [0], c.seq_len - 1, top_k=SAMPLE_TOP_K):
        pass
    seen["sample drawn beside the state"] = allocator(device)
    out = {"device": device.device_kind, "jax": jax.__version__, "resident_mb": sum(
        np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves((state, base))) / 2**20, "seen": seen}
    if c.dropout and c.dropout_from_epoch:  # the step with dropout compiles when its epoch begins (slm.train.run)
        planned = compiled_peak(keep["train step"]) / 2**20
        _, _, later_mb = compile_step(with_dropout(built, c.dropout))
        seen["dropout step compiled beside the state"] = allocator(device)
        out["dropout_step_mb"] = {"without (planned)": planned, "with dropout": later_mb}
    out["decode_ms_per_token"] = decode_speed(decoder, built.model, params, c.seq_len - 1)
    seen["untuned sampler compiled beside the state"] = allocator(device)
    return out


def decode_speed(tuned, model, params, new: int, rounds: int = 2) -> dict:
    """The eval sample's decode, ms per token: pre-flight's decoder (XLA's options: autotuned on a GPU) against
    one compiled as a sampler compiled later is (sampler_compile_options: no autotuning on a GPU), alternated;
    each one's fastest round."""
    from slm.model.generate import Decoder
    from slm.train.evaluate import SAMPLE_TOP_K

    decoders = {"pre-flight's (autotuned)": tuned, "autotuning off": Decoder(model)}
    times: dict = {name: [] for name in decoders}
    for _ in range(rounds):
        for name, d in decoders.items():
            t: dict = {}
            for _ in d.stream(params, [0], new, top_k=SAMPLE_TOP_K, timings=t):
                pass
            times[name].append(1e3 * t["decode_s"] / t["decode_tokens"])
    return {k: min(v) for k, v in times.items()}


def device(a: argparse.Namespace) -> None:
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "rows": {}}
    for name in device_chosen(a.rows):
        t0 = time.time()
        order = ["--trainer-order"] * a.trainer_order + ["--train-only"] * a.train_only
        p = subprocess.run([sys.executable, __file__, "device-row", name, "--models", a.models, *order],
                           capture_output=True, text=True, timeout=a.row_timeout)
        last = p.stdout.strip().splitlines()[-1:] if p.returncode == 0 else []
        out["rows"][name] = json.loads(last[0]) if last else {"error": p.stderr[-2000:]}
        print(f"{name}: {time.time() - t0:.0f}s", json.dumps(out["rows"][name])[:600], flush=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


def device_compare(a: argparse.Namespace) -> None:
    with open(a.plan) as f:
        planned = json.load(f)
    measured: dict = {"rows": {}}
    for path in a.device:  # a later file's row replaces an earlier one's
        with open(path) as f:
            more = json.load(f)
        measured = {"date": more["date"], "rows": {**measured["rows"], **more["rows"]}}
    kinds = {r.get("device") for r in measured["rows"].values()} - {None}
    print(f"plan {planned['date']} (compile-only {planned['target']}, this CPU); device {measured['date']} "
          f"({', '.join(sorted(kinds))})\n")
    print("| run | train step: plan MB | device compile MB | largest program: plan MB | device compile MB | "
          "measured peak MB | peak before the first program | measured / plan | measured / device compile |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in measured["rows"].items():
        if "error" in row:
            print(f"| {name} | failed: {row['error'].strip().splitlines()[-1][:120]} |||||||")
            continue
        plan_row = planned["rows"][name]
        programs = [k for k in row["xla_peak_mb"] if plan_row.get(k) is not None]
        p, d = max(plan_row[k] for k in programs), max(row["compiled_mb"][k] for k in programs)
        mb = max(row["measured_peak_mb"].values())  # the allocator's peak over the whole process
        placing = row["measured_peak_mb"].get("placing the state")  # rows measured before it was read: "-"
        before = "-" if placing is None else f"{placing:,.0f}"
        print(f"| {name} | {plan_row['train step']:,.0f} | {row['compiled_mb']['train step']:,.0f} | {p:,.0f} | "
              f"{d:,.0f} | {mb:,.0f} | {before} | {mb / p:.3f} | {mb / d:.3f} |")


# muon-dp: the data-parallel Muon update on a TPU slice (TPU_DP_MUON_UPDATE): width, d_ff, heads, vocab of the
# 350M/100M presets and three more widths, cut to a few layers; (width, d_ff, heads, vocab, layers, seqs a chip)
MUON_DP_ROWS = [(512, 1376, 8, 4096, 4, 2), (768, 2048, 12, 4096, 4, 2), (640, 1616, 10, 8192, 6, 8),
                (640, 1616, 10, 8192, 8, 8), (640, 1616, 10, 8192, 8, 2), (1024, 2752, 16, 8192, 6, 8),
                (1024, 2752, 16, 8192, 8, 2)] + [
    (960, 2552, 15, 8192, L, b) for L, b in ((6, 8), (8, 8), (8, 2), (12, 8))]


def muon_dp(a: argparse.Namespace) -> None:
    """Each row's Muon step (bf16 compute, seq 512) compiled for one chip of the target and for all of them, data
    parallel: libtpu's peaks, the terms' figure over the chips, and the float32 hidden-matrix copies the chips
    hold beyond the state (and AdamW's 4N) that the extra implies: a bound (≤) where the chips hold no more than one
    chip, whose peak is the backward."""
    import numpy as np
    from jax.sharding import Mesh

    from slm.memory.estimate import device_breakdown
    from slm.model.sizing import ModelShape, hidden_matrix_shapes
    from slm.train.aot import compile_only, target_devices
    from slm.train.builder import StepSpec, build, compile_step, compiled_peak
    from slm.train.devices import start_backend

    start_backend()
    t = load_target(a.target)
    devices, mb = target_devices(t), 2**20
    print(f"{a.target}, {time.strftime('%Y-%m-%d')}, {host()}\n| D | F | L | seqs a chip | one chip MB | "
          f"{t.count} chips MB | planned MB | planned / XLA | copies |\n|---|---|---|---|---|---|---|---|---|")
    for D, F, heads, vocab, L, b in MUON_DP_ROWS:
        shape = ModelShape(vocab_size=vocab, n_layers=L, d_model=D, n_heads=heads, d_ff=F)
        peaks = []
        for n in (1, t.count):
            spec = StepSpec(shape, 512, b * n, 1, True, False, optimizer="muon", platform=t.platform)
            with compile_only():
                peaks.append(compiled_peak(compile_step(build(spec, Mesh(np.array(devices[:n]), ("data",))))[0]) / mb)
        d = device_breakdown(shape, 512, b, devices=t.count, mixed_precision=True, optimizer="muon",
                             platform=t.platform)
        state = (d["params"] + d["gradients"] + d["optimizer_state"]) / mb
        copies = (peaks[1] - state - d["params"] / mb) / (4 * sum(r * c for r, c in hidden_matrix_shapes(shape)) / mb)
        planned = (d["total"] - d.get("runtime", 0)) / mb
        print(f"| {D} | {F} | {L} | {b} | {peaks[0]:,.0f} | {peaks[1]:,.0f} | {planned:,.0f} | "
              f"{planned / peaks[1]:.3f} | {'≤' if peaks[1] < 1.02 * peaks[0] else ''}{copies:.2f} |", flush=True)


def eight_bit(a: argparse.Namespace) -> None:
    """Qwen3-0.6B's full fine-tune (4 x 512 a micro-step, remat, bf16 compute, AdamW) compiled for the target with
    float32 and 8-bit moments, 1 and 2 micro-steps (--plan-for's train step alone): XLA's peak, the ratio 8-bit /
    float32 and the plan's figure."""
    from slm.train.plan_for import plan_for

    init = os.path.join(MODELS, a.model)
    print(f"{a.target}, {a.model}, {time.strftime('%Y-%m-%d')}, {host()}\n| micro-steps | float32 MB | 8-bit MB | "
          f"8-bit / float32 | 8-bit planned / XLA |\n|---|---|---|---|---|")
    for acc in (1, 2):
        rows = [plan_for(a.target, log=lambda *_: None, train_only=True, init_from=init, batch_size=4 * acc,
                         seq_len=512, gradient_accumulation_steps=acc, use_8bit_optimizer=bits, optimizer="adamw",
                         use_mixed_precision=True, gradient_checkpointing=True)["programs"][0]
                for bits in (False, True)]
        f32, b8 = (r["xla_peak_mb"] for r in rows)
        print(f"| {acc} | {f32:,.0f} | {b8:,.0f} | {b8 / f32:.3f} | {rows[1]['planned_mb'] / b8:.3f} |", flush=True)


GPU_GRADS_ROWS = [(m, L, 1) for m, depths in (("tinyllama-1.1b", (4, 8, 12, 16, 22)), ("llama-3.2-1b", (4, 8, 16)),
                                               ("qwen3-0.6b", (4, 8, 16))) for L in depths] + \
    [("llama-3.2-1b", 8, 2), ("llama-3.2-1b", 16, 2), ("tinyllama-1.1b", 4, 2), ("tinyllama-1.1b", 8, 2),
     ("tinyllama-1.1b", 16, 2)]


def gpu_grads(a: argparse.Namespace) -> None:
    """Full fine-tunes on one GPU (remat, bf16 compute, AdamW, 1 x 512 a micro-step) at several depths, with and
    without accumulation: XLA's peak against the plan with GPU_MIXED_GRADIENTS and with float32 gradients (4N);
    the held-out rows (Gemma-3-1B, Qwen2.5-0.5B, SmolLM2-135M) are the tests' and the sweep's."""
    from slm.memory.finetune import gpu_mixed_gradient_bytes
    from slm.model.sizing import count_params
    from slm.train.aot import compile_only, target_devices
    from slm.train.devices import start_backend
    from slm.train.plan_for import compile_programs, plan_shape, resolved_for

    start_backend()
    t = load_target(a.target)
    devices = target_devices(t)
    print(f"{a.target}, {time.strftime('%Y-%m-%d')}, {host()}\n| model | layers | micro-steps | XLA MB | planned / XLA "
          f"| with float32 gradients |\n|---|---|---|---|---|---|")
    for model, layers, acc in (GPU_GRADS_ROWS if not a.models else [(m, 0, 1) for m in a.models.split(",")]):
        c = Config(use_streaming=True, plan_for=t.name, use_mixed_precision=True, init_from=os.path.join(MODELS, model),
                   seq_len=512, batch_size=acc, gradient_accumulation_steps=acc, gradient_checkpointing=True)
        shape = plan_shape(c)
        shape = dataclasses.replace(shape, n_layers=layers or shape.n_layers)
        c = resolved_for(c, shape, t.platform)
        with compile_only():
            xla = compile_programs(c, shape, devices, t, train_only=True)[0][1]
        est = estimate_device_mb(c, shape, t)
        old = est + (4 * count_params(shape) - gpu_mixed_gradient_bytes(shape, acc > 1)) / 2**20
        print(f"| {model} | {shape.n_layers} | {acc} | {xla:,.0f} | {est / xla - 1:+.1%} | {old / xla - 1:+.1%} |",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sweep")
    s.add_argument("--target", default="h100-80gb")
    s.add_argument("--rows", default="scratch,lora,qlora,full")
    s.add_argument("--sizes", default="1M,10M,100M,350M,1000M", help="from scratch (--rows scratch): parameters")
    s.add_argument("--fsdp", action="store_true", help="every row split over the target's devices (FSDP)")
    s.add_argument("--reuse", default="", help="an earlier sweep's output: its rows' XLA figures and shardings, "
                   "re-estimated without compiling (after a change of the arithmetic)")
    s.add_argument("--models", default=",".join(sorted(m for m in os.listdir(MODELS) if os.path.isdir(
        os.path.join(MODELS, m)))) if os.path.isdir(MODELS) else "")
    sub.add_parser("sampler")
    sub.add_parser("muon-dp").add_argument("--target", default="v5e-8")
    e = sub.add_parser("eight-bit")
    e.add_argument("--target", default="v5e-1")
    e.add_argument("--model", default="qwen3-0.6b")
    g = sub.add_parser("gpu-grads")
    g.add_argument("--target", default="h100-80gb")
    g.add_argument("--models", default="", help="these models whole instead of the fit's rows (comma-separated)")
    f = sub.add_parser("fit")
    f.add_argument("--target", default="h100-80gb")
    f.add_argument("--verbose", action="store_true")
    f.add_argument("--only", default="", help="e.g. False,True: one (remat, mixed) pair")
    for cmd in ("device-plan", "device"):
        d = sub.add_parser(cmd)
        d.add_argument("--out", required=True)
        d.add_argument("--models", default=MODELS)
        d.add_argument("--row-timeout", type=int, default=150)
        d.add_argument("--rows", default="", help="only the rows whose name holds one of these (comma-separated)")
        d.add_argument("--trainer-order", action="store_true", help="(device) the compiles in the trainer's order")
        d.add_argument("--train-only", action="store_true", help="the train step alone (the 8-bit pairs)")
    r = sub.add_parser("device-row")
    r.add_argument("name")
    r.add_argument("--models", default=MODELS)
    r.add_argument("--trainer-order", action="store_true")
    r.add_argument("--train-only", action="store_true")
    c = sub.add_parser("device-compare")
    c.add_argument("plan")
    c.add_argument("device", nargs="+")
    a = p.parse_args()
    if a.what == "device-row":
        from slm.train.devices import start_backend

        start_backend()
        row = trainer_order_row(a.name, a.models) if a.trainer_order else device_row(a.name, a.models, a.train_only)
        print(json.dumps(row))
        return
    {"sweep": sweep, "sampler": sampler, "fit": fit, "device-plan": device_plan, "device": device,
     "device-compare": device_compare, "muon-dp": muon_dp,
     "eight-bit": eight_bit, "gpu-grads": gpu_grads}[a.what](a)


if __name__ == "__main__":
    main()
