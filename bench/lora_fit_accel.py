"""The LoRA step's memory terms for a GPU or TPU target, fitted to its compiler's buffer assignment, from this CPU.

    .venv/bin/python bench/lora_fit_accel.py collect --out bench/out/lora_gpu.jsonl     # ~190 compiles, ~40 min
    .venv/bin/python bench/lora_fit_accel.py fit bench/out/lora_gpu.jsonl [--verbose]
    .venv/bin/python bench/lora_fit_accel.py collect --target v5e-8 --devices 8 --layers 2,8 --only True,True \
        --dtypes bfloat16,nf4 --models tinyllama-1.1b,llama-3.2-1b,qwen2.5-0.5b,mistral-7b-v0.1 --out F   # ~30 min
    .venv/bin/python bench/lora_fit_accel.py fit F      # the base split over the chips (FSDP): TPU_FSDP_LORA
    .venv/bin/python bench/lora_fit_accel.py collect --full --target v5e-8 --devices 8 --layers 2,8 --only True,True \
        --dtypes float32 --models tinyllama-1.1b,llama-3.2-1b,qwen2.5-0.5b,mistral-7b-v0.1 --out G   # and --devices 4
    .venv/bin/python bench/lora_fit_accel.py fit G      # a full fine-tune split over the chips: TPU_FSDP_FULL
    .venv/bin/python bench/lora_fit_accel.py collect --full --target v5e-1 --layers 2,8 --only True,True \
        --dtypes float32 --models qwen2.5-0.5b,tinyllama-1.1b --out H   # and --layers 2: llama-3.2-1b,mistral-7b-v0.1
    .venv/bin/python bench/lora_fit_accel.py collect --full --target v5e-1 --layers 2,8 --only True,True \
        --dtypes float32 --models smollm2-135m --over d_model=448,n_heads=7,n_kv_heads=1 --out H   # widths not
        # whole 128 lanes: also 704 (11 heads, 1 kv), 960 (15, 5, d_ff 2560), 640 (10, 2, d_ff 1600 and 1616);
        # tinyllama-1.1b --over d_ff=5600
    .venv/bin/python bench/lora_fit_accel.py fit H      # a full fine-tune on one chip: TPU_FULL_UPDATE
    .venv/bin/python bench/lora_fit_accel.py collect --full --optimizer muon --target v5e-1 ... --out M
    .venv/bin/python bench/lora_fit_accel.py fit M      # Muon on one chip: the same columns (not in the estimate yet)
    .venv/bin/python bench/lora_fit_accel.py collect --target v5e-1 --only False,False \
        --models smollm2-135m,qwen2.5-0.5b,mistral-7b-v0.1 --out T   # and --layers 30 (SmolLM2), 8 (Qwen2.5)
    .venv/bin/python bench/lora_fit_accel.py collect --target v5e-1 --only False,False --tokens 32x128,8x512 \
        --dtypes float32,bfloat16 --models smollm2-135m,qwen2.5-0.5b --out U   # and SmolLM2 --layers 30 --tokens 8x512
    .venv/bin/python bench/lora_fit_accel.py fit T U    # the flags' default on a TPU (~80 min of compiles on 2 cores)

`collect`: the trainer's LoRA train step (r16 on q_proj,v_proj, AdamW; slm.train.builder) compiled for one
compile-only device of the target (--plan-for's, slm.train.aot) at SmolLM2-135M's, Qwen2.5-0.5B's, TinyLlama's
and Mistral-7B's shapes cut to 2 and 4 layers, float32, bfloat16 and nf4 bases, seq 512 x 1 and 1,024 x 2, each
of (remat, mixed precision): one JSON line per compile with XLA's peak and the estimate's parts. A file already
holding some lines is continued; `--over` changes the models' shapes (kept in the record). `--devices N`: the
base split over N chips of the target (FSDP), a micro-batch of B sequences on each; `fit` then fits fsdp_columns
(what libtpu holds beyond each chip's shard). `--full`: the step of a full fine-tune instead (every weight
trained, AdamW); `fit` then fits full_fsdp_columns, or on one chip full_columns (libtpu's AdamW update).

`fit`: per (remat, mixed precision), what XLA holds beyond the state (base, adapters, their gradients and AdamW
moments: exact) against the columns of slm.memory.finetune.backward_bytes' accelerator path: without remat
tokens x layers x (D, F, H x S), with remat one block's (every other block's input, D x compute bytes a token,
known), then tokens x logit columns (XLA:CPU's loop beyond them, CHUNKED_BYTES_PER_D, is not
XLA:GPU's: with it as known the worst error doubles), a constant, and the base's casts: a float base whose dtype
is not the compute dtype as its largest kernel and as its blocks (every layer's, one with remat) in the compute
dtype (a 16-bit base's and a float32 one's apart: XLA keeps more of the narrowing cast), an nf4 base as its
largest kernel dequantised, and a float32 base's tied embedding whole again in the compute dtype as the head
(libtpu casts it under mixed precision and relays it out in float32, whatever the loss's chunk). Relative least
squares, non-negative; prints the coefficients (a, b, c, e, 0, k), on a TPU a seventh (bytes a unit of D each
layer past the first holds, whatever the tokens), the casts' (16-bit
kernels, blocks, float32 kernels, blocks, nf4 kernels, tied head) and the worst error on the peak. Several files
fit as one (e.g. 2- and 4-layer compiles with deeper ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "models")
FIT_MODELS = ("smollm2-135m", "qwen2.5-0.5b", "tinyllama-1.1b", "mistral-7b-v0.1")
FIT_TOKENS = ((1, 512), (2, 1024))  # micro-batch, seq
SETTINGS = ((False, False), (False, True), (True, False), (True, True))  # remat, mixed precision
MB = 2**20
MEMORY_PARTS = ("argument", "output", "alias", "temp", "generated_code")  # XLA memory analysis: <part>_size_in_bytes


def collect(a: argparse.Namespace) -> None:
    from slm.train.devices import import_jax_quietly, start_backend

    import_jax_quietly()
    import numpy as np
    from jax.sharding import Mesh

    from slm.memory.estimate import device_breakdown
    from slm.memory.finetune import Finetune, model_shape
    from slm.memory.targets import load_target
    from slm.model.lora import LoraSpec
    from slm.train.aot import compile_only, target_devices
    from slm.train.builder import StepSpec, build, compile_step, compiled_peak

    start_backend()
    target = load_target(a.target)
    n = a.devices  # > 1: the base split over that many chips (FSDP), a micro-batch of B on each
    mesh = Mesh(np.array(target_devices(target)[:n]), ("data",))
    done = set()
    if os.path.exists(a.out):
        with open(a.out) as f:
            done = {key(json.loads(line)) for line in f}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "a") as out:
        over = dict((k, int(v)) for k, v in (kv.split("=") for kv in a.over.split(",") if kv))
        for m in a.models.split(","):
            full = dataclasses.replace(model_shape(os.path.join(MODELS, m)), **over)
            for L in [int(x) for x in a.layers.split(",")]:
                shape = dataclasses.replace(full, n_layers=L)
                for dtype in a.dtypes.split(","):
                    for remat, mixed in [st for st in SETTINGS if not a.only or a.only == f"{st[0]},{st[1]}"]:
                        for B, S in [tuple(map(int, t.split("x"))) for t in a.tokens.split(",")]:
                            rec = dict(model=m, L=L, D=shape.d_model, F=shape.d_ff, H=shape.n_heads,
                                       KV=shape.kv_heads, hd=shape.head_dim, V=shape.vocab_size, dtype=dtype,
                                       remat=remat, mixed=mixed, B=B, S=S, target=target.name, devices=n,
                                       **({"full": True} if a.full else {}), **({"over": over} if over else {}),
                                       **({"optimizer": a.optimizer} if a.optimizer != "adamw" else {}))
                            if key(rec) in done:
                                continue
                            spec = StepSpec(shape, S, B * n, 1, mixed, remat, sharding="fsdp" if n > 1 else "dp",
                                            optimizer=a.optimizer, base_dtype=dtype, platform=target.platform,
                                            lora=None if a.full else LoraSpec(16, 32.0, 0.0, ("q_proj", "v_proj")))
                            t = time.time()
                            with compile_only():
                                compiled = compile_step(build(spec, mesh))[0]
                            rec["xla"] = compiled_peak(compiled)  # a TPU's HBM (slm.train.builder.compiled_peak)
                            ma = compiled.memory_analysis()  # its parts, for a later rule of the figure (fit)
                            rec["memory"] = {k: getattr(ma, f"{k}_size_in_bytes") for k in MEMORY_PARTS}
                            rec["memory"]["peak"] = getattr(ma, "peak_memory_in_bytes", 0)
                            rec["est"] = device_breakdown(shape, S, B, mixed_precision=mixed, gradient_checkpointing=remat,
                                                          finetune=None if a.full else Finetune(16, ("q_proj", "v_proj"), dtype),
                                                          platform=target.platform, devices=n, fsdp=n > 1,
                                                          optimizer=a.optimizer)
                            out.write(json.dumps(rec) + "\n")
                            out.flush()
                            print(f"{m} L{L} {dtype} remat {remat} mixed {mixed} {B}x{S}: XLA {rec['xla'] / MB:,.0f} MB "
                                  f"({time.time() - t:.0f} s)", flush=True)


def key(r: dict) -> tuple:
    return (r["model"], r["L"], r["dtype"], r["remat"], r["mixed"], r["B"], r["S"], r.get("devices", 1),
            r.get("full", False), tuple(sorted(r.get("over", {}).items())), r.get("optimizer", "adamw"))


def shape_of(r: dict):
    """The shape one compile's record was collected at: its model's config.json cut to r["L"] layers, with
    collect --over's changes."""
    from slm.memory.finetune import model_shape

    return dataclasses.replace(model_shape(os.path.join(MODELS, r["model"])), n_layers=r["L"], **r.get("over", {}))


