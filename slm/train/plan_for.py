"""`--plan-for TARGET`: the run prepared as it would be on a GPU or TPU this machine does not have, and every
program it would run on the device compiled ahead of time for that target by XLA (slm.train.aot): the
train step (with its accumulation), the eval step at the eval batch, the sampler's prefill and one-token
decode step at the longest sample. Each program's peak per device is XLA's buffer assignment for the target
plus what stays resident beside it (the train state and a LoRA base that are not its arguments). No step
is trained, no weight is read, no data is tokenized: `--init-from` needs only a config.json.

The verdict keeps MARGINS[platform] of the memory jax gives a program (slm.memory.targets.Target.usable_mb)
for what a compile-only build cannot see: the autotuner's choice of kernels and their cuBLAS/cuDNN workspaces
(a deviceless compile does not autotune), another jax's compiler on the rented machine, and the allocator's
fragmentation. On a GPU that is 15%: the same programs compiled on an H200 (jax 0.11.2) held up to 1.13x
the compile-only figure (bench/plan_for_xla.py device, docs/memory.md).

Two more parts of a run touch the device without a program of their own, and are reported as such: a
checkpoint save copies the resident state to the host (no device buffer beyond the state), and exports
(export_hf.py) merge adapters and dequantise an NF4 base on the host CPU, never on the device.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slm.errors import ConfigError, first_line
from slm.io.atomic import write_json
from slm.io.hf_import import checkpoint_dtype, config_dtype
from slm.memory.estimate import estimate_memory_usage, parse_size
from slm.memory.finetune import Finetune, model_shape
from slm.memory.fit import fit_candidates
from slm.memory.gpu_host import gpu_host_rss, load_transient_bytes
from slm.memory.targets import Target, load_target
from slm.model.sizing import ModelShape, choose_shape, count_params, default_vocab_size
from slm.train.aot import compile_only, target_devices
from slm.train.config import Config, flag_name, lora_target_list
from slm.train.defaults import resolve_defaults
from slm.train.devices import start_backend

Log = Callable[[str], None]
MB = 2**20
MARGINS = {"gpu": 0.15, "tpu": 0.10}  # kept free of the usable memory (docstring); TPU's not measured on a device
SEARCH = 6  # --auto-fit / the suggestion: compile at most this many of the fastest predicted settings
# The device arithmetic's error against XLA's figure where it is fitted to the target's compiler (the GPU sweep,
# docs/memory.md: LoRA -3.6% .. +4.8%, full fine-tunes to +10.8%; from scratch to +5.7%): a setting planned
# further over the verdict's limit than this is not compiled.
FITTED_ERROR = {"gpu": 0.05}
# A failed setting's 8-bit twin is compiled unless the failed one was over by more than this many times the state
# 8-bit moments save: XLA's peak fell by 0.93-2.05x the planned saving, or rose (A10G, v5e; docs/memory.md).
TWIN_MARGIN = 3.0
LEVERS = ("batch_size", "gradient_accumulation_steps", "use_8bit_optimizer", "use_mixed_precision",
          "gradient_checkpointing", "base_dtype", "loss_chunk")


@dataclass
class Program:
    """One row of the plan: a program's planned and compiled peak per device against the target's memory."""

    program: str
    planned_mb: float | None
    xla_peak_mb: float | None
    device_mb: float
    fits: bool | None  # None: not compiled here (say why in `note`)
    note: str = ""
    compile_s: float = 0.0


def plan_shape(c: Config) -> ModelShape:
    """The model's shape without weights, tokenizer or data: --init-from's config.json (a local folder, or only
    that file from the hub), else --target-params with --vocab-size or the vocabulary the BPE would get."""
    if not c.init_from:
        return choose_shape(c.target_params, c.vocab_size or default_vocab_size(c.target_params), c.n_layers,
                            c.d_model, c.n_heads)
    if os.path.isdir(c.init_from):
        return model_shape(c.init_from)
    if os.path.exists(c.init_from) or c.init_from.startswith((".", "/", "~")):
        raise ConfigError(f"--init-from {c.init_from}: not a folder; pass a Hugging Face model folder (only its "
                          f"config.json is read) or a hub id")
    try:
        from huggingface_hub import hf_hub_download

        return model_shape(hf_hub_download(c.init_from, "config.json", revision=c.init_revision))
    except Exception as e:  # noqa: BLE001 - offline, unknown id: one line
        raise ConfigError(f"--init-from {c.init_from}: could not read its config.json ({type(e).__name__}: "
                          f"{first_line(e)[:160]}); pass a local folder holding config.json") from None


def resolved_for(c: Config, shape: ModelShape, platform: str) -> Config:
    """`c` with the defaults a run on `platform` resolves (slm.train.defaults, as the run there would: an
    accelerator's products are float32 unless --matmul-precision says otherwise)."""
    stored = checkpoint_dtype(c.init_from) if c.init_from and os.path.isdir(c.init_from) else stored_dtype(c)
    return resolve_defaults(c, shape, platform, "float32", stored if c.init_from else None)[0]


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of an abstract tree (ShapeDtypeStructs with shardings)."""
    import jax

    def one(x: Any) -> int:
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        return math.prod(shape) * x.dtype.itemsize

    return sum(one(x) for x in jax.tree.leaves(tree))


def too_big(e: Exception) -> tuple[float, str] | None:
    """A compile that ran out of the target's memory: (the MB XLA says it needs, or nan; XLA's words), None for
    any other failure. libtpu says e.g. "the total memory required for HLO temporaries (17.04G) exceeds
    available HBM (15.75G)": the temporaries alone, so the peak is at least that."""
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
        return None
    unit = {"K": 2**-10, "M": 1.0, "G": 2**10, "T": 2**20}
    m = re.search(r"\(([\d.]+)([KMGT])\) exceeds available \w+ \(([\d.]+)([KMGT])\)", text)
    if not m:
        return math.nan, "XLA: ran out of the device's memory"
    need, have = float(m.group(1)) * unit[m.group(2)], float(m.group(3)) * unit[m.group(4)]
    return need, f"XLA: its temporaries alone ({need:,.0f} MB) exceed the device's {have:,.0f} MB"


