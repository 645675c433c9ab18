"""train(Config(...)): one run, from a notebook or the command line (slm.cli.train).

    from train_optimized import Config, train          # or: from slm.train.run import Config, train
    summary = train(Config(use_streaming=True, dataset_id="data.txt", target_params=1_000_000, max_time=120))

The run: settle the config, set up the data and tokenizer, compile the step and check its memory
(slm.train.prepare); build or restore the state; then the loop (slm.train.loop) with its callbacks
(slm.train.callbacks); then the final eval, save and summary.json. Whatever happens, the files, the
checkpoint manager, the prefetch thread and the memory monitor are closed when train() returns or raises.
The clock, the signal watcher and the disk-space probe are arguments, so tests need not patch globals.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slm.data.mixture import Mixture, MixtureLoader
from slm.data.packing import full_load_batches
from slm.data.stream import StreamingDataLoader
from slm.data.tokenizer import sample_start
from slm.errors import ConfigError, DatasetError, DiskFullError, UserError
from slm.io.atomic import write_json
from slm.io.checkpoints import Checkpointer, is_disk_full
from slm.io.metrics import MetricsLog
from slm.io.tracking import Trackers
from slm.memory.host import peak_rss_mb, release_free_heap, rss_mb
from slm.memory.monitor import MemoryMonitor
from slm.memory.preflight import MemoryPlan
from slm.model.sizing import count_params, describe, flops_per_token, logit_columns
from slm.optim.schedule import warmup_for
from slm.train.config import Config, RunFacts
from slm.train.devices import Processes
from slm.train.init_from import load_init_weights
from slm.train.interrupts import SignalWatcher, spend_stale_stop
from slm.train.loop import Cadence, Callback, LoopPlan, RunState, Schedule, run_loop
from slm.train.process_state import as_found
from slm.train.prepare import TrainData, make_output_dir, plan_step, settle_config, settle_defaults, setup_data
from slm.train.restore import branch_before_decay, check_base, replan, restore
from slm.train.step import make_flush_step

__all__ = ["Config", "train"]
Log = Callable[[str], None]


@dataclass
class Env:
    """Where and how a run happens: its output dir, its clock and start, its log, processes and signals."""

    out: str
    start: float
    log: Log
    procs: Processes
    signals: SignalWatcher
    clock: Callable[[], float]
    disk_usage: Callable[[str], Any]
    monitor: MemoryMonitor
    stack: ExitStack  # everything to close when the run ends, however it ends
    defaults: dict[str, str] = field(default_factory=dict)  # each default the run chose: its reason


def train(config: Config, start_time: float | None = None, log: Log = print, explicit: set[str] | None = None,
          callbacks: Sequence[Callback] = (), signals: SignalWatcher | None = None,
          clock: Callable[[], float] = time.time, disk_usage: Callable[[str], Any] = shutil.disk_usage) -> dict:
    """Run training as configured; returns the summary (also written to summary.json).

    start_time: what --max-time counts from (default: now). explicit: the flags given on the command line
    (default: the fields that differ from Config's defaults). callbacks: extra slm.train.loop.Callbacks,
    called after the trainer's own. signals: a SignalWatcher (default: SIGTERM/SIGINT handlers while training).
    """
    start = clock() if start_time is None else start_time
    with as_found():  # the compile cache, orbax's quieting: the process as found afterwards, whatever happens
        return _settle_and_run(dataclasses.replace(config), start, log, explicit, callbacks, signals, clock, disk_usage)


def _settle_and_run(c: Config, start: float, log: Log, explicit: set[str] | None, callbacks: Sequence[Callback],
                    signals: SignalWatcher | None, clock: Callable[[], float], disk_usage: Callable[[str], Any]) -> dict:
    c, procs = settle_config(c, explicit, log)
    if not procs.primary:
        log = _silent  # one process speaks for all
    # Process 0 makes (or checks) the output dir and takes its lock for all; every process learns its name,
    # or the error.
    locks = []
    fresh = not c.resume and (c.output_dir is None or not os.path.exists(c.output_dir))  # this call makes it

    def make_dir() -> str:
        out, lock = make_output_dir(c, log)
        locks.append(lock)
        return os.path.abspath(out) if procs.count > 1 else out

    out = procs.decide0(make_dir)
    try:
        return _run(c, out, locks, start, log, procs, signals, clock, disk_usage, callbacks)
    except (UserError, KeyboardInterrupt) as e:
        if fresh and procs.primary and not isinstance(e, DiskFullError) and not trained_anything(out):
            shutil.rmtree(out, ignore_errors=True)  # refused, or interrupted, before its first step: no folder left
        raise


def trained_anything(out: str) -> bool:
    """Whether a run folder holds anything of a run's work: a checkpoint, or a logged step."""
    ckpts, metrics = os.path.join(out, "checkpoints"), os.path.join(out, "metrics.jsonl")
    return bool(os.path.isdir(ckpts) and os.listdir(ckpts)) or (os.path.exists(metrics) and
                                                                os.path.getsize(metrics) > 0)


def _run(c: Config, out: str, locks: list, start: float, log: Log, procs: Any, signals: SignalWatcher | None,
         clock: Callable[[], float], disk_usage: Callable[[str], Any], callbacks: Sequence[Callback]) -> dict:
    """train() inside its output dir: the data, the planned step, the weights, then _train."""
    with ExitStack() as stack:
        for lock in locks:
            stack.callback(lock.release)
        os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
        monitor = stack.enter_context(MemoryMonitor(alert_mb=c.memory_alert_mb, on_alert=log))  # RSS from here on
        signals = signals if signals is not None else stack.enter_context(SignalWatcher(log))
        env = Env(out, start, log, procs, signals, clock, disk_usage, monitor, stack)
        data, c = setup_data(c, out, procs, log)
        c, chosen = settle_defaults(c, data, log)
        chunk_lever = any(choice.key == "loss_chunk" for choice in chosen)
        built, compiled, plan, c = plan_step(c, data, procs, log, chunk_lever)
        sampler = sampler_in_preflight(c, data, built, plan, log)
        load_init_weights(c, data, built, log)  # after the plan: read straight into their final layout
        handed = [compiled]  # _train's DeviceStep takes the only reference, so it can free it (for_epoch)
        del compiled
        env.defaults = {choice.key: choice.reason for choice in chosen}  # config.json's record of them
        return _train(c, data, built, handed, plan, env, list(callbacks), sampler)


SAMPLER_AHEAD_ON = ("gpu",)  # the platforms whose compiles allocate on the device (XLA:GPU's autotuning)


def sampler_in_preflight(c: Config, data: TrainData, built: Any, plan: MemoryPlan, log: Log) -> Any:
    """On a GPU, the eval sample's decoder compiled now, before anything is resident (sampler_ahead says why),
    and the plan's runtime measured again after it (its programs stay); elsewhere None: the first eval
    compiles it."""
    if built.mesh.devices.flat[0].platform not in SAMPLER_AHEAD_ON:
        return None
    from slm.train.evaluate import sampler_ahead

    t0 = time.time()
    decoder = sampler_ahead(built, sample_start(data.tokenizer, data.special), c.seq_len)
    release_free_heap()
    plan.base_rss_mb = rss_mb()
    log(f"[eval] the sample's decoder compiled in {time.time() - t0:.1f} s, autotuned before the state is placed; "
        f"host RSS now {plan.base_rss_mb:,.0f} MB, predicted peak {plan.estimated_peak_rss_mb:,.0f} MB")
    return decoder


@contextmanager
def full_disk_in_one_line(ckpt: Checkpointer, out: str) -> Iterator[None]:
    """From here on, a write of the run that finds the disk full ends as one DiskFullError line (exit 2)."""
    try:
        yield
    except OSError as e:
        if not is_disk_full(e):
            raise
        raise ckpt.disk_full(e, out) from None


def _silent(*args: Any, **kwargs: Any) -> None:
    pass


def dropout_later(c: Config, built: Any, data: TrainData, log: Log) -> tuple[int, Callable[[], Any]] | None:
    """(N, compile the step with dropout) for DeviceStep.later, when --dropout starts at --dropout-from-epoch N > 0
    (StepSpec.from_config then built the pre-flight's step without it)."""
    if not c.dropout or built.spec.dropout == c.dropout:  # none asked, or the first step has it already
        return None
    if isinstance(data.source, Mixture) and c.use_streaming:
        log(f"[dropout] a mixture's sources restart inside one endless epoch, so --dropout {c.dropout:g} from epoch "
            f"{c.dropout_from_epoch} never starts; pass --dropout-from-epoch 0 to train with it")
        return None

    def compile_it() -> Any:
        from slm.train.builder import compile_step, with_dropout

        compiled, seconds, peak_mb = compile_step(with_dropout(built, c.dropout))
        release_free_heap()  # the compiler's leftovers (+230 MB in the main job) must not stay beside every step
        log(f"[dropout] epoch {c.dropout_from_epoch} begins: dropout {c.dropout:g} from here on (its step compiled "
            f"in {seconds:.1f} s, XLA's peak {peak_mb:,.1f} MB per device)")
        return compiled

    return c.dropout_from_epoch, compile_it


@dataclass
class DeviceStep:
    """The compiled step on host batches: each process's rows become one global array split over the mesh.
    Multi-device CPU keeps one step in flight (slm.train.devices explains the all-reduce deadlock)."""

    compiled: Any
    batch_sharding: Any
    sync: bool
    flush: Any = None  # slm.train.step.make_flush_step's, with accumulation: compiled if the data ends mid-step
    base: Any = None  # LoRA: the frozen base, an input of every step
    later: tuple[int, Callable[[], Any]] | None = None  # (epoch, compile): the step from that epoch on

    def for_epoch(self, epoch: int) -> DeviceStep:
        """The step of `epoch`: from `later`'s epoch on (--dropout-from-epoch), the later step, compiled then,
        replaces the first, whose executable is freed first (epochs only go forward)."""
        if self.later is not None and epoch >= self.later[0]:
            compile_later, self.later, self.compiled = self.later[1], None, None
            self.compiled = compile_later()
        return self

    def __call__(self, state: Any, batch: dict, lr: np.float32) -> tuple[Any, dict]:
        from slm.train.devices import global_batch

        base = () if self.base is None else (self.base,)
        state, metrics = self.compiled(state, global_batch(batch, self.batch_sharding), lr, *base)
        if self.sync:
            metrics["loss"].block_until_ready()
        return state, metrics


@dataclass
class Batches:
    """Opens an epoch's batches: the streaming loader (from its saved stream state when resuming) or a
    permutation of the full-load rows (skipping the micro-batches a resumed epoch already had)."""

    loader: StreamingDataLoader | None
    rows: tuple[np.ndarray, np.ndarray] | None
    local_batch: int
    seed: int
    resume_state: dict | None = None
    resume_micro: int = 0

    def open(self, epoch: int, continuing: bool) -> Iterator[dict]:
        if self.loader is not None:
            return self.loader.iter_epoch(epoch, self.resume_state if continuing else None)
        batches = full_load_batches(*self.rows, self.local_batch, self.seed, epoch)
        return itertools.islice(batches, self.resume_micro, None) if continuing else batches


def _train(c: Config, data: TrainData, built: Any, handed: list, plan: MemoryPlan, env: Env,
           extra: list[Callback], sampler: Any = None) -> dict:
    import jax

    from slm.memory.monitor import jax_device_bytes
    from slm.train.builder import init_state, place_base
    from slm.train.devices import device_bytes, needs_step_sync

    procs, mesh = env.procs, built.mesh
    if c.batch_size % procs.count:
        raise ConfigError(f"--batch-size {c.batch_size} does not split evenly over {procs.count} processes; "
                          f"use a multiple of {procs.count}")
    env.monitor.device_bytes = jax_device_bytes(mesh.devices.flat[0])
    lora = built.spec.lora is not None
    base = place_base(built, data.init_params) if lora else None
    state = init_state(built, None if lora else data.init_params)
    data.init_params = None  # the state (or the base) holds them now: free the host copy
    lplan = loop_plan(c, data, env.start)
    peak = peak_flops(mesh, procs, c.matmul_precision)  # resolved by plan_step
    facts, resolved = write_config(c, data, built, plan, (state, base), lplan, peak, env)
    assert sum(x.size for x in jax.tree.leaves(state.params)) == facts.trainable_params
    ckpt = Checkpointer(os.path.join(env.out, "checkpoints"), keep=c.keep_checkpoints, log=env.log,
                        sync=plan.checkpoint_sync, disk_usage=env.disk_usage)
    env.stack.callback(ckpt.close)
    env.stack.enter_context(full_disk_in_one_line(ckpt, env.out))
    check_disk(c, env, state)
    run, resumed = restore(c, ckpt, state, estimated_total_tokens(c, data), env)
    if resumed:
        run, resumed = branch_before_decay(c, ckpt, state, run, resumed, lplan, env)
        replan(c, run, lplan, env)
        if procs.primary:
            spend_stale_stop(env.out, env.log)
    check_base(c, run, data.base_fingerprint if lora else None, env.out)
    loader = None
    if c.use_streaming:  # built now: --auto-fit may have changed the micro-batch
        loader = make_loader(c, data, procs, env.log)
    batches = Batches(loader, data.rows, c.batch_size // procs.count, c.seed, resumed.get("loader"),
                      run.epoch_micro)
    callbacks = make_callbacks(c, data, built, facts, resolved, peak[0], ckpt, loader, env, resumed, base, extra,
                               sampler)
    closing = env.stack.enter_context(ExitStack())  # each callback closed once: at the end, or on an error
    for cb in reversed(callbacks):
        closing.callback(cb.close)
    accumulating = c.gradient_accumulation_steps > 1
    flush = make_flush_step(built.tx, built.state_sharding, built.batch_sharding) if accumulating else None
    if c.max_steps == 0:  # --init-from with --max-steps 0: the pretrained model evaluated and saved as a run
        run.stop("--max-steps 0")
    else:
        step = DeviceStep(handed.pop(), built.batch_sharding, needs_step_sync(mesh), flush, base,
                          dropout_later(c, built, data, env.log))
        if resumed:  # a resumed session's start-up (imports, compile, restore) is not training time: --max-time's
            run.prior_s -= env.clock() - env.start  # clock goes on from the checkpoint's reading at the first step
        run_loop(run, step.for_epoch, batches.open, callbacks, lplan, procs, env.clock, resumed=bool(resumed))
    if run.step == 0 and c.max_steps != 0:
        raise DatasetError(f"{data.source.name}: no complete optimizer step was possible; use more data or a "
                           f"smaller batch")
    env.log(f"[run] stopped: {run.stop_reason}")
    for cb in callbacks:
        cb.on_train_end(run)
    closing.close()  # in order: the console, the checkpoint manager, metrics.jsonl and the trackers
    sources = loader.counts() if isinstance(loader, MixtureLoader) else None
    summary = summarize(c, run, data, facts, plan, peak[0], env, resumed, device_bytes(run.train_state) / 2**20,
                        sources)
    if ckpt.failure is not None:  # a save the disk had no room for: the run stopped cleanly, now say so (exit 2)
        raise ckpt.failure
    return summary


def write_config(c: Config, data: TrainData, built: Any, plan: MemoryPlan, state_base: tuple[Any, Any],
                 lplan: LoopPlan, peak: tuple[float, str], env: Env) -> tuple[RunFacts, dict]:
    """config.json (the resolved settings and the run's facts; process 0), and the run's opening lines.
    Returns (the facts, config.json's contents)."""
    import jax

    from slm.optim.adam8bit import state_bytes
    from slm.train.devices import device_bytes

    state, base = state_base
    trainable = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    n_params = count_params(data.shape) + (trainable if base is not None else 0)  # an nf4 base's leaves are codes
    opt_bytes = state_bytes(state.opt_state)  # == slm.model.sizing.optimizer_state_bytes (tested)
    mesh, procs = built.mesh, env.procs
    device = mesh.devices.flat[0]
    facts = RunFacts(dataset=data.source.name, eval_dataset=data.eval_set.name, model=data.shape.to_dict(),
                     params=n_params, trainable_params=trainable, base_fingerprint=data.base_fingerprint,
                     model_flops_per_token=flops_per_token(data.shape, c.seq_len),
                     optimizer_state_bytes=opt_bytes, memory_plan=plan.record(),
                     held_out_documents=data.held_out_documents, device=str(device), devices=int(mesh.devices.size),
                     processes=procs.count, jax_version=jax.__version__, defaults=env.defaults)
    resolved = {**dataclasses.asdict(c), "output_dir": env.out, "vocab_size": data.shape.vocab_size,
                "stride": c.stride or c.seq_len, "warmup_steps": lplan.schedule.warmup,
                **dataclasses.asdict(facts)}
    if procs.primary:
        write_json(os.path.join(env.out, "config.json"), resolved)
    acc, n_dev = c.gradient_accumulation_steps, facts.devices
    env.log(f"[model] {describe(data.shape, c.seq_len)}")
    muon = (f"Muon (peak lr {c.muon_learning_rate:g}, {'bfloat16' if c.use_8bit_optimizer else 'float32'} momentum) "
            f"on the hidden matrices, AdamW (peak lr {c.learning_rate:.2e}) on the rest with "
            if c.optimizer == "muon" else "AdamW, ")
    env.log(f"[optimizer] {muon}{'8-bit block-quantized' if c.use_8bit_optimizer else 'float32'} moments"
            f"{', MultiSteps x' + str(acc) if acc > 1 else ''}: state {opt_bytes / 2**20:,.2f} MB "
            f"({opt_bytes / trainable:.2f} bytes/trained param)")
    if base is not None:
        env.log(f"[lora] rank {c.lora_rank} on {c.lora_targets}, alpha {c.lora_alpha:g}, dropout {c.lora_dropout:g}: "
                f"{trainable:,} trainable of {n_params:,} params ({trainable / n_params:.3%}); base frozen in "
                f"{c.base_dtype} ({device_bytes(base) / 2**20:,.1f} MB/device)")
    chunked = logit_columns(data.shape.vocab_size, c.loss_chunk) < data.shape.vocab_size  # resolved by plan_step
    loss_form = f"loss over {c.loss_chunk}-entry vocabulary chunks" if chunked else "loss over the whole logits"
    env.log(f"[run] {n_dev} {device.platform} device(s){f' in {procs.count} processes' if procs.count > 1 else ''}, "
            f"batch split over them, state {'split (fsdp)' if c.sharding == 'fsdp' and n_dev > 1 else 'replicated (dp)'}: "
            f"{device_bytes((state, base)) / 2**20:,.1f} MB/device; {c.matmul_precision} matmul operands; "
            f"{loss_form}; "
            f"peak {peak[0] / 1e9:,.0f} GFLOP/s ({peak[1]}); "
            f"{c.batch_size * c.seq_len * acc:,} tokens/step; eval on {data.eval_set.name}: "
            f"{int(data.eval_set.mask.sum()):,} tokens; out {env.out}")
    return facts, resolved


def peak_flops(mesh: Any, procs: Processes, matmul: str = "float32") -> tuple[float, str]:
    """The run's peak FLOP/s for MFU: the published peak x devices on accelerators, the host's measured
    peak x processes on CPU (one process per host), for the run's matmul operand dtype."""
    from slm.train.throughput import device_peak_flops

    device = mesh.devices.flat[0]
    peak, source = device_peak_flops(device, matmul)
    return peak * (mesh.devices.size if device.platform != "cpu" else procs.count), source


def loop_plan(c: Config, data: TrainData, start: float) -> LoopPlan:
    """The schedule (warmup capped at 20% of a run of known length) and the cadence of logs, evals, saves."""
    tokens_per_step = c.batch_size * c.seq_len * c.gradient_accumulation_steps
    est_total_tokens = estimated_total_tokens(c, data)
    warmup = warmup_for(c.warmup_steps, c.max_steps,
                        est_total_tokens / tokens_per_step if est_total_tokens is not None else None)
    epochs = c.epochs or (10**9 if (c.max_steps or c.max_time) else 1)
    schedule = Schedule(c.learning_rate, warmup, c.max_steps, c.max_time, start, epochs, c.schedule, c.decay_fraction)
    cadence = Cadence(c.log_every, c.eval_every, c.checkpoint_every, c.checkpoint_minutes)
    return LoopPlan(epochs, c.gradient_accumulation_steps, tokens_per_step, c.batch_size * c.seq_len, schedule,
                    cadence)


def make_loader(c: Config, data: TrainData, procs: Processes, log: Callable[[str], None]) -> Any:
    """The streaming loader of this process's part of the data: one source's, or a mixture's."""
    common = {"seq_len": c.seq_len, "batch_size": c.batch_size // procs.count, "seed": c.seed, "special": data.special,
              "shuffle_buffer_size": c.shuffle_buffer_size, "stride": c.stride, "max_examples": c.max_examples,
              "chat_template": data.chat_template,
              "shard": (procs.index, procs.count) if procs.count > 1 else None}
    if isinstance(data.source, Mixture):
        return MixtureLoader(data.source, data.tokenizer, on_exhausted=c.mixture_exhausted, log=log, **common)
    return StreamingDataLoader(data.source, data.tokenizer, skip_documents=data.held_out_documents, **common)


def estimated_total_tokens(c: Config, data: TrainData) -> float | None:
    """An epochs-bounded run's length until epoch 0 has been counted: bytes / (bytes per token), more
    tokens with overlapping windows. None when --max-steps/--max-time bound the run, or the size is unknown."""
    if c.max_steps is not None or c.max_time is not None or not data.source.size_bytes:
        return None
    bytes_per_token = max(data.eval_set.n_bytes / float(data.eval_set.mask.sum()), 1.0)  # a float: saved as JSON
    return (c.epochs or 1) * data.source.size_bytes / bytes_per_token * c.seq_len / (c.stride or c.seq_len)


def check_disk(c: Config, env: Env, state: Any) -> None:
    """Refuse an output dir without room for --keep-checkpoints + 1 checkpoints (state + the stream's text)."""
    from slm.optim.adam8bit import state_bytes

    ckpt_mb = state_bytes(state) / 2**20 + (c.shuffle_buffer_size * 1_000 / 2**20 if c.use_streaming else 0.0)
    free_mb = env.disk_usage(env.out).free / 2**20
    need = (c.keep_checkpoints + 1) * ckpt_mb
    if free_mb < need:
        raise ConfigError(f"--output-dir {env.out}: {free_mb:,.0f} MB free, but {c.keep_checkpoints + 1} checkpoints "
                          f"of ~{ckpt_mb:,.0f} MB need {need:,.0f} MB; free space, choose another directory or "
                          f"lower --keep-checkpoints")


def make_callbacks(c: Config, data: TrainData, built: Any, facts: RunFacts, resolved: dict, peak: float,
                   ckpt: Checkpointer, loader: StreamingDataLoader | None, env: Env, resumed: dict,
                   base: Any = None, extra: Sequence[Callback] = (), sampler: Any = None) -> list[Callback]:
    """The trainer's callbacks in their order (slm.train.callbacks), with their sinks. The caller's `extra`
    callbacks run after the checkpoint and before the stop conditions, so they see every step, the last too."""
    from slm.train.callbacks import (
        Console,
        Emitter,
        Evaluate,
        LogMetrics,
        LossPlot,
        MixtureShares,
        NonFiniteGuard,
        SaveCheckpoints,
        StopConditions,
        progress_bar,
    )
    from slm.train.evaluate import Evaluator

    procs, out, log, clock = env.procs, env.out, env.log, env.clock
    metrics = MetricsLog(os.path.join(out, "metrics.jsonl") if procs.primary else os.devnull, append=bool(c.resume),
                         keep_through=resumed["meta"]["step"] if resumed else None)
    trackers = None
    if procs.primary:
        trackers = Trackers(out, resolved, use_wandb=c.wandb, wandb_project=c.wandb_project,
                            purge_step=resumed["meta"]["step"] + 1 if resumed else None)
    console = Console(log, progress_bar(c.max_steps) if procs.primary else None)
    emit = Emitter(metrics, trackers, console)
    plot = LossPlot(out, procs.primary, log, emit)
    evaluator = Evaluator(built.model, data.eval_set, c.batch_size, built.batch_sharding, data.tokenizer,
                          sample_start(data.tokenizer, data.special), c.seq_len, c.seed, procs, env.signals, os.path.join(out, "samples.txt") if procs.primary else None,
                          base=base, lora=built.spec.lora, decoder=sampler)
    monitor = env.monitor
    return [console,
            LogMetrics(emit, facts.model_flops_per_token, peak, facts.devices, env.start, lambda: monitor.device_mb,
                       clock),
            NonFiniteGuard(c.skip_nonfinite, c.gradient_accumulation_steps, log),
            Evaluate(evaluator, emit, plot, env.signals, procs, log, clock),
            *([MixtureShares(loader.counts, procs.primary, log)] if isinstance(loader, MixtureLoader) else []),
            SaveCheckpoints(ckpt, loader.state_json if loader is not None else None, procs, clock),
            *extra,
            StopConditions(c.max_steps, c.max_time, env.signals, out),
            plot, emit]


def summarize(c: Config, run: RunState, data: TrainData, facts: RunFacts, plan: MemoryPlan, peak: float, env: Env,
              resumed: dict, state_mb: float, data_sources: list[dict] | None = None) -> dict:
    """summary.json (process 0) and the [done] line: the run's outcome, speed and memory."""
    t = run.timings
    # This process's tokens; the first micro-step ran in the compile/start-up window.
    trained = run.tokens - resumed.get("meta", {}).get("tokens", 0) - c.batch_size * c.seq_len
    train_s = max(t.train_s, 1e-9)
    ev = run.last_eval or {"eval_loss": None, "eval_ppl": None, "eval_bpb": None}
    memory = env.monitor.snapshot()
    summary = {
        "eval_loss": ev["eval_loss"], "eval_ppl": ev["eval_ppl"], "eval_bpb": ev["eval_bpb"],
        "params": facts.params, "trainable_params": facts.trainable_params,
        "steps": run.step, "tokens": run.tokens, "epochs_started": run.epoch + 1,
        "wall_time_s": env.clock() - env.start, "train_time_s": t.train_s,
        "compile_time_s": (t.compile_s or 0.0) + plan.compile_s, "first_batch_time_s": t.first_batch_s,
        "eval_time_s": t.eval_s, "tokenizer_time_s": data.tokenizer_s,
        "tokens_per_sec": trained / train_s, "tokens_per_sec_per_device": trained / train_s / facts.devices,
        "devices": facts.devices, "processes": facts.processes, "sharding": c.sharding, "state_mb_per_device": state_mb,
        "model_flops_per_token": facts.model_flops_per_token,
        "mfu": facts.model_flops_per_token * trained / train_s / peak, "peak_flops": peak,
        "data_wait_frac": t.wait_s / train_s,
        "peak_rss_mb": max(peak_rss_mb(), memory["peak_rss_mb"]), "peak_device_mb": memory["peak_device_mb"],
        **plan.record(), "optimizer_state_bytes": facts.optimizer_state_bytes, "stop_reason": run.stop_reason,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),  # slm/cli/malloc.py: huge-page malloc or not
        "output_dir": env.out, "data_digest": run.data_digest, "skipped_nonfinite": run.skipped_nonfinite,
        **({"data_sources": data_sources} if data_sources is not None else {}),
    }
    if env.procs.primary:
        write_json(os.path.join(env.out, "summary.json"), summary)
    scored = (f"eval loss {ev['eval_loss']:.4f} | bpb {ev['eval_bpb']:.4f}" if run.last_eval
              else "no eval (stopped by a signal)")
    env.log(f"[done] {run.step} steps, {run.tokens:,} tokens in {summary['wall_time_s']:.0f}s | {scored} "
            f"| {summary['tokens_per_sec']:,.0f} tok/s | mfu {summary['mfu']:.1%} "
            f"| peak rss {summary['peak_rss_mb']:,.0f} MB | {env.out}")
    return summary