def columns(r: dict) -> tuple[list[float], float]:
    """(the fitted columns, the known part) of one compile: backward_bytes' accelerator path, then the base's
    casts (module docstring)."""
    from slm.memory.finetune import largest_kernel, matmul_weights
    from slm.memory.targets import load_target
    from slm.model.sizing import logit_columns, visible_keys

    T, L, D, F, H, S = r["B"] * r["S"], r["L"], r["D"], r["F"], r["H"], r["S"]
    cb = 2 if r["mixed"] else 4
    shape = shape_of(r)
    block, kernel = matmul_weights(shape)[0], largest_kernel(shape)
    cast = r["dtype"] not in ("nf4", "bfloat16" if r["mixed"] else "float32")  # a float base cast to the compute dtype
    wide, nf4, layers = r["dtype"] == "float32", r["dtype"] == "nf4", 1 if r["remat"] else L
    casts = [cast * (not wide) * kernel * cb, cast * (not wide) * block * cb * layers,  # a 16-bit base's
             cast * wide * kernel * cb, cast * wide * block * cb * layers, nf4 * kernel * cb,  # a float32's, nf4's
             wide * shape.tie_embeddings * shape.vocab_size * D * cb]  # a float32 base's tied head again, whole
    platform = load_target(r.get("target", "h100-80gb")).platform
    V, keys = logit_columns(r["V"], None, platform), S if platform == "gpu" else visible_keys(S)  # a TPU: blocked
    # on a TPU a seventh term: bytes a unit of D each layer past the first holds, whatever the tokens
    layer = [(L - 1) * D] if platform == "tpu" else []
    if r["remat"]:
        return [T * D, T * F, T * H * keys, T * V, 1.0, *layer, *casts], T * (L - 1) * D * cb
    return [T * L * D, T * L * F, T * L * H * keys, T * V, 1.0, *layer, *casts], 0.0