def measure(name: str, compile_it: Callable[[], Any], beside: int, note: str, target: Target,
            keep: dict | None = None) -> tuple:
    """(name, MB per device, note, seconds) of one program: XLA's peak plus `beside` bytes that stay resident
    next to it; a compile that runs out of the target's memory does not fit (its figure where XLA gives one).
    `keep`, when given, gets the executable under `name` (bench/plan_for_xla.py device runs it on a real GPU)."""
    from slm.train.builder import compiled_peak

    t0 = time.time()
    try:
        compiled = compile_it()
        if keep is not None:
            keep[name] = compiled
        return name, (compiled_peak(compiled) + beside) / MB, note, time.time() - t0
    except Exception as e:  # noqa: BLE001 - out of the target's memory at compile time: it does not fit
        asked, took = too_big(e), time.time() - t0
        if asked is None:
            return name, None, f"XLA could not compile it for {target.name}: {first_line(e)[:160]}", took
        return name, asked[0] if asked[0] == asked[0] else math.inf, asked[1], took


Row = tuple[str, float | None, str, float]  # (program, MB per device, note, compile seconds)


def compile_programs(c: Config, shape: ModelShape, devices: list, target: Target, train_only: bool = False,
                     keep: dict | None = None, train_row: Row | None = None) -> list[Row]:
    """(program, XLA's peak MB per device with what stays resident beside it, note, compile seconds) for each
    device program of the run; train_only: the train step alone (the search's first filter); train_row: the
    train step's row already compiled (the search's), the other programs only. Two programs compile at once (XLA
    compiles outside the GIL): the train step beside the eval step and the sampler, or without it the eval step
    beside the sampler. `keep` gets each executable by program name, and "built" (measure)."""
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from slm.model.generate import Decoder
    from slm.model.lora import merge
    from slm.train.builder import StepSpec, build, compile_step
    from slm.train.evaluate import SAMPLE_TOP_K
    from slm.train.step import make_eval_step

    if c.batch_size % len(devices):
        raise ConfigError(f"--batch-size {c.batch_size} does not split evenly over the {len(devices)} devices of "
                          f"{target.name}; use a multiple of {len(devices)}")
    try:
        built = build(dataclasses.replace(StepSpec.from_config(c, shape), platform=target.platform),
                      Mesh(np.array(devices), ("data",)))
    except (NotImplementedError, ValueError) as e:  # e.g. a kernel the target's jax refuses for this shape
        raise ConfigError(f"--plan-for {target.name}: this run cannot be built for the target "
                          f"({type(e).__name__}: {first_line(e)[:200]})") from None
    if keep is not None:
        keep["built"] = built
    resident = device_bytes(built.abstract) + (device_bytes(built.base_abstract) if built.base_abstract else 0)
    accumulate = f"micro-batch {c.batch_size} x {c.gradient_accumulation_steps}"
    train = lambda: [measure("train step", lambda: compile_step(built)[0], 0, accumulate, target, keep)]  # noqa: E731
    if train_only:
        return train()
    params = built.abstract.params if built.base_abstract is None else merge(built.base_abstract, built.abstract.params)
    beside = resident - device_bytes(params)  # the optimizer state (and step, accumulators) next to the params
    batch = [jax.ShapeDtypeStruct((c.batch_size, c.seq_len), d, sharding=built.batch_sharding)
             for d in (jnp.int32, jnp.int32, jnp.float32)]
    decoder, new = Decoder(built.model), c.seq_len - 1  # the trainer's sample: seq_len tokens after a start token
    # compiled as the trainer's pre-flight compiles it on a GPU (slm.train.evaluate.sampler_ahead): XLA's options
    sampler = lambda: decoder.compiled(params, 1, 1, new, SAMPLE_TOP_K, options={})  # noqa: E731

    def evaluate() -> list[Row]:
        return [measure("eval step", lambda: make_eval_step(built.model).lower(params, *batch).compile(), beside,
                        f"batch {c.batch_size} x {c.seq_len}", target, keep)]

    def sample() -> list[Row]:
        return [measure("sample prefill", lambda: sampler()[0], beside,
                        f"KV cache of {c.seq_len} positions", target, keep),
                measure("sample decode step", lambda: sampler()[1], beside,
                        "one token, cache donated", target, keep)]

    jobs = (train, lambda: evaluate() + sample()) if train_row is None else (lambda: [train_row] + evaluate(), sample)
    with ThreadPoolExecutor(2) as pool:
        rows = [row for job in [pool.submit(j) for j in jobs] for row in job.result()]
    return rows + [("checkpoint save", resident / MB, "device-to-host copy of the resident state: no device program",
                    0.0)]


