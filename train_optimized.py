"""Streaming small-LM trainer: CLI and train loop.

    python train_optimized.py --use-streaming --dataset-id data.txt --target-params 1000000 --max-time 120

`train(Config(...))` is the same run from a notebook. The pieces: hf_dataset_loader (sources),
streaming_data_loader (batches), tokenizer_utils, model_sizing (shape), model (Flax transformer),
train_step (optimizer + jitted steps), checkpointing (orbax), run_metrics (RSS, MFU, metrics.jsonl).
"""

from __future__ import annotations

import time

_PROCESS_START = time.time()  # --max-time counts from here when run as a script

import argparse
import dataclasses
import hashlib
import itertools
import json
import math
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from config_file import ConfigFileError, parse_args_with_config
from devices import ShardingError
from hf_dataset_loader import (
    DatasetError,
    HubDataset,
    LocalFiles,
    TextSource,
    encode_documents,
    pack_rows,
    prepare_sequences,
    resolve_source,
)
from model_sizing import (
    SizingError,
    choose_shape,
    count_params,
    default_learning_rate,
    default_vocab_size,
    describe,
    flops_per_token,
)
from run_metrics import MetricsLog, device_peak_flops, peak_rss_mb, rss_mb
from memory_estimate import fit_candidates
from memory_monitor import MemoryMonitor, jax_device_bytes, parse_size, stop_requested
from preflight import available_host_mb, compile_plan, describe_plan
from streaming_data_loader import StreamingDataLoader, estimate_memory_usage
from tokenizer_utils import TokenizerError, eot_id, load_tokenizer, token_byte_lengths, train_bpe
from tracking import Trackers, TrackingError, plot_loss, require_wandb


class ConfigError(ValueError):
    """A bad flag value; the message names the flag and the fix."""


USER_ERRORS = (ConfigError, DatasetError, TokenizerError, SizingError, ShardingError, TrackingError)