def state(r: dict) -> int:
    e = r["est"]
    return e["base_params"] + e["params"] + e["gradients"] + e["optimizer_state"] + e["accumulation"]


def fsdp_columns(r: dict) -> tuple[list[float], float]:
    """(the fitted columns, slm.memory.finetune.tpu_fsdp_lora_columns, and the known part: the state's shard,
    the activations and logits by today's terms) of one compile with the base split over r["devices"] chips."""
    from slm.memory.estimate import device_breakdown
    from slm.memory.finetune import Finetune, base_cast_bytes, tpu_fsdp_lora_columns

    shape = shape_of(r)
    casts = base_cast_bytes(shape, r["dtype"], r["mixed"], r["remat"], "tpu", True)
    cols = tpu_fsdp_lora_columns(shape, r["dtype"], casts, r["devices"], r["B"] * r["S"], 2 if r["mixed"] else 4)
    dev = device_breakdown(shape, r["S"], r["B"], mixed_precision=r["mixed"], gradient_checkpointing=r["remat"],
                           finetune=Finetune(16, ("q_proj", "v_proj"), r["dtype"]), platform="tpu",
                           devices=r["devices"], fsdp=True)
    return cols, state(r) + dev["activations"] + dev["logits"]


def full_fsdp_columns(r: dict) -> tuple[list[float], float]:
    """(slm.memory.finetune.tpu_fsdp_full_columns, and the known part: today's estimate without them) of one
    full fine-tune's compile (collect --full) with the weights split over r["devices"] chips. The tied column
    is not fitted here since 2026-12-05: a tied embedding's gather is a phase of its own (TPU_FSDP_TIED, the
    largest of it, the backward and the update), set by minimax over the v5e-8 sweep's full-depth rows."""
    from slm.memory.estimate import device_breakdown
    from slm.memory.finetune import tpu_fsdp_full_columns

    shape = shape_of(r)
    dev = device_breakdown(shape, r["S"], r["B"], mixed_precision=r["mixed"], gradient_checkpointing=r["remat"],
                           devices=r["devices"], fsdp=True, platform="tpu")
    known = dev["total"] - dev["gathered_params"] - dev.get("runtime", 0)
    return tpu_fsdp_full_columns(shape, r["devices"], r["B"] * r["S"]), known