def limit_mb(target: Target, usable: float) -> float:
    """The most a program may hold on `target` for the verdict: `usable` less the platform's margin."""
    return usable * (1 - MARGINS[target.platform])


def verdicts(rows: list, planned: float, usable: float, target: Target) -> list[Program]:
    out = []
    for name, peak, note, seconds in rows:
        fits = None if peak is None else peak <= limit_mb(target, usable)
        out.append(Program(name, round(planned, 1) if name == "train step" else None,
                           None if peak is None or peak == math.inf else round(peak, 1), round(usable, 1), fits, note,
                           round(seconds, 1)))
    return out


def planned(c: Config, shape: ModelShape, target: Target) -> dict:
    """The arithmetic's figures for the run on the target (slm.memory.estimate, the target's platform)."""
    lora = {} if c.lora_rank is None else {"model": shape, "lora_rank": c.lora_rank, "base_dtype": c.base_dtype,
                                           "lora_targets": lora_target_list(c.lora_targets)}
    return estimate_memory_usage(0, c.seq_len, c.batch_size, c.shuffle_buffer_size, shape=None if lora else shape,
                                 mixed_precision=c.use_mixed_precision, use_8bit_optimizer=c.use_8bit_optimizer,
                                 gradient_accumulation_steps=c.gradient_accumulation_steps,
                                 gradient_checkpointing=c.gradient_checkpointing, devices=target.count,
                                 platform=target.platform, sharding=c.sharding, optimizer=c.optimizer,
                                 loss_chunk=c.loss_chunk, **lora)


def planned_mb(c: Config, shape: ModelShape, target: Target) -> float:
    """The arithmetic's device figure for the train step."""
    return planned(c, shape, target)["device_total_mb"]


def stored_dtype(c: Config) -> str:
    """--init-from's checkpoint dtype as its config.json says (torch_dtype; bfloat16, most published models',
    where it says nothing or the folder is not local)."""
    return config_dtype(c.init_from or "") or "bfloat16"