@dataclass
class Config:
    # data
    dataset_id: str | None = field(default=None, metadata={"help": "Hub id (e.g. roneneldan/TinyStories), file, directory or glob. Default: TinyStories when the hub answers, else the built-in offline corpus"})
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration name"})
    split: str = field(default="train", metadata={"help": "Split to train on"})
    text_column: str | None = field(default=None, metadata={"help": "Column holding the text (auto-detected: text, content, story, ...)"})
    eval_dataset_id: str | None = field(default=None, metadata={"help": "Separate held-out source, scored whole. Default: the source's validation split, else its first documents (held out from training)"})
    use_streaming: bool = field(default=False, metadata={"help": "Stream and tokenize on the fly in constant memory (off: load and tokenize everything up front)"})
    shuffle_buffer_size: int = field(default=10_000, metadata={"help": "Documents in the shuffle buffer (0 or 1: no shuffling)"})
    max_examples: int | None = field(default=None, metadata={"help": "Use at most this many training documents per epoch"})
    # tokenizer
    tokenizer: str | None = field(default=None, metadata={"help": "Path to a tokenizer.json; otherwise a byte-level BPE is trained on the stream"})
    vocab_size: int | None = field(default=None, metadata={"help": "Vocabulary of the BPE to train (default: 512-8192 by --target-params)"})
    # model
    target_params: int = field(default=1_000_000, metadata={"help": "Parameter target; the shape is chosen within 5%% (see model_sizing.py)"})
    n_layers: int | None = field(default=None, metadata={"help": "Override: number of layers"})
    d_model: int | None = field(default=None, metadata={"help": "Override: model width"})
    n_heads: int | None = field(default=None, metadata={"help": "Override: attention heads"})
    seq_len: int = field(default=128, metadata={"help": "Tokens per training sequence"})
    stride: int | None = field(default=None, metadata={"help": "Tokens between sequence starts (default --seq-len: no overlap, nothing lost)"})
    # optimisation
    batch_size: int = field(default=32, metadata={"help": "Sequences per micro-batch"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step (optax.MultiSteps)"})
    learning_rate: float | None = field(default=None, metadata={"help": "Peak AdamW learning rate (default: 6e-4 * sqrt(125M / params), at most 1e-2)"})
    warmup_steps: int = field(default=100, metadata={"help": "Linear warmup (optimizer steps; capped at 20%% of the run when its length is known)"})
    weight_decay: float = field(default=0.1, metadata={"help": "Decoupled weight decay on matrices"})
    grad_clip: float = field(default=1.0, metadata={"help": "Clip gradients to this global norm (0: off)"})
    use_mixed_precision: bool = field(default=False, metadata={"help": "bfloat16 compute with float32 master weights"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute each block's activations in the backward pass (less memory, ~30%% more compute)"})
    use_8bit_optimizer: bool = field(default=False, metadata={"help": "Keep Adam's moments as 8-bit block-quantized codes: ~2 bytes/param instead of 8 (adam8bit.py)"})
    # length of the run
    epochs: int | None = field(default=None, metadata={"help": "Passes over the data, reshuffled each epoch (default: repeat until --max-steps/--max-time, else 1)"})
    max_steps: int | None = field(default=None, metadata={"help": "Stop after this many optimizer steps"})
    max_time: float | None = field(default=None, metadata={"help": "Wall-clock budget in seconds from process start: train until spent, then eval and save"})
    seed: int = field(default=0, metadata={"help": "Seed for init, shuffling and sampling"})
    # evaluation, logging, outputs
    eval_every: int = field(default=500, metadata={"help": "Evaluate (and write a sample) every N optimizer steps, and at the end"})
    eval_tokens: int = field(default=65_536, metadata={"help": "Tokens scored per eval (a separate --eval-dataset-id file is scored whole)"})
    log_every: int = field(default=10, metadata={"help": "Log a metrics row every N optimizer steps"})
    checkpoint_every: int = field(default=1000, metadata={"help": "Save a checkpoint every N optimizer steps, and at the end"})
    checkpoint_minutes: float | None = field(default=None, metadata={"unset": "off", "help": "Also save a checkpoint every M minutes of wall time"})
    keep_checkpoints: int = field(default=3, metadata={"help": "Keep the newest N checkpoints plus the best by eval loss (the newest is never deleted)"})
    skip_nonfinite: int = field(default=0, metadata={"help": "Skip up to N steps whose loss or gradient is NaN/Inf (each logged) before stopping the run"})
    output_dir: str | None = field(default=None, metadata={"help": "Where outputs go (default: a new folder under runs/)"})
    cpu_devices: int | None = field(default=None, metadata={"help": "CPU only: host devices to split each batch over (default: one per core, at most 8; see devices.py)"})
    sharding: str = field(default="dp", metadata={"help": "dp: each device holds the whole train state (batch split over the devices); fsdp: params and optimizer state split over them too (less memory per device, same steps)"})
    coordinator_address: str | None = field(default=None, metadata={"unset": "off", "help": "Several processes (jax.distributed): host:port of process 0, with --num-processes and --process-id (clusters JAX detects, e.g. SLURM, need none of them)"})
    num_processes: int | None = field(default=None, metadata={"unset": "off", "help": "Several processes: how many; each reads its own part of the data and --batch-size is split over all devices"})
    process_id: int | None = field(default=None, metadata={"unset": "off", "help": "Several processes: this one's index, 0 to --num-processes - 1 (process 0 writes logs, samples and summary)"})
    # memory
    memory_budget: str | None = field(default=None, metadata={"unset": "off", "help": "Refuse to start (exit 2) if the predicted peak exceeds this, e.g. 8GB: host RSS on CPU, device memory on an accelerator"})
    auto_fit: bool = field(default=False, metadata={"help": "With --memory-budget: pick micro-batch, accumulation, 8-bit state, mixed precision and remat to fit, keeping the effective batch"})
    preset: str | None = field(default=None, metadata={"unset": "off", "help": "limited-ram, medium-ram, high-ram, tpu or auto: the guide's settings for that hardware; explicit flags win"})
    resume: str | None = field(default=None, metadata={"unset": "off", "nargs": "?", "const": "latest", "help": "Continue a run exactly (model, optimizer, schedule, data stream) from its newest checkpoint: --resume with --output-dir, or --resume RUN_DIR"})
    memory_alert_mb: float | None = field(default=None, metadata={"unset": "off", "help": "Print a warning each time host RSS crosses this many MB"})
    # tracking (TensorBoard event files and loss.png are always written to the output dir)
    wandb: bool = field(default=False, metadata={"help": "Also log to Weights & Biases (pip install wandb; WANDB_MODE=offline works)"})
    wandb_project: str | None = field(default=None, metadata={"unset": "slm-trainer", "help": "W&B project"})


# The guide's recommended settings per hardware (seed 003): RAM tiers by total host memory, and TPU.
PRESETS = {
    "limited-ram": dict(batch_size=8, gradient_accumulation_steps=8, use_streaming=True, use_mixed_precision=True,
                        use_8bit_optimizer=True, shuffle_buffer_size=5_000),
    "medium-ram": dict(batch_size=32, gradient_accumulation_steps=4, use_streaming=True, shuffle_buffer_size=10_000),
    "high-ram": dict(batch_size=64, gradient_accumulation_steps=2, use_streaming=True, shuffle_buffer_size=50_000),
    "tpu": dict(batch_size=128, use_streaming=True, use_mixed_precision=True, shuffle_buffer_size=100_000),
}


def auto_preset(total_ram_gb: float, platform: str) -> str:
    """--preset auto: tpu on a TPU, else by total RAM (<8 GB limited, 8-16 GB medium, more high)."""
    if platform == "tpu":
        return "tpu"
    return "limited-ram" if total_ram_gb < 8 else "medium-ram" if total_ram_gb <= 16 else "high-ram"


def apply_preset(c: Config, explicit: set[str] | None = None) -> list[str]:
    """Fill `c` from its --preset, except fields set explicitly (default: those that differ from Config's defaults)."""
    name = c.preset
    if name == "auto":
        import jax

        ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        name = auto_preset(ram_gb, jax.devices()[0].platform)
    defaults = Config()
    if explicit is None:
        explicit = {f.name for f in dataclasses.fields(Config) if getattr(c, f.name) != getattr(defaults, f.name)}
    changed = []
    for k, v in PRESETS[name].items():
        if k not in explicit and getattr(c, k) != v:
            setattr(c, k, v)
            changed.append(f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}")
    c.preset = name
    return changed


def flag_table_rows() -> list[str]:
    """The README's flag table, one markdown row per flag (a test keeps the README equal to this)."""
    rows = []
    for f in dataclasses.fields(Config):
        d = f.default
        d = "off" if d is False else f.metadata.get("unset", "auto") if d is None else f"{d:,}" if type(d) is int else d
        rows.append(f"| `--{f.name.replace('_', '-')}` | {d} | {f.metadata['help'].replace('%%', '%')} |")
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a small decoder-only language model on a streamed dataset (JAX/Flax).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
            continue
        base = str(f.type).split(" | ")[0].strip("'")
        kind = {"int": int, "float": float, "str": str}[base]
        extra = {k: f.metadata[k] for k in ("nargs", "const") if k in f.metadata}
        p.add_argument(flag, type=kind, default=f.default, metavar=base.upper(), help=f.metadata["help"], **extra)
    return p


def validate(c: Config) -> None:
    positive = ["checkpoint_minutes", "keep_checkpoints", "memory_alert_mb", "batch_size", "gradient_accumulation_steps", "target_params", "epochs", "eval_every", "eval_tokens",
                "log_every", "checkpoint_every", "max_steps", "max_time", "learning_rate", "vocab_size",
                "n_layers", "d_model", "n_heads", "max_examples", "cpu_devices", "num_processes"]
    for name in positive:
        v = getattr(c, name)
        if v is not None and not v > 0:
            raise ConfigError(f"--{name.replace('_', '-')} {v}: must be positive")
    if c.seq_len < 2:
        raise ConfigError(f"--seq-len {c.seq_len}: must be at least 2")
    if c.stride is not None and not 1 <= c.stride <= c.seq_len:
        raise ConfigError(f"--stride {c.stride}: must be between 1 and --seq-len ({c.seq_len})")
    for name in ("warmup_steps", "weight_decay", "grad_clip", "shuffle_buffer_size", "skip_nonfinite"):
        if getattr(c, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(c, name)}: must be >= 0")
    if c.sharding not in ("dp", "fsdp"):
        raise ConfigError(f"--sharding {c.sharding}: choose dp (replicated state) or fsdp (state split over devices)")
    if c.process_id is not None and not 0 <= c.process_id < (c.num_processes or 1):
        raise ConfigError(f"--process-id {c.process_id}: must be between 0 and --num-processes - 1 "
                          f"({(c.num_processes or 1) - 1})")
    if c.memory_budget is not None:
        try:
            parse_size(c.memory_budget)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if c.auto_fit and not c.memory_budget:
        raise ConfigError("--auto-fit needs --memory-budget (e.g. --memory-budget 4GB)")
    if c.preset is not None and c.preset not in PRESETS and c.preset != "auto":
        raise ConfigError(f"--preset {c.preset}: choose one of {', '.join([*PRESETS, 'auto'])}")
    if c.tokenizer and c.vocab_size:
        raise ConfigError("--tokenizer and --vocab-size: give one (the vocabulary comes from the tokenizer file)")


# What a resumed run must share with the run it continues; anything else (--max-steps, --max-time,
# logging, eval and checkpoint cadence, memory alerts) may change.
RESUME_IDENTITY = ("dataset_id", "dataset_config", "split", "text_column", "eval_dataset_id", "use_streaming",
                   "shuffle_buffer_size", "max_examples", "vocab_size", "n_layers", "d_model", "n_heads", "seq_len",
                   "stride", "batch_size", "gradient_accumulation_steps", "learning_rate", "warmup_steps",
                   "weight_decay", "grad_clip", "use_mixed_precision", "gradient_checkpointing", "use_8bit_optimizer",
                   "epochs", "seed")


# Per-launch settings: a resumed or reproduced run takes them from its own command line only.
LAUNCH_ONLY = ("coordinator_address", "num_processes", "process_id")


def resume_config(c: Config, explicit: set[str] | None = None) -> Config:
    """The config of the run `c.resume` continues, checked against `c`: the resumed run's settings.

    `explicit`: the flags given on the command line (default: the fields that differ from Config's defaults).
    """
    run = c.output_dir if c.resume == "latest" else c.resume
    if run is None:
        raise ConfigError("--resume: give the run to continue (--resume RUN_DIR, or --resume with --output-dir)")
    run = os.path.normpath(run)
    if os.path.basename(os.path.dirname(run)) == "checkpoints":  # a checkpoint dir: its run is two levels up
        run = os.path.dirname(os.path.dirname(run))
    try:
        with open(os.path.join(run, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume {run}: no readable config.json there ({e}); pass the output dir of a run")
    defaults = Config()
    if explicit is None:
        explicit = {f.name for f in dataclasses.fields(Config) if getattr(c, f.name) != getattr(defaults, f.name)}
    differs = []
    for k in RESUME_IDENTITY:
        given, was = getattr(c, k), saved.get(k)
        if k in explicit and given != was:
            differs.append(f"--{k.replace('_', '-')} {given} (the run used {was})")
    if "target_params" in explicit and c.target_params != saved.get("target_params"):
        differs.append(f"--target-params {c.target_params} (the run used {saved.get('target_params')})")
    if c.tokenizer and os.path.abspath(c.tokenizer) != os.path.abspath(os.path.join(run, "tokenizer.json")):
        differs.append(f"--tokenizer {c.tokenizer} (the run has its own tokenizer.json)")
    if differs:
        raise ConfigError(f"--resume {run}: cannot change the model, tokenizer, data or optimizer of a run: "
                          + "; ".join(differs) + ". Only --max-steps, --max-time and logging may change")
    fields = {f.name for f in dataclasses.fields(Config)}
    keep = {k: getattr(c, k) for k in fields if k not in RESUME_IDENTITY and k not in ("target_params", "tokenizer")
            and k in explicit}  # what this command changes; the rest as the run had it
    resumed = Config(**{**{k: saved[k] for k in fields if k in saved}, **keep})
    resumed.output_dir, resumed.resume = run, c.resume
    for k in LAUNCH_ONLY:  # how this process was started, never inherited from the saved run
        setattr(resumed, k, getattr(c, k))
    resumed.tokenizer = os.path.join(run, "tokenizer.json")
    resumed.vocab_size = None  # it comes with the tokenizer
    resumed.preset, resumed.auto_fit = None, False  # their choices are in the saved settings already
    return resumed


def prepare_output_dir(c: Config) -> str:
    out = c.output_dir
    if out is None:
        out = base = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        n = 1
        while os.path.exists(out):  # two runs started in the same second
            out, n = f"{base}-{n}", n + 1
    elif os.path.exists(os.path.join(out, "config.json")) and not c.resume:
        raise ConfigError(f"--output-dir {out}: already holds a run (config.json); choose a new directory "
                          f"so nothing saved there is overwritten")
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".write-test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--output-dir {out}: not writable ({e.strerror}); choose another directory")
    return out


# ------------------------------------------------------------------------------------------------
# Data: tokenizer, held-out set, training batches


def held_out_split(source: TextSource, chars: int) -> tuple[list[str], bool]:
    """The first documents of the stream totalling >= `chars` characters, and whether any are left after them."""
    docs, total = [], 0
    stream = source.documents()
    for doc in stream:
        docs.append(doc)
        total += len(doc)
        if total >= chars:
            break
    return docs, next(stream, None) is not None


def build_tokenizer(c: Config, source: TextSource, skip_documents: int, log) -> tuple[object, float]:
    """Load --tokenizer or train a BPE on the training stream. Returns (tokenizer, seconds)."""
    t = time.time()
    if c.tokenizer:
        return load_tokenizer(c.tokenizer), time.time() - t
    vocab = c.vocab_size or default_vocab_size(c.target_params)
    docs = source.documents(skip_head=skip_documents)
    tok = train_bpe(docs, vocab)
    log(f"[tokenizer] trained a byte-level BPE with {tok.get_vocab_size():,} tokens in {time.time() - t:.1f}s")
    return tok, time.time() - t


@dataclass
class EvalSet:
    """Packed held-out rows: inputs/targets (N, L), a mask for the padded tail, bytes per row."""

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    n_bytes: int
    name: str


def build_eval_set(docs, tokenizer, seq_len: int, max_tokens: int | None, name: str) -> EvalSet:
    eot = eot_id(tokenizer)
    parts, n = [], 0
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == 256:
            parts.append(encode_documents(tokenizer, batch, eot))
            n += len(parts[-1])
            batch = []
            if max_tokens and n > max_tokens:
                break
    if batch:
        parts.append(encode_documents(tokenizer, batch, eot))
    if not parts:
        raise DatasetError(f"{name}: the held-out set is empty; pass --eval-dataset-id or more data")
    # Score tokens 1..n (every token after the first, which has no context), packed with no overlap.
    tokens = np.concatenate([[eot], np.concatenate(parts)]).astype(np.int32)
    if max_tokens:
        tokens = tokens[: max_tokens + 1]
    n_targets = len(tokens) - 1
    n_rows = math.ceil(n_targets / seq_len)
    padded = np.full(n_rows * seq_len + 1, eot, np.int32)
    padded[: len(tokens)] = tokens
    rows, _ = pack_rows(padded, seq_len, seq_len)
    mask = (np.arange(n_rows * seq_len) < n_targets).reshape(n_rows, seq_len).astype(np.float32)
    n_bytes = int(token_byte_lengths(tokenizer)[tokens[1:]].sum())
    return EvalSet(rows[:, :-1], rows[:, 1:], mask, n_bytes, name)


def full_load_batches(inputs: np.ndarray, targets: np.ndarray, batch_size: int, seed: int, epoch: int) -> Iterator[dict]:
    order = np.random.default_rng([seed, epoch]).permutation(len(inputs))
    for i in range(0, len(order) - batch_size + 1, batch_size):
        idx = np.sort(order[i : i + batch_size])
        yield {"input_ids": inputs[idx], "targets": targets[idx]}


# ------------------------------------------------------------------------------------------------
# The run


def train(config: Config, start_time: float | None = None, log=print, explicit: set[str] | None = None) -> dict:
    """Run training as configured; returns the summary (also written to summary.json)."""
    c = dataclasses.replace(config)
    start = time.time() if start_time is None else start_time
    validate(c)
    if c.wandb:
        require_wandb()
    if c.resume:
        c = resume_config(c, explicit)
    from devices import init_distributed  # before anything asks jax for its devices (--preset auto does)

    pid, nproc = init_distributed(c.coordinator_address, c.num_processes, c.process_id, c.cpu_devices)
    if pid != 0:
        log = _silent  # one process speaks for all
    if c.preset and not c.resume:
        if c.preset == "auto":  # it asks jax for the platform: the host devices must be set up first
            from devices import configure_cpu_devices

            configure_cpu_devices(c.cpu_devices)
        changed = apply_preset(c, explicit)
        if nproc > 1:  # "auto" reads each host's RAM: process 0's choice for all
            keys = sorted({k for preset in PRESETS.values() for k in preset})
            chosen = _from_process0(lambda: {k: getattr(c, k) for k in keys}, pid, nproc)
            c = dataclasses.replace(c, **chosen)
        log(f"[preset] {c.preset}: {', '.join(changed) or 'nothing to change (explicit flags win)'}")
        validate(c)
    # Process 0 makes (or checks) the output dir; every process learns its name, or the error.
    out = _from_process0(lambda: os.path.abspath(prepare_output_dir(c)) if nproc > 1 else prepare_output_dir(c),
                         pid, nproc)
    os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
    monitor = MemoryMonitor(alert_mb=c.memory_alert_mb, on_alert=log).start()  # RSS from here on
    signals: list[str] = []  # SIGTERM/SIGINT seen: finish the step, save, summarise, return

    def on_signal(signum, frame) -> None:
        if signals and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C aborts at once
        signals.append(signal.Signals(signum).name)
        log(f"[run] {signals[-1]}: finishing this step, then saving a checkpoint (Ctrl-C again aborts at once)")

    previous = {}
    if threading.current_thread() is threading.main_thread():  # handlers can only be set there
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _train(c, start, out, monitor, log, signals, pid, nproc)
    finally:
        monitor.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _silent(*args, **kwargs) -> None:
    pass


def _from_process0(fn, pid: int, nproc: int):
    """fn() run on process 0 only (JSON-able result), shared with every process; so is its user error,
    so no process is left waiting in a collective while another exits."""
    if nproc == 1:
        return fn()
    from devices import gather_json

    try:
        sent = {"value": fn()} if pid == 0 else {}
    except USER_ERRORS as e:
        sent = {"error": str(e)}
    sent = gather_json(sent)[0]
    if "error" in sent:
        raise ConfigError(sent["error"])
    return sent["value"]


def _train(c: Config, start: float, out: str, monitor: MemoryMonitor, log, signals: list[str],
           pid: int = 0, nproc: int = 1) -> dict:
    primary = pid == 0  # writes config, metrics, samples and summary; every process saves checkpoints

    # Tokenizer before model (the seeds' lesson): data setup needs no jax.
    source = resolve_source(c.dataset_id, dataset_config=c.dataset_config, split=c.split,
                            text_column=c.text_column, streaming=c.use_streaming, log=log)
    if c.eval_dataset_id:
        eval_source = resolve_source(c.eval_dataset_id, text_column=c.text_column, flag="--eval-dataset-id", log=log)
        if isinstance(eval_source, HubDataset):  # a hub id: its validation split when it has one
            eval_source = eval_source.validation() or eval_source
    else:
        eval_source = source.validation()
    skip_docs, heldout_docs = 0, None
    if eval_source is None:  # hold out the first documents: ~6 chars/token covers --eval-tokens, <= 10% of a file
        budget = c.eval_tokens * 6 if source.size_bytes is None else min(c.eval_tokens * 6, source.size_bytes // 10)
        heldout_docs, rest = held_out_split(source, max(budget, 1))
        skip_docs = len(heldout_docs)
        if not heldout_docs:
            raise DatasetError(f"{source.name}: the dataset has no documents (empty file or no text); check --dataset-id")
        if not rest:
            raise DatasetError(f"{source.name}: holding out --eval-tokens {c.eval_tokens} leaves nothing to train on; "
                               f"pass --eval-dataset-id, a smaller --eval-tokens, or more documents")
    if nproc == 1:
        tokenizer, tok_seconds = build_tokenizer(c, source, skip_docs, log)
        tokenizer.save(os.path.join(out, "tokenizer.json"))
    else:  # process 0's tokenizer (or its error), sent to all: no shared filesystem needed
        from tokenizers import Tokenizer

        def build() -> list:
            tok, seconds = build_tokenizer(c, source, skip_docs, log)
            tok.save(os.path.join(out, "tokenizer.json"))
            return [tok.to_str(), seconds]

        text, tok_seconds = _from_process0(build, pid, nproc)
        tokenizer = Tokenizer.from_str(text)
    vocab = tokenizer.get_vocab_size()
    shape = choose_shape(c.target_params, vocab, c.n_layers, c.d_model, c.n_heads)
    n_params = count_params(shape)
    c.learning_rate = c.learning_rate or default_learning_rate(n_params)

    if eval_source is not None:
        whole = isinstance(eval_source, LocalFiles)  # a separate local file is scored whole, a hub split capped
        eval_set = build_eval_set(eval_source.documents(), tokenizer, c.seq_len, None if whole else c.eval_tokens,
                                  eval_source.name)
    else:
        eval_set = build_eval_set(heldout_docs, tokenizer, c.seq_len, c.eval_tokens, f"{source.name} (held-out head)")
        del heldout_docs

    if c.use_streaming:
        data_mb = estimate_memory_usage(0, c.seq_len, c.batch_size, c.shuffle_buffer_size)["streaming_mb"]
    else:
        inputs, targets = prepare_sequences(source, tokenizer, c.seq_len, c.stride, c.max_examples, skip_docs)
        inputs, targets = inputs[pid::nproc], targets[pid::nproc]  # this process's rows
        if len(inputs) < c.batch_size // nproc:
            raise DatasetError(f"{source.name}: {len(inputs)} sequences, fewer than --batch-size {c.batch_size}")
        data_mb = (inputs.nbytes + targets.nbytes) / 2**20
        log(f"[data] full load: {inputs.shape[0]:,} sequences, {data_mb:.1f} MB in memory")

    # Model and optimizer (jax imported only now), then the memory pre-flight on the compiled step.
    import jax
    import jax.numpy as jnp

    from devices import any_process, configure_cpu_devices, device_bytes, from_process0, gather_json, global_batch, needs_step_sync, replicated_batch, shardings

    configure_cpu_devices(c.cpu_devices)
    from adam8bit import state_bytes
    from checkpointing import Checkpointer
    from model import init_params
    from train_step import init_state, lr_at, make_eval_step, make_sampler

    budget = parse_size(c.memory_budget) if c.memory_budget else None
    platform = jax.devices()[0].platform
    if c.auto_fit:
        limit = available_host_mb() if platform == "cpu" else None
        fit_to = min(budget, int(limit * 2**20)) if limit else budget
        choices = fit_candidates(shape, c.seq_len, c.batch_size, c.gradient_accumulation_steps, fit_to,
                                 max_devices=len(jax.devices()), platform=platform, data_mb=data_mb,
                                 user=(c.use_8bit_optimizer, c.use_mixed_precision, c.gradient_checkpointing))
        if not choices:
            raise ConfigError(f"--auto-fit: nothing fits --memory-budget {c.memory_budget} for this model "
                              f"({n_params:,} params) at --seq-len {c.seq_len}; raise the budget or lower "
                              f"--target-params / --seq-len")
    else:
        choices = [{}]
    if nproc > 1:  # each host reads its own free memory: process 0's candidates for all
        choices = _from_process0(lambda: choices, pid, nproc)
    for i, choice in enumerate(choices[:4]):  # XLA has the last word: compile and check the best few
        for k in ("batch_size", "gradient_accumulation_steps", "use_8bit_optimizer", "use_mixed_precision",
                  "gradient_checkpointing"):
            setattr(c, k, choice.get(k, getattr(c, k)))
        plan = compile_plan(c, shape, data_mb, int(budget * 0.9) if c.auto_fit else budget)
        if nproc > 1:  # the processes decide together: one host's refusal is everyone's
            plan["refusal"] = next((r for r in gather_json(plan["refusal"]) if r), None)
        if plan["refusal"] is None:
            break
        if not c.auto_fit:
            for line in describe_plan(plan):
                log(line)
            raise ConfigError(plan["refusal"])
    else:
        raise ConfigError(f"--auto-fit: none of the {i + 1} best candidates fits once compiled (last: "
                          f"{plan['refusal']}); raise the budget or lower --target-params / --seq-len")
    if c.auto_fit:
        log(f"[auto-fit] --memory-budget {c.memory_budget}: micro-batch {c.batch_size} x accumulation "
            f"{c.gradient_accumulation_steps} (effective batch kept), 8-bit state {'on' if c.use_8bit_optimizer else 'off'}, "
            f"mixed precision {'on' if c.use_mixed_precision else 'off'}, gradient checkpointing "
            f"{'on' if c.gradient_checkpointing else 'off'}: the cheapest setting (speed) predicted to fit with a 10% "
            f"margin ({i + 1} compiled to confirm)")
    for line in describe_plan(plan):
        log(line)
    mesh, train_step, model, tx = plan.pop("mesh"), plan.pop("compiled"), plan.pop("model"), plan.pop("tx")
    state_sharding = plan.pop("state_sharding")
    n_dev = int(mesh.devices.size)
    if c.batch_size % nproc:
        raise ConfigError(f"--batch-size {c.batch_size} does not split evenly over {nproc} processes; use a multiple of {nproc}")
    local_batch = c.batch_size // nproc
    monitor.device_bytes = jax_device_bytes(mesh.devices.flat[0])
    _, batch_sharded = shardings(mesh)
    sync_each_step = needs_step_sync(mesh)
    device = mesh.devices.flat[0]
    peak_flops, peak_source = device_peak_flops(device)
    if device.platform != "cpu":  # accelerators: the table's peak is per device
        peak_flops *= mesh.devices.size
    else:  # the measured peak is the host's (all its cores); one process per host
        peak_flops *= nproc
    # Built in place with its final layout: under FSDP no device ever holds the whole state.
    state = jax.jit(lambda: init_state(init_params(model, c.seed, c.seq_len), tx), out_shardings=state_sharding)()
    eval_step, sampler = make_eval_step(model), make_sampler(model, c.seq_len)
    assert sum(x.size for x in jax.tree.leaves(state.params)) == n_params
    opt_bytes = state_bytes(state.opt_state)  # == model_sizing.optimizer_state_bytes (tested)

    if c.use_streaming:  # built now: --auto-fit may have changed the micro-batch
        loader = StreamingDataLoader(source, tokenizer, seq_len=c.seq_len, batch_size=local_batch,
                                     shuffle_buffer_size=c.shuffle_buffer_size, seed=c.seed, stride=c.stride,
                                     max_examples=c.max_examples, skip_documents=skip_docs,
                                     shard=(pid, nproc) if nproc > 1 else None)
        epoch_batches = loader.iter_epoch
    else:
        epoch_batches = lambda e: full_load_batches(inputs, targets, local_batch, c.seed, e)  # noqa: E731
    fpt = flops_per_token(shape, c.seq_len)
    warmup = min(c.warmup_steps, c.max_steps // 5) if c.max_steps else c.warmup_steps
    tokens_per_step = c.batch_size * c.seq_len * c.gradient_accumulation_steps
    est_total_tokens = None
    if c.max_steps is None and c.max_time is None and source.size_bytes:
        # Until epoch 0 has been counted: bytes / (bytes per token), more tokens with overlapping windows.
        bytes_per_token = max(eval_set.n_bytes / eval_set.mask.sum(), 1.0)
        est_total_tokens = (c.epochs or 1) * source.size_bytes / bytes_per_token * c.seq_len / (c.stride or c.seq_len)
        warmup = min(warmup, int(est_total_tokens / tokens_per_step) // 5)

    resolved = {**dataclasses.asdict(c), "output_dir": out, "dataset": source.name, "eval_dataset": eval_set.name,
                "vocab_size": vocab, "stride": c.stride or c.seq_len, "warmup_steps": warmup,
                "model": shape.to_dict(), "params": n_params, "model_flops_per_token": fpt,
                "optimizer_state_bytes": opt_bytes, "memory_plan": _plan_record(plan),
                "held_out_documents": skip_docs, "device": str(device), "devices": n_dev, "processes": nproc,
                "jax_version": jax.__version__}
    if primary:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(resolved, f, indent=2)
    log(f"[model] {describe(shape, c.seq_len)}")
    log(f"[optimizer] AdamW, {'8-bit block-quantized' if c.use_8bit_optimizer else 'float32'} moments"
        f"{', MultiSteps x' + str(c.gradient_accumulation_steps) if c.gradient_accumulation_steps > 1 else ''}: "
        f"state {opt_bytes / 2**20:,.2f} MB ({opt_bytes / n_params:.2f} bytes/param)")
    log(f"[run] {n_dev} {device.platform} device(s){f' in {nproc} processes' if nproc > 1 else ''}, batch split over "
        f"them, state {'split (fsdp)' if c.sharding == 'fsdp' and n_dev > 1 else 'replicated (dp)'}: "
        f"{device_bytes(state) / 2**20:,.1f} MB/device; "
        f"peak {peak_flops / 1e9:,.0f} GFLOP/s ({peak_source}); "
        f"{tokens_per_step:,} tokens/step; eval on {eval_set.name}: {int(eval_set.mask.sum()):,} tokens; out {out}")

    metrics = MetricsLog(os.path.join(out, "metrics.jsonl") if primary else os.devnull, append=bool(c.resume))
    ckpt = Checkpointer(os.path.join(out, "checkpoints"), keep=c.keep_checkpoints, log=log)
    # Room for the checkpoints kept (+1 being written), each ~ the state plus the loader's buffer text.
    ckpt_mb = state_bytes(state) / 2**20 + (c.shuffle_buffer_size * 1_000 / 2**20 if c.use_streaming else 0.0)
    free_mb = shutil.disk_usage(out).free / 2**20
    if free_mb < (c.keep_checkpoints + 1) * ckpt_mb:
        raise ConfigError(f"--output-dir {out}: {free_mb:,.0f} MB free, but {c.keep_checkpoints + 1} checkpoints of "
                          f"~{ckpt_mb:,.0f} MB need {(c.keep_checkpoints + 1) * ckpt_mb:,.0f} MB; free space, "
                          f"choose another directory or lower --keep-checkpoints")
    resumed: dict = {}
    loader_state = None
    if c.resume:
        for partial in sorted(p for p in os.listdir(os.path.join(out, "checkpoints")) if "tmp" in p):
            log(f"[resume] warning: skipping incomplete checkpoint {partial} (interrupted save)")
        if ckpt.latest_step() is None:
            raise ConfigError(f"--resume {out}: no complete checkpoint in {out}/checkpoints (an interrupted save is skipped)")
        state, resumed, loader_state = ckpt.restore(state)  # restored with the live state's shardings
        saved_by = resumed.get("processes", 1)
        if saved_by != nproc:
            raise ConfigError(f"--resume {out}: the run was saved by {saved_by} process(es), each with its own part of "
                              f"the data; resume it with --num-processes {saved_by} (devices per process may change)")
        if nproc > 1 and c.use_streaming:
            resumed["data_digest"] = loader_state["processes"][pid]["digest"]
            loader_state = loader_state["processes"][pid]["loader"]
        log(f"[resume] step {resumed['step']} of {out}: {resumed['tokens']:,} tokens, epoch {resumed['epoch']}")
    trackers = Trackers(out, resolved, use_wandb=c.wandb, wandb_project=c.wandb_project,
                        purge_step=resumed["step"] + 1 if resumed else None) if primary else None
    bar = _progress_bar(c.max_steps) if primary else None

    def plot() -> None:
        if primary:
            try:
                plot_loss(os.path.join(out, "metrics.jsonl"), os.path.join(out, "loss.png"))
            except Exception as e:  # noqa: BLE001 - a plot must never stop training
                log(f"[plot] warning: loss.png not updated ({e})")

    def emit(row: dict, line: str) -> None:
        metrics.write(row)
        if trackers is not None:
            trackers.write(row)
        if bar is not None:
            bar.write(line)
        else:
            log(line)

    def evaluate(step: int, tokens: int) -> dict | None:
        """Score the held-out set; None when a signal arrives meanwhile (the run saves and stops instead)."""
        nonlocal eval_seconds, interval_start
        t_eval = time.time()
        nats, count = 0.0, 0.0
        B = c.batch_size
        for i in range(0, len(eval_set.inputs), B):
            x, y, m = eval_set.inputs[i : i + B], eval_set.targets[i : i + B], eval_set.mask[i : i + B]
            if len(x) < B:  # pad the last batch so the eval step compiles once
                pad = B - len(x)
                x, y = np.pad(x, ((0, pad), (0, 0))), np.pad(y, ((0, pad), (0, 0)))
                m = np.pad(m, ((0, pad), (0, 0)))
            if any_process(bool(signals)):  # all processes abort together
                log(f"[run] eval at step {step} aborted by {signals[0] if signals else 'a signal to another process'}")
                return None
            s, n = eval_step(state.params, *(replicated_batch(a, batch_sharded) for a in (x, y, m)))
            nats, count = nats + float(s), count + float(n)
        loss = nats / count
        row = {"step": step, "tokens": tokens, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50)),
               "eval_bpb": nats / math.log(2) / eval_set.n_bytes, "eval_tokens": int(count)}
        sample = generate_sample(step)
        emit(row, f"eval step {step} | loss {loss:.4f} | ppl {row['eval_ppl']:.2f} | bpb {row['eval_bpb']:.4f} "
                  f"| sample: {sample[:80]!r}")
        plot()
        eval_seconds += time.time() - t_eval
        interval_start += time.time() - t_eval  # keep eval time out of the next interval's tokens/s
        return row

    def generate_sample(step: int) -> str:
        ids = np.full((1, c.seq_len), eot_id(tokenizer), np.int32)
        key = jax.random.PRNGKey(c.seed + step)
        out_ids = np.asarray(sampler(state.params, ids, 1, key))[0, 1:]
        text = tokenizer.decode(out_ids.tolist())
        if primary:
            with open(os.path.join(out, "samples.txt"), "a") as f:
                f.write(f"=== step {step}\n{text}\n\n")
        return text

    def first_nonfinite() -> int | None:
        """Sync the pending per-micro-step flags. Non-finite steps (which changed nothing) within the
        --skip-nonfinite allowance are logged and counted; returns the first step beyond it, if any."""
        nonlocal finite, checked_micro, skipped_steps
        if not finite:
            return None
        ok, base = np.asarray(jnp.stack(finite)), checked_micro
        checked_micro, finite = checked_micro + len(finite), []
        for i in np.flatnonzero(~ok).tolist():
            bad = (base + i) // c.gradient_accumulation_steps + 1
            if skipped_steps >= c.skip_nonfinite:
                return bad
            skipped_steps += 1
            log(f"[run] step {bad}: non-finite loss or gradient, skipped ({skipped_steps} of --skip-nonfinite {c.skip_nonfinite})")
        return None

    def save(step: int, tokens: int, epoch: int) -> None:
        meta = {"step": step, "tokens": tokens, "epoch": epoch, "micro_step": micro, "epoch_micro": epoch_micro,
                "warmup_end": warmup_end, "est_total_tokens": est_total_tokens, "data_digest": digest,
                "skipped_nonfinite": skipped_steps, "processes": nproc}
        stream = loader.state_json() if c.use_streaming else None
        if nproc > 1 and c.use_streaming:  # every process's stream position, in the one checkpoint
            stream = {"processes": gather_json({"loader": stream, "digest": digest})}
        ckpt.save(step, state, meta, stream,
                  eval_loss=last_eval["eval_loss"] if last_eval and last_eval["step"] == step else None)
        nonlocal last_save
        last_save = time.time()

    # ---------------------------------------------------------------------------------------------
    step, micro, tokens = resumed.get("step", 0), resumed.get("micro_step", 0), resumed.get("tokens", 0)
    start_epoch, epoch_micro = resumed.get("epoch", 0), resumed.get("epoch_micro", 0)
    digest = resumed.get("data_digest", "")  # sha256 chained over every micro-batch consumed
    est_total_tokens = resumed.get("est_total_tokens", est_total_tokens)
    last_eval: dict | None = None
    losses: list = []
    finite: list = []  # per micro-step: loss and gradient finite (a non-finite step changed nothing)
    checked_micro = micro  # micro-steps whose flags have been checked
    skipped_steps = resumed.get("skipped_nonfinite", 0)
    last_save = time.time()
    wait = eval_seconds = 0.0
    warmup_end: float | None = resumed.get("warmup_end")  # run progress when warmup finished: the cosine spans the rest
    compile_s = None
    first_batch_s = 0.0
    train_start = time.time()
    interval_start, interval_wait, interval_tokens = time.time(), 0.0, 0
    stop_reason = "epochs done"
    nonfinite_stop = False
    done = False
    epochs = c.epochs or (10**9 if (c.max_steps or c.max_time) else 1)
    batches = iter(())
    for epoch in range(start_epoch, epochs):
        if epoch == start_epoch and resumed:  # continue the stream exactly where the checkpoint left it
            batches = (loader.iter_epoch(epoch, loader_state) if c.use_streaming
                       else itertools.islice(epoch_batches(epoch), epoch_micro, None))
        else:
            batches, epoch_micro = epoch_batches(epoch), 0
        while not done:
            t0 = time.perf_counter()
            batch = next(batches, None)
            dt = time.perf_counter() - t0
            if any_process(batch is None):  # processes end an epoch together (their parts differ by < a batch)
                break
            if compile_s is None:  # the first fetch fills the shuffle buffer: start-up, not waiting
                first_batch_s += dt
            else:
                wait += dt
                interval_wait += dt
            if c.max_steps:
                progress = step / c.max_steps
            elif c.max_time:  # each process has its own clock: process 0's sets everyone's learning rate
                progress = from_process0((time.time() - start) / c.max_time)
            else:
                progress = tokens / est_total_tokens if est_total_tokens else 0.0
            if warmup_end is None and step >= warmup:
                warmup_end = progress
            lr = lr_at(progress, step, c.learning_rate, warmup, warmup_end=warmup_end or 0.0)
            state, m = train_step(state, global_batch(batch, batch_sharded), np.float32(lr))
            if sync_each_step:  # see devices.py: multi-device CPU must not run ahead
                m["loss"].block_until_ready()
            losses.append(m["loss"])
            finite.append(m["finite"])
            micro += 1
            epoch_micro += 1
            digest = hashlib.sha256(bytes.fromhex(digest) + batch["input_ids"].tobytes()
                                    + batch["targets"].tobytes()).hexdigest()
            if compile_s is None:
                m["loss"].block_until_ready()
                compile_s = time.time() - train_start - first_batch_s
                # The next interval starts now; this micro-batch's tokens ran before it.
                interval_start, interval_wait, interval_tokens = time.time(), 0.0, -c.batch_size * c.seq_len
                (bar.write if bar is not None else log)(f"[run] first step {compile_s:.1f}s (the step was compiled in pre-flight)")
            if micro % c.gradient_accumulation_steps:
                continue
            step += 1
            tokens += tokens_per_step
            interval_tokens += tokens_per_step
            if bar is not None:
                bar.update(1)
            if step % c.log_every == 0:
                loss = float(jnp.mean(jnp.stack(losses)))  # the only host sync in the loop
                losses = []
                now = time.time()
                tps = interval_tokens / max(now - interval_start, 1e-9)
                row = {"step": step, "loss": loss, "lr": lr, "tokens": tokens, "tokens_per_sec": tps,
                       "tokens_per_sec_per_device": tps / n_dev, "mfu": fpt * tps / peak_flops, "data_wait_frac": interval_wait / max(now - interval_start, 1e-9),
                       "rss_mb": rss_mb(), "elapsed_s": now - start, "epoch": epoch}
                if monitor.device_mb is not None:
                    row["device_mb"] = monitor.device_mb
                per_device = f" ({tps / n_dev:,.0f}/device)" if n_dev > 1 else ""
                emit(row, f"step {step:6d} | loss {loss:.4f} | lr {lr:.2e} | {tps:,.0f} tok/s{per_device} | mfu {row['mfu']:.1%} "
                          f"| wait {row['data_wait_frac']:.1%} | rss {row['rss_mb']:,.0f} MB | {now - start:.0f}s")
                if bar is not None:
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
                interval_start, interval_wait, interval_tokens = now, 0.0, 0
            save_due = step % c.checkpoint_every == 0 or (bool(c.checkpoint_minutes) and any_process(
                time.time() - last_save >= 60 * c.checkpoint_minutes))
            if (step % c.log_every == 0 or step % c.eval_every == 0 or save_due) and (bad := first_nonfinite()):  # the optimizer skipped it: stop before anything is saved
                stop_reason = f"non-finite loss or gradient at step {bad} (skipped; nothing saved after it)"
                nonfinite_stop = done = True
                break
            if step % c.eval_every == 0:
                last_eval = evaluate(step, tokens) or last_eval
            if save_due:
                save(step, tokens, epoch)
            if c.max_steps and step >= c.max_steps:
                stop_reason, done = f"--max-steps {c.max_steps}", True
            elif c.max_time and time.time() - start >= c.max_time:
                stop_reason, done = f"--max-time {c.max_time:g}s", True
            elif signals:
                stop_reason, done = f"{signals[0]}: checkpoint saved, resume with --resume {out}", True
            elif stop_file := stop_requested(out):
                stop_reason, done = f"{os.path.basename(stop_file)} file in the output dir", True
            if nproc > 1 and any_process(done) and not done:  # another process stops: all stop at this step
                stop_reason, done = "another process stopped (time, signal or STOP file)", True
        if done:
            break
        if epoch == 0 and not (c.max_steps or c.max_time):  # one epoch counted: the schedule is exact now
            est_total_tokens = tokens * epochs
    if not nonfinite_stop and (bad := first_nonfinite()):
        stop_reason = f"non-finite loss or gradient at step {bad} (skipped; nothing saved after it)"
        nonfinite_stop = True
    if hasattr(batches, "close"):
        batches.close()  # stops the prefetch thread before the final eval
    train_seconds = time.time() - train_start - first_batch_s - (compile_s or 0.0) - eval_seconds
    if bar is not None:
        bar.close()
    if step == 0:
        raise DatasetError(f"{source.name}: no complete optimizer step was possible; use more data or a smaller batch")
    log(f"[run] stopped: {stop_reason}")
    if not any_process(bool(signals)) and (last_eval is None or last_eval["step"] != step):  # a signal: save now, no eval
        last_eval = evaluate(step, tokens) or last_eval
    ev = last_eval or {"eval_loss": None, "eval_ppl": None, "eval_bpb": None}
    if ckpt.latest_step() != step and not nonfinite_stop:
        save(step, tokens, epoch)
    ckpt.close()
    metrics.close()
    if trackers is not None:
        trackers.close()
    plot()
    # This process's tokens; the first micro-step ran in the compile/start-up window.
    trained_tokens = tokens - resumed.get("tokens", 0) - tokens_per_step / c.gradient_accumulation_steps
    summary = {
        "eval_loss": ev["eval_loss"], "eval_ppl": ev["eval_ppl"], "eval_bpb": ev["eval_bpb"],
        "params": n_params, "steps": step, "tokens": tokens, "epochs_started": epoch + 1,
        "wall_time_s": time.time() - start, "train_time_s": train_seconds, "compile_time_s": (compile_s or 0.0) + plan["compile_s"],
        "first_batch_time_s": first_batch_s,
        "eval_time_s": eval_seconds,
        "tokenizer_time_s": tok_seconds, "tokens_per_sec": trained_tokens / max(train_seconds, 1e-9),
        "tokens_per_sec_per_device": trained_tokens / max(train_seconds, 1e-9) / n_dev, "devices": n_dev,
        "processes": nproc, "sharding": c.sharding, "state_mb_per_device": device_bytes(state) / 2**20,
        "model_flops_per_token": fpt, "mfu": fpt * trained_tokens / max(train_seconds, 1e-9) / peak_flops,
        "peak_flops": peak_flops, "data_wait_frac": wait / max(train_seconds, 1e-9),
        "peak_rss_mb": max(peak_rss_mb(), monitor.snapshot()["peak_rss_mb"]),
        "peak_device_mb": monitor.snapshot()["peak_device_mb"], **_plan_record(plan),
        "optimizer_state_bytes": opt_bytes,
        "stop_reason": stop_reason, "output_dir": out, "data_digest": digest, "skipped_nonfinite": skipped_steps,
    }
    if primary:
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    scored = f"eval loss {ev['eval_loss']:.4f} | bpb {ev['eval_bpb']:.4f}" if last_eval else "no eval (stopped by a signal)"
    log(f"[done] {step} steps, {tokens:,} tokens in {summary['wall_time_s']:.0f}s | {scored} "
        f"| {summary['tokens_per_sec']:,.0f} tok/s | mfu {summary['mfu']:.1%} "
        f"| peak rss {summary['peak_rss_mb']:,.0f} MB | {out}")
    return summary


def _plan_record(plan: dict) -> dict:
    """The pre-flight's predictions, for config.json and summary.json (every run checks the estimate)."""
    return {k: round(plan[k], 1) for k in ("estimated_peak_rss_mb", "estimated_device_mb", "compiled_device_mb")}


def _in_notebook() -> bool:
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return type(shell).__name__ == "ZMQInteractiveShell"  # Jupyter, VS Code and Colab kernels


def _progress_bar(total: int | None):
    """A tqdm bar on an interactive terminal or in a notebook (widget); None (plain log lines) otherwise."""
    if _in_notebook():
        from tqdm.auto import tqdm
    elif sys.stderr.isatty():
        from tqdm import tqdm
    else:
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:  # --config FILE (YAML/JSON, or a run's config.json): flags given win over it, it over defaults
        values, explicit, notes = parse_args_with_config(parser, argv, Config)
    except ConfigFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(note)
    config = Config(**values)
    try:
        train(config, start_time=_PROCESS_START, explicit=explicit)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        jax = sys.modules.get("jax")
        if jax is not None and jax.distributed.is_initialized():  # don't wait at exit for processes that go on
            sys.stderr.flush()
            os._exit(2)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