def full_columns(r: dict) -> tuple[list[float], float]:
    """(slm.memory.finetune.tpu_full_update_columns, and the known part: the float32 params and gradients and the
    record's optimizer state, exact: AdamW's moments or Muon's) of one full fine-tune's compile on one chip
    (collect --full --devices 1)."""
    from slm.memory.finetune import tpu_full_update_columns
    from slm.model.sizing import count_params, optimizer_state_bytes

    shape = shape_of(r)
    state = optimizer_state_bytes(shape, optimizer=r.get("optimizer", "adamw"))
    return tpu_full_update_columns(shape), 8 * count_params(shape) + state


def fit(a: argparse.Namespace) -> None:
    import numpy as np
    from plan_for_xla import relative_nnls  # bench/, beside this script

    from slm.memory.targets import load_target
    from slm.train.builder import tpu_hbm

    recs = []
    for path in a.data:  # several files fit as one (e.g. 2 and 4 layers, and deeper ones)
        with open(path) as f:
            recs += [json.loads(line) for line in f]
    tpu = [load_target(r.get("target", "h100-80gb")).platform == "tpu" for r in recs]
    if any(t and "memory" not in r for r, t in zip(recs, tpu)):  # collected before the figure's parts were kept
        sys.exit(f"{' '.join(a.data)}: TPU records without their memory analysis (before 2026-11-28 evening): "
                 "recollect them")
    for r, t in zip(recs, tpu):  # a TPU record's figure by today's rule (slm.train.builder.tpu_hbm)
        if t:
            r["xla"] = tpu_hbm(types.SimpleNamespace(**{f"{k}_size_in_bytes": r["memory"][k] for k in MEMORY_PARTS}))
    if any(r.get("optimizer") == "muon" for r in recs):
        return fit_fsdp(a, [r for r in recs if r.get("optimizer") == "muon"], full_columns, MUON_NAMES)
    recs = [r for r in recs if r.get("optimizer", "adamw") == "adamw"]
    if any(r.get("full") and r.get("devices", 1) == 1 for r in recs):
        return fit_fsdp(a, [r for r in recs if r.get("full") and r.get("devices", 1) == 1], full_columns, ONE_NAMES)
    if any(r.get("full") for r in recs):
        return fit_fsdp(a, [r for r in recs if r.get("full")], full_fsdp_columns, FULL_NAMES)
    if any(r.get("devices", 1) > 1 for r in recs):
        return fit_fsdp(a, [r for r in recs if r.get("devices", 1) > 1], fsdp_columns, LORA_NAMES)
    for remat, mixed in SETTINGS:
        rs = [r for r in recs if r["remat"] == remat and r["mixed"] == mixed]
        if not rs:
            continue
        X = np.array([columns(r)[0] for r in rs])
        known = np.array([columns(r)[1] + state(r) for r in rs])
        xla = np.array([r["xla"] for r in rs], float)
        coef = relative_nnls(X, xla - known)
        err = (X @ coef + known) / xla - 1
        today = np.array([(r["est"]["total"] - r["est"].get("runtime", 0)) / r["xla"] - 1 for r in rs])
        a_, b_, c_, e_, k_ = coef[:5]
        layer = f", {coef[5]:.0f}" if X.shape[1] > 11 else ""  # a TPU's per-layer term (columns)
        print(f"({remat}, {mixed}): ({a_:.2f}, {b_:.2f}, {c_:.3f}, {e_:.2f}, 0.0, {k_ / MB:.1f} * MB{layer}), casts "
              f"({', '.join(f'{x:.2f}' for x in coef[-6:])}); worst {np.abs(err).max() * 100:.1f}% over {len(rs)} (the "
              f"estimate in the file: {today.min() * 100:+.0f}% .. {today.max() * 100:+.0f}%)", flush=True)
        if a.verbose:
            for r, e in zip(rs, err):
                print(f"   {r['model']} L{r['L']} {r['dtype']} {r['B']}x{r['S']}: {e * 100:+.1f}%")