def host_plan(c: Config, shape: ModelShape, target: Target, est: dict) -> dict | None:
    """The rented GPU machine's host RSS (slm.memory.gpu_host), MB and parts, from the run's estimate (`planned`);
    None on a TPU (not measured)."""
    if target.platform != "gpu":
        return None
    held = "float32" if c.lora_rank is None else "bfloat16" if c.base_dtype == "nf4" else c.base_dtype
    load = load_transient_bytes(shape, stored_dtype(c), held) if c.init_from else 0
    pool = target.usable_mb()[0]  # jax's pool on each card, whatever --memory-budget caps the programs at
    return {k: round(v, 1) for k, v in gpu_host_rss(est, pool, target.count, load).items()}


def host_line(h: dict, target: Target) -> str:
    when = "while the weights load" if h["load"] > h["steps"] else "during the steps"
    return (f"[plan] host RAM of the {target.name} machine: ~{h['peak']:,.0f} MB at its peak, {when} (the trainer "
            f"and the CUDA client {h['runtime']:,.0f} + the GPU allocator's table {h['allocator_table']:,.0f}, 1/32 "
            f"of each card's pool + data {h['data']:,.0f} + "
            + (f"the weights' read {h['weights_read']:,.0f}; the steps: " if h["load"] else "")
            + f"step {h['step_slack']:,.0f} + checkpoint staging {h['checkpoint_staging']:,.0f}); a lower "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION shrinks the table")


def candidates(c: Config, shape: ModelShape, target: Target, usable: float, base_dtypes: tuple[str, ...]) -> list[dict]:
    """The settings --auto-fit ranks (same effective batch), fastest first, all on the target's devices. The
    arithmetic only ranks and drops what it puts over the usable memory (no margin here); search skips more where
    the arithmetic is fitted to the target's compiler, and the compile, with the margin, judges each one."""
    finetune = None if c.lora_rank is None else Finetune(c.lora_rank, tuple(lora_target_list(c.lora_targets)),
                                                        c.base_dtype)
    found = fit_candidates(shape, c.seq_len, c.batch_size, c.gradient_accumulation_steps, int(usable * MB),
                           max_devices=target.count, platform=target.platform, data_mb=0.0, margin=0.0,
                           user=(c.use_8bit_optimizer, c.use_mixed_precision, c.gradient_checkpointing),
                           finetune=finetune, base_dtypes=base_dtypes if finetune else (), optimizer=c.optimizer,
                           loss_chunk=c.loss_chunk, checkpoint_sync="off")
    return [f for f in found if f["devices"] == target.count]


def search(c: Config, shape: ModelShape, devices: list, target: Target, usable: float,
           base_dtypes: tuple[str, ...], log: Log) -> tuple[Config, list] | None:
    """The fastest predicted setting whose every program fits once compiled for the target: (config, rows).
    A setting the arithmetic puts at or above one that did not fit once compiled is passed over without a
    compile (the arithmetic orders settings well even where its level is off), and on a GPU, whose terms are
    fitted to XLA:GPU, so is one whose device figure is over the verdict's limit by more than the arithmetic's
    error (FITTED_ERROR), and so is a failed setting's 8-bit twin whose smaller state cannot bring it under the
    limit (eight_bit_twin): at most SEARCH compiles."""
    limit, ceiling, tried, failed = limit_mb(target, usable), math.inf, 0, []
    for i, f in enumerate(candidates(c, shape, target, usable, base_dtypes)):
        trial = dataclasses.replace(c, **{k: f[k] for k in LEVERS if k in f})
        est = planned(trial, shape, target)
        plan = est["device_total_mb"]
        if plan >= ceiling or (target.platform in FITTED_ERROR and
                               plan - est.get("runtime_mb", 0.0) > limit * (1 + FITTED_ERROR[target.platform])):
            continue
        twin = eight_bit_twin(trial, plan, failed)
        if twin:  # it cannot fit: nor can what the arithmetic puts at or above it
            log(f"[plan] candidate {i + 1} ({changes(c, trial)}) not compiled: {twin}")
            ceiling = min(ceiling, plan)
            continue
        if tried == SEARCH:
            break
        tried += 1
        rows = compile_programs(trial, shape, devices, target, train_only=True)
        if all(r[1] is not None and r[1] <= limit for r in rows):  # the train step fits: now the other programs
            rows = compile_programs(trial, shape, devices, target, train_row=rows[0])
            if all(r[1] is not None and r[1] <= limit for r in rows):
                return trial, rows
        else:
            ceiling = min(ceiling, plan)
        worst = max(rows, key=lambda r: math.inf if r[1] is None else r[1])
        if worst[1] is not None and math.isfinite(worst[1]):  # XLA's figure: how far over the limit it was
            failed.append((i + 1, trial, plan, worst[1] - limit))
        xla = ("not compiled" if worst[1] is None else "more than the device has" if worst[1] == math.inf
               else f"XLA {worst[1]:,.0f} MB")
        log(f"[plan] candidate {i + 1} ({changes(c, trial) or 'as given'}) does not fit once compiled (the {worst[0]}: "
            f"{xla}, over the {limit:,.0f} MB a verdict allows; the step planned {plan:,.0f})")
    return None


def eight_bit_twin(trial: Config, plan: float, failed: list[tuple[int, Config, float, float]]) -> str | None:
    """Why `trial` need not be compiled, or None: it is a failed candidate (number, config, planned MB, MB over
    the limit once compiled) with only --use-8bit-optimizer added, and that one was over by more than TWIN_MARGIN
    times the optimizer state the 8-bit moments are planned to save. XLA's peak falls by 0.93-2.05x that saving,
    or rises (docs/memory.md), so the twin cannot fit; a wider rule (shift every later candidate by the failed
    one's error) would skip settings that fit."""
    for number, before, before_plan, over in failed:
        saved = before_plan - plan
        if dataclasses.replace(before, use_8bit_optimizer=True) == trial and 0 <= TWIN_MARGIN * saved < over:
            return (f"it is candidate {number} with 8-bit optimizer state, which saves {saved:,.0f} MB as planned, "
                    f"and candidate {number} was {over:,.0f} MB over once compiled")
    return None


def changes(before: Config, after: Config) -> str:
    """The flags that turn `before`'s setting into `after`'s."""
    out = []
    for k in LEVERS:
        a, b = getattr(before, k), getattr(after, k)
        if a == b:
            continue
        out.append(flag_name(k) if b is True else f"--no-{flag_name(k)[2:]}" if b is False else f"{flag_name(k)} {b}")
    return " ".join(out)


def plan_for(target_name: str, log: Log = print, train_only: bool = False, **config: Any) -> dict:
    """A notebook's --plan-for: `Config(**config)` planned for `target_name`, every device program compiled for
    it (the train step alone with `train_only`); returns the plan (plan.json's dict, verdicts in "programs")
    without writing a file or refusing. With auto_fit=True the setting is chosen for the target (None
    "setting" when nothing fits)."""
    c = Config(plan_for=target_name, **{"use_streaming": True, **config})
    return _plan(c, log, train_only)[0]


def _plan(c: Config, log: Log, train_only: bool = False) -> tuple[dict, tuple]:
    """(the plan, (its resolved config, shape, devices, target, usable MB)) of --plan-for."""
    target = load_target(c.plan_for)
    usable, why = target.usable_mb()
    if c.memory_budget and parse_size(c.memory_budget) / MB < usable:  # the user's cap on the device, honoured
        usable, why = parse_size(c.memory_budget) / MB, f"--memory-budget {c.memory_budget}, below {why}"
    shape = plan_shape(c)
    c = resolved_for(c, shape, target.platform)
    t0 = time.time()
    start_backend()  # this process computes nothing: the CPU's backend, quietly, beside the compile-only devices
    devices = target_devices(target)
    log(f"[plan] {target.name}: {target.count} x {target.facts['device']}, {target.device_mb:,.0f} MB each; a "
        f"program may use {usable:,.0f} MB ({why}); a verdict keeps {MARGINS[target.platform]:.0%} of it free "
        f"(autotuned kernels' workspaces, the rented machine's jax, fragmentation: what a compile-only build cannot "
        f"see)")
    plan = {"target": target.name, "device": target.facts["device"], "devices": target.count,
            "usable_mb": round(usable, 1), "usable_is": why, "margin": MARGINS[target.platform]}
    with compile_only():
        if c.auto_fit:
            found = search(c, shape, devices, target, usable, (), log)
            if found is None:
                return {**plan, "setting": None, "programs": []}, (c, shape, devices, target, usable)
            chosen, rows = found
            log(f"[auto-fit] chosen for {target.name}: {changes(c, chosen) or 'the settings as given'} (the fastest "
                f"predicted setting whose every program fits once compiled)")
            c = chosen
        else:
            rows = compile_programs(c, shape, devices, target, train_only)
    est = planned(c, shape, target)
    programs = verdicts(rows, est["device_total_mb"], usable, target)
    for line in table(programs):
        log(line)
    host = host_plan(c, shape, target, est)
    log(host_line(host, target) if host else f"[plan] host RAM of the {target.name} machine: not predicted (a TPU "
        f"host's runtime was never measured)")
    plan.update({"setting": setting_of(c, shape), "programs": [dataclasses.asdict(p) for p in programs],
                 "host_rss_mb": host, "compile_s": round(time.time() - t0, 1)})
    return plan, (c, shape, devices, target, usable)


def plan_main(config: Config, log: Log = print) -> dict:
    """--plan-for: compile the run's device programs for the target, print the table, write plan.json; returns
    the plan, or raises ConfigError (exit 2) naming the program that does not fit and the smallest change
    that does (checked by compiling it)."""
    plan, (c, shape, devices, target, usable) = _plan(dataclasses.replace(config), log)
    if plan["setting"] is None:
        raise ConfigError(f"--plan-for {target.name} --auto-fit: none of the {SEARCH} fastest settings that keep "
                          f"the effective batch fits once compiled; lower --seq-len, use --lora-rank or a lower "
                          f"--base-dtype, or a larger target")
    out = c.output_dir or os.path.join("runs", f"plan-{target.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "plan.json"), plan)
    log(f"[plan] written {os.path.join(out, 'plan.json')} ({plan['compile_s']:.0f} s of compiling)")
    bad = next((Program(**p) for p in plan["programs"] if not p["fits"]), None)
    if bad is not None:
        raise ConfigError(refusal(c, shape, devices, target, usable, bad, log))
    return plan


def refusal(c: Config, shape: ModelShape, devices: list, target: Target, usable: float, bad: Program, log: Log) -> str:
    """The one line for a program that does not fit (or was not compiled), with the smallest change that fits."""
    if bad.fits is None:
        return f"--plan-for {target.name}: the {bad.program} could not be compiled for the target here ({bad.note})"
    need = "more than the device has" if bad.xla_peak_mb is None else f"{bad.xla_peak_mb:,.0f} MB" + (
        " or more" if "alone" in bad.note else "")
    head = (f"--plan-for {target.name}: the {bad.program} needs {need} per device, over "
            f"{limit_mb(target, usable):,.0f} MB ({1 - MARGINS[target.platform]:.0%} of the {usable:,.0f} MB jax gives a "
            f"program)")
    lowered = ("bfloat16", "nf4") if c.lora_rank is not None else ()
    with compile_only():
        found = search(c, shape, devices, target, usable, lowered, log)
    if found is None:
        return head + "; nothing at this effective batch fits: lower --seq-len, use --lora-rank, or a larger target"
    fix = changes(c, found[0])
    auto = "" if "--base-dtype" in fix else " (or add --auto-fit)"
    return head + f"; this fits once compiled: {fix}{auto}"


def setting_of(c: Config, shape: ModelShape) -> dict:
    keys = ("init_from", "target_params", "seq_len", "batch_size", "gradient_accumulation_steps", "use_mixed_precision",
            "gradient_checkpointing", "use_8bit_optimizer", "sharding", "optimizer", "matmul_precision", "loss_chunk",
            "lora_rank", "lora_targets", "base_dtype")
    return {**{k: getattr(c, k) for k in keys}, "params": count_params(shape)}


def table(programs: list[Program]) -> list[str]:
    def mb(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    def verdict(p: Program) -> str:
        return {True: "fits", False: "DOES NOT FIT", None: "NOT COMPILED"}[p.fits]

    rows = [("program", "planned MB", "XLA peak MB/device", "usable MB", "verdict", "")]
    rows += [(p.program, mb(p.planned_mb), mb(p.xla_peak_mb), mb(p.device_mb), verdict(p), p.note) for p in programs]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return [f"[plan] {r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  "
            f"{r[4]:<{widths[4]}}  {r[5]}".rstrip() for r in rows]