LORA_NAMES = ("TPU_FSDP_LORA", "shards", "block", "tied", "untied", "casts nf4", "float32", "tokens", "nf4 layer tokens")
ONE_NAMES = ("TPU_FULL_UPDATE", "blocks", "tied", "untied", "odd-width blocks", "odd-width embeddings")
MUON_NAMES = ("TPU_MUON_UPDATE", *ONE_NAMES[1:])  # the same columns, Muon's records (not in the estimate yet)
FULL_NAMES = ("TPU_FSDP_FULL", "block", "tied", "untied", "tokens", "shards")


def fit_fsdp(a: argparse.Namespace, rs: list[dict], columns_of, names: tuple[str, ...]) -> None:
    """The FSDP columns (`columns_of`: fsdp_columns, full_fsdp_columns), relative to XLA's whole peak."""
    import numpy as np
    from plan_for_xla import relative_nnls  # bench/, beside this script

    X = np.array([columns_of(r)[0] for r in rs])
    known = np.array([columns_of(r)[1] for r in rs])
    xla = np.array([r["xla"] for r in rs], float)
    coef = relative_nnls(X, xla - known, xla)
    err = (X @ coef + known) / xla - 1
    today = np.array([(r["est"]["total"] - r["est"].get("runtime", 0)) / r["xla"] - 1 for r in rs])
    print(f"{names[0]} ({', '.join(names[1:])}) = ({', '.join(f'{c:.2f}' for c in coef)}); worst "
          f"{np.abs(err).max() * 100:.1f}% over {len(rs)}, {int((np.abs(err) <= 0.1).sum())} within 10% (the estimate "
          f"in the file: {today.min() * 100:+.0f}% .. {today.max() * 100:+.0f}%)")
    if a.verbose:
        for r, e, t in zip(rs, err, today):
            name = r["model"] + (f"/{r['D']}" if r.get("over") else "")
            print(f"   {name} L{r['L']} {r['dtype']} on {r['devices']} {r['B']}x{r['S']}: {e * 100:+.1f}% "
                  f"(file {t * 100:+.1f}%)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--out", required=True)
    c.add_argument("--target", default="h100-80gb")
    c.add_argument("--models", default=",".join(FIT_MODELS))
    c.add_argument("--dtypes", default="float32,bfloat16,nf4")
    c.add_argument("--layers", default="2,4")
    c.add_argument("--devices", type=int, default=1, help="> 1: FSDP over that many of the target's chips")
    c.add_argument("--full", action="store_true", help="a full fine-tune's step (every weight trained; --dtypes float32)")
    c.add_argument("--over", default="", help="the models' shapes changed, e.g. d_model=448,n_heads=7,n_kv_heads=1")
    c.add_argument("--tokens", default=",".join(f"{b}x{s}" for b, s in FIT_TOKENS), help="micro-batch x seq, ...")
    c.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"), help="muon: with --full on one chip")
    c.add_argument("--only", default="", help="one (remat, mixed precision) pair, e.g. True,True (as plan_for_xla.py fit)")
    f = sub.add_parser("fit")
    f.add_argument("data", nargs="+")
    f.add_argument("--verbose", action="store_true")
    a = p.parse_args()
    (collect if a.what == "collect" else fit)(a)


if __name__ == "__main__":
    main()
