"""Everything before the first step: settle the config, make the output dir, set up the data and tokenizer,
then choose (under --auto-fit) and compile the step, checking its memory against the machine and budget.

The data is set up before jax is imported (the seeds' lesson: tokenization must not compete with a
half-built model for memory), and the step is compiled once: pre-flight's executable is the one that
trains.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from slm.data.heldout import EvalSet, build_eval_set, held_out_split
from slm.data.instruction import load_chat_template, optional_chat_template
from slm.data.mixture import Mixture, normalized
from slm.data.packing import prepare_sequences
from slm.data.sources import HubDataset, LocalFiles, TextSource, resolve_source
from slm.data.tokenizer import (
    SpecialIds,
    load_tokenizer,
    special_ids,
    train_bpe,
    special_config,
)
from slm.errors import ConfigError, DatasetError
from slm.io.atomic import write_atomically, write_json
from slm.io.hf_import import checkpoint_dtype
from slm.io.tracking import require_tensorboard, require_wandb
from slm.memory.estimate import estimate_memory_usage, parse_size
from slm.memory.fit import fit_candidates, smallest_setting
from slm.memory.finetune import Finetune
from slm.memory.host import available_host_mb, release_free_heap, total_ram_gb
from slm.memory.preflight import MemoryPlan
from slm.model.matmul import default_matmul_precision
from slm.model.sizing import (
    ModelShape,
    choose_shape,
    count_params,
    default_vocab_size,
)
from slm.train.config import (
    PRESETS,
    Config,
    apply_preset,
    auto_preset,
    lora_target_list,
    validate,
)
from slm.train.defaults import Choice, resolve_defaults
from slm.train.devices import (
    Processes,
    configure_cpu_devices,
    enable_compile_cache,
    init_distributed,
    open_device_pools,
)
from slm.train.init_from import init_read_mb, pretrained
from slm.train.resume import check_process_count, resume_config, saved_process_count

Log = Callable[[str], None]


def settle_config(c: Config, explicit: set[str] | None, log: Log) -> tuple[Config, Processes]:
    """Validate, take a resumed run's settings, start the processes and apply --preset."""
    validate(c)
    require_tensorboard()
    if c.wandb:
        require_wandb()
    if c.resume:
        c = resume_config(c, explicit, log if not c.process_id else _silent)
    # Before anything asks jax for its devices (--preset auto does).
    procs = init_distributed(c.coordinator_address, c.num_processes, c.process_id, c.cpu_devices)
    if c.resume:  # before the data and the compile: the checkpoint's own record is checked again on restore
        check_process_count(c.output_dir, saved_process_count(c.output_dir), procs.count)
    if c.preset and not c.resume:
        name = c.preset
        if name == "auto":  # it asks jax for the platform: the host devices must be set up first
            import jax

            configure_cpu_devices(c.cpu_devices)
            name = auto_preset(total_ram_gb(), jax.devices()[0].platform)
        changed = apply_preset(c, name, explicit)
        if procs.count > 1:  # "auto" reads each host's RAM: process 0's choice for all
            keys = sorted({k for preset in PRESETS.values() for k in preset})
            c = dataclasses.replace(c, **procs.decide0(lambda: {k: getattr(c, k) for k in keys}))
        (log if procs.primary else _silent)(
            f"[preset] {c.preset}: {', '.join(changed) or 'nothing to change (explicit flags win)'}")
        validate(c)
    return c, procs


def _silent(*args: Any, **kwargs: Any) -> None:
    pass


def make_output_dir(c: Config, log: Log = print) -> tuple[str, Any]:
    """--output-dir (refused if it holds another run, unless resuming), or a new runs/<timestamp>, and its
    slm.io.runlock.RunLock, taken before anything is written there: (dir, lock). A live run's directory is
    refused, naming the trainer that owns it."""
    from slm.io.runlock import RunLock

    out = c.output_dir
    if out is None:
        out = base = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        n = 1
        while os.path.exists(out):  # two runs started in the same second
            out, n = f"{base}-{n}", n + 1
    try:
        os.makedirs(out, exist_ok=True)
        lock = RunLock(out, log)  # creating the lock file is the writability test
    except OSError as e:
        raise ConfigError(f"--output-dir {out}: not writable ({e.strerror}); choose another directory")
    if os.path.exists(os.path.join(out, "config.json")) and not c.resume:
        lock.release()
        raise ConfigError(f"--output-dir {out}: already holds a run (config.json); choose a new directory "
                          f"so nothing saved there is overwritten")
    return out, lock


@dataclass
class TrainData:
    """The run's data before the model exists: sources, tokenizer, the eval set and (full load) the rows."""

    source: TextSource
    tokenizer: Any
    special: SpecialIds  # the document separator and start tokens
    tokenizer_s: float
    eval_set: EvalSet
    held_out_documents: int  # the stream's first documents, held out for eval (0: a separate eval source)
    shape: ModelShape
    data_mb: float  # the data pipeline's host memory
    rows: tuple[np.ndarray, np.ndarray] | None  # full load: this process's (inputs, targets)
    init_params: dict | None = None  # --init-from: the pretrained weights (None when resuming: the checkpoint has them)
    init_folder: str | None = None  # --init-from: the local folder (a hub id downloaded)
    base_fingerprint: str | None = None  # --init-from: sha256 of the weights as read (a LoRA checkpoint records it)
    chat_template: str | None = None  # --chat-template: the template string that formats each example
    choices: list[Choice] = dataclasses.field(default_factory=list)  # defaults chosen with the data (the tokenizer)


def eval_source_of(c: Config, source: TextSource, log: Log) -> TextSource | None:
    """--eval-dataset-id (a hub id: its validation split when it has one), else the source's own split."""
    if not c.eval_dataset_id:
        return source.validation()
    eval_source = resolve_source(c.eval_dataset_id, text_column=c.text_column, flag="--eval-dataset-id", log=log,
                                 prompt_column=c.prompt_column, response_column=c.response_column)
    if isinstance(eval_source, HubDataset):
        eval_source = eval_source.validation() or eval_source
    return eval_source


def hold_out_head(c: Config, source: TextSource, tokens: int | None = None) -> list[str]:
    """The first documents, held out for eval: ~6 chars/token covers `tokens` (default --eval-tokens), at
    most 10% of a file."""
    tokens = tokens or c.eval_tokens
    budget = tokens * 6 if source.size_bytes is None else min(tokens * 6, source.size_bytes // 10)
    docs, rest = held_out_split(source, max(budget, 1))
    if not docs:
        raise DatasetError(f"{source.name}: the dataset has no documents (empty file or no text); check --dataset-id")
    if not rest:
        raise DatasetError(f"{source.name}: holding out --eval-tokens {c.eval_tokens} leaves nothing to train on; "
                           f"pass --eval-dataset-id, a smaller --eval-tokens, or more documents")
    return docs


def make_tokenizer(c: Config, source: TextSource, skip_documents: int, out: str, procs: Processes,
                   log: Log, chat_template: str | None = None) -> tuple[Any, SpecialIds, float]:
    """--tokenizer, or a BPE trained on the training stream (on process 0, sent to the others: no shared
    filesystem needed); saved as the run's tokenizer.json with a tokenizer_config.json naming its separator
    (and keeping the tokenizer's chat template, for generate.py --chat and the exports).
    Returns (tokenizer, its special ids, seconds)."""
    from tokenizers import Tokenizer

    def build() -> list:
        t = time.time()
        if c.tokenizer:
            tok = load_tokenizer(c.tokenizer)
        else:
            tok = train_bpe(source.documents(skip_head=skip_documents), c.vocab_size or default_vocab_size(c.target_params))
            log(f"[tokenizer] trained a byte-level BPE with {tok.get_vocab_size():,} tokens in {time.time() - t:.1f}s")
        seconds = time.time() - t
        special = special_ids(tok, c.tokenizer)
        write_atomically(os.path.join(out, "tokenizer.json"), tok.save)  # on --resume it replaces itself
        write_json(os.path.join(out, "tokenizer_config.json"), special_config(tok, special, chat_template))
        return [tok.to_str() if procs.count > 1 else tok, [special.eos, special.bos, special.found], seconds]

    tok, special, seconds = procs.decide0(build)
    tok = Tokenizer.from_str(tok) if isinstance(tok, str) else tok
    special = SpecialIds(*special)
    log(f"[tokenizer] {special.describe(tok)}")
    return tok, special, seconds


def training_source(c: Config, log: Log) -> TextSource:
    """--dataset-id, or the weighted Mixture of several (each resolved as one would be)."""
    ids = c.dataset_id if isinstance(c.dataset_id, list) else [c.dataset_id]
    sources = [resolve_source(d, dataset_config=c.dataset_config, split=c.split, text_column=c.text_column,
                              streaming=c.use_streaming, log=log, prompt_column=c.prompt_column,
                              response_column=c.response_column) for d in ids]
    if len(sources) == 1:
        return sources[0]
    return Mixture(" + ".join(s.name for s in sources), sources, normalized(c.dataset_weights or [], len(sources)))


def held_out_docs(c: Config, source: TextSource) -> list[str]:
    """The head held out for eval; a mixture holds out each source's own head (--eval-tokens by weight)."""
    if not isinstance(source, Mixture):
        return hold_out_head(c, source)
    parts = [hold_out_head(c, s, max(int(c.eval_tokens * w), 1)) for s, w in zip(source.sources, source.weights)]
    source.heads = [len(p) for p in parts]
    return [d for p in parts for d in p]


def setup_data(c: Config, out: str, procs: Processes, log: Log) -> tuple[TrainData, Config]:
    """Sources, held-out set and tokenizer (tokenizer before model, the seeds' lesson), then the shape; and the
    Config with --init-from's pinned revision and, unless --tokenizer was given, its tokenizer.json."""
    source = training_source(c, log)
    eval_source = eval_source_of(c, source, log)
    heldout = held_out_docs(c, source) if eval_source is None else []
    init_shape, init_folder, choices = None, None, []
    if c.init_from:
        init_shape, init_folder, revision = pretrained(c, log)
        c = dataclasses.replace(c, init_revision=revision)
        if not c.tokenizer:
            c = dataclasses.replace(c, tokenizer=os.path.join(init_folder, "tokenizer.json"))
            choices = [Choice("tokenizer", c.tokenizer, f"the pretrained model's own (--init-from {c.init_from})")]
    chat_template = load_chat_template(c.tokenizer) if c.chat_template else None
    kept = chat_template or (optional_chat_template(c.tokenizer) if c.tokenizer else None)  # for generate --chat
    tokenizer, special, tok_s = make_tokenizer(c, source, len(heldout), out, procs, log, kept)
    shape = init_shape or choose_shape(c.target_params, tokenizer.get_vocab_size(), c.n_layers, c.d_model, c.n_heads)
    if eval_source is not None:
        whole = isinstance(eval_source, LocalFiles)  # a separate local file is scored whole, a hub split capped
        eval_set = build_eval_set(eval_source.documents(), tokenizer, c.seq_len, None if whole else c.eval_tokens,
                                  eval_source.name, special, chat_template)
    else:
        eval_set = build_eval_set(heldout, tokenizer, c.seq_len, c.eval_tokens, f"{source.name} (held-out head)",
                                  special, chat_template)
    rows = None
    if c.use_streaming:
        data_mb = estimate_memory_usage(0, c.seq_len, c.batch_size, c.shuffle_buffer_size)["streaming_mb"]
    else:
        inputs, targets = prepare_sequences(source, tokenizer, c.seq_len, c.stride, c.max_examples, len(heldout),
                                            special=special, chat_template=chat_template)
        rows = inputs[procs.index::procs.count], targets[procs.index::procs.count]  # this process's rows
        if len(rows[0]) < c.batch_size // procs.count:
            raise DatasetError(f"{source.name}: {len(rows[0])} sequences, fewer than --batch-size {c.batch_size}")
        data_mb = (rows[0].nbytes + rows[1].nbytes) / 2**20
        log(f"[data] full load: {rows[0].shape[0]:,} sequences, {data_mb:.1f} MB in memory")
    return TrainData(source, tokenizer, special, tok_s, eval_set, len(heldout), shape, data_mb, rows,
                     chat_template=chat_template, init_folder=init_folder, choices=choices), c


def doc_start(c: Config, data: TrainData) -> int | None:
    """--document-mask: the token each packed document begins at (its bos, else the end-of-text before it)."""
    if not c.document_mask:
        return None
    if not data.special.start:
        raise ConfigError("--document-mask: the tokenizer has no end-of-text or bos token to find documents by; "
                          "use a tokenizer with one, or leave --document-mask off")
    if data.chat_template and _inside_examples(data, data.special.start[0]):
        raise ConfigError(f"--document-mask with --chat-template: the template writes "
                          f"{data.tokenizer.id_to_token(data.special.start[0])!r}, the token documents are found by, "
                          f"inside each example (between prompt and response), so a response could not see its "
                          f"prompt; leave --document-mask off")
    return data.special.start[0]


def _inside_examples(data: TrainData, token: int) -> bool:
    """Whether the chat template writes `token` before an example's response (ChatML's <|im_end|> ends each turn)."""
    from slm.data.instruction import Example, render_parts

    name = data.tokenizer.id_to_token
    eos, bos = (name(i) if i is not None else None for i in (data.special.eos, data.special.bos))
    prompt, _ = render_parts(data.chat_template, Example("a", "b"), bos, eos)
    return token in data.tokenizer.encode(prompt, add_special_tokens=False).ids[1:]


def finetune_of(c: Config) -> Finetune | None:
    """A LoRA run's memory terms (a frozen base in --base-dtype, adapters on --lora-targets); None otherwise."""
    return None if c.lora_rank is None else Finetune(c.lora_rank, tuple(lora_target_list(c.lora_targets)), c.base_dtype)


FIT_KEYS = ("batch_size", "gradient_accumulation_steps", "use_8bit_optimizer", "use_mixed_precision",
            "gradient_checkpointing")


def saves_beside_steps(c: Config) -> bool:
    """Whether a step runs after a checkpoint save: not when the run ends within its first --checkpoint-every,
    unless a WSD schedule decays (it saves its last step before the decay, kept for a longer run to branch from,
    and the decay's steps run beside that save: slm.train.loop)."""
    wsd_saves = c.schedule == "wsd" and c.decay_fraction < 1 and (c.max_steps is None or c.max_steps > 1)
    return wsd_saves or c.max_steps is None or c.max_steps > c.checkpoint_every or c.checkpoint_minutes is not None


def fit_choices(c: Config, data: TrainData, procs: Processes, chunk_lever: bool = False) -> list[dict]:
    """--auto-fit's candidates, fastest first (process 0's, since each host reads its own free memory); [{}]
    without it."""
    import jax

    if not c.auto_fit:
        return [{}]
    platform = jax.devices()[0].platform
    limit = available_host_mb() if platform == "cpu" else None
    budget = min(parse_size(c.memory_budget), int(limit * 2**20)) if limit else parse_size(c.memory_budget)
    strict = procs.count > 1 or platform != "cpu" or bool(c.cpu_devices)  # devices the user chose: all of them
    common = dict(platform=platform, data_mb=data.data_mb, optimizer=c.optimizer, loss_chunk=c.loss_chunk,
                  finetune=finetune_of(c))

    def candidates() -> list[dict]:
        found = fit_candidates(data.shape, c.seq_len, c.batch_size, c.gradient_accumulation_steps, budget,
                               max_devices=len(jax.devices()),
                               user=(c.use_8bit_optimizer, c.use_mixed_precision, c.gradient_checkpointing),
                               checkpoint_sync=c.checkpoint_sync, saves_beside_steps=saves_beside_steps(c),
                               peak_flops=fit_peak_flops(c, platform), chunk_lever=chunk_lever, **common)
        return [f for f in found if not strict or f["devices"] == len(jax.devices())]

    choices = procs.decide0(candidates)
    if not choices:
        what, peak = smallest_setting(data.shape, c.seq_len, **common)
        raise ConfigError(f"--auto-fit: nothing fits --memory-budget {c.memory_budget} with a 10% margin for this "
                          f"model ({count_params(data.shape):,} params) at --seq-len {c.seq_len}: the smallest setting "
                          f"({what}) needs ~{peak:,.0f} MB; raise the budget or lower --target-params / --seq-len")
    return choices


def fit_peak_flops(c: Config, platform: str) -> float | None:
    """The host's peak FLOP/s for auto-fit's expected tokens/s (CPU: measured once, remembered; shown only,
    the ranking does not use it)."""
    import jax

    from slm.train.throughput import device_peak_flops

    peak, _ = device_peak_flops(jax.devices()[0], c.matmul_precision)
    return peak * (1 if platform == "cpu" else len(jax.devices())) if peak == peak else None


def settle_defaults(c: Config, data: TrainData, log: Log) -> tuple[Config, list[Choice]]:
    """Every default the user left unset, resolved once the data and the backend are known (slm.train.defaults),
    logged as one block: the complete Config and the choices (recorded in config.json)."""
    configure_cpu_devices(c.cpu_devices)  # before jax's backend starts: it is first imported here
    import jax

    stored = checkpoint_dtype(data.init_folder) if data.init_folder else None
    c, choices = resolve_defaults(c, data.shape, jax.default_backend(), default_matmul_precision(), stored)
    choices = data.choices + choices
    for choice in choices:
        log(choice.line())
    return c, choices


def plan_step(c: Config, data: TrainData, procs: Processes, log: Log,
              chunk_lever: bool) -> tuple[Any, Any, MemoryPlan, Config]:
    """Compile the step for the settings (or, under --auto-fit, the fastest candidates until XLA agrees one
    fits) and check it against the machine and --memory-budget. `chunk_lever`: --auto-fit may change the loss
    chunk (the user did not give one). Returns (built, compiled, plan, the Config with the chosen settings)."""
    enable_compile_cache()
    from slm.train.builder import StepSpec, build, training_mesh

    budget = parse_size(c.memory_budget) / 2**20 if c.memory_budget else None
    choices = fit_choices(c, data, procs, chunk_lever=chunk_lever)
    for i, choice in enumerate(choices[:4]):  # XLA has the last word: compile and check the best few
        c = dataclasses.replace(c, **{k: choice[k] for k in FIT_KEYS + ("loss_chunk",) if k in choice})
        built = build(StepSpec.from_config(c, data.shape, doc_start(c, data)),
                      training_mesh(c.batch_size, bool(c.cpu_devices), choice.get("devices")))
        compiled, plan = memory_plan(c, built, data, budget * 0.9 if c.auto_fit and budget else budget)
        plan.settle_sync(("on" if choice["checkpoint_sync"] else "off") if choice else c.checkpoint_sync)
        refusal = next((r for r in procs.gather(plan.refusal) if r), None)  # one host's refusal is everyone's
        if refusal is None:
            break
        if not c.auto_fit:
            for line in plan.describe():
                log(line)
            raise ConfigError(checked_refusal(c, data, procs, plan, refusal, chunk_lever))
    else:
        raise ConfigError(f"--auto-fit: none of the {i + 1} fastest candidates fits once compiled (last: "
                          f"{refusal}); raise the budget or lower --target-params / --seq-len")
    if c.auto_fit:
        for line in fit_report(c, choices, i, plan):
            log(line)
        import jax

        if plan.platform == "cpu" and not c.cpu_devices and plan.devices < len(jax.devices()):
            c = dataclasses.replace(c, cpu_devices=plan.devices)  # in config.json: a resume makes the same devices
    for line in plan.describe():
        log(line)
    return built, compiled, plan, c


def checked_refusal(c: Config, data: TrainData, procs: Processes, plan: MemoryPlan, refusal: str,
                    chunk_lever: bool) -> str:
    """The pre-flight's refusal, its suggestion checked first: it names --auto-fit (with the budget it would
    need) only when --auto-fit finds a setting there; otherwise it says that nothing at this model and
    --seq-len fits, and what the smallest setting needs."""
    over_budget = plan.budget_mb is not None and plan.predicted_peak_mb > plan.budget_mb
    budget = c.memory_budget if over_budget else f"{plan.limit_mb * 0.9 / 1024:.1f}GB"
    short = next((s for s in procs.gather(plan.shortfall) if s), refusal)  # every process's, as the refusal
    try:
        fit_choices(dataclasses.replace(c, auto_fit=True, memory_budget=budget), data, procs, chunk_lever)
        return refusal
    except ConfigError as e:
        return f"{short}; no setting of this run fits: {str(e).removeprefix('--auto-fit: ')}"


def fit_report(c: Config, choices: list[dict], i: int, plan: MemoryPlan) -> list[str]:
    """--auto-fit's decision, before step 1: the setting, its predicted peak against the budget, the expected
    speed, and the runner-up."""
    on = {True: "on", False: "off"}

    def setting(f: dict) -> str:
        return (f"micro-batch {f['batch_size']} x accumulation {f['gradient_accumulation_steps']} on "
                f"{f['devices']} device(s), 8-bit state {on[f['use_8bit_optimizer']]}, bf16 "
                f"{on[f['use_mixed_precision']]}, remat {on[f['gradient_checkpointing']]}, saves "
                f"{'wait' if f['checkpoint_sync'] else 'in the background'}"
                + (f", loss over {f['loss_chunk']}-entry chunks" if f.get("loss_chunk") else ""))

    def speed(f: dict) -> str:
        return f"~{f['tokens_per_s']:,.0f} tokens/s expected" if "tokens_per_s" in f else f"speed {f['speed']:.2f}"

    chosen, rest = choices[i], choices[i + 1:]
    lines = [f"[auto-fit] --memory-budget {c.memory_budget}: {len(choices)} settings keep the effective batch of "
             f"{c.batch_size * c.gradient_accumulation_steps} x {c.seq_len} tokens and are predicted to fit with a "
             f"10% margin; the fastest predicted is chosen" + (f" ({i} faster ones did not fit once compiled)" if i else ""),
             f"[auto-fit] chosen: {setting(chosen)}: predicted peak {plan.predicted_peak_mb:,.0f} MB of "
             f"{parse_size(c.memory_budget) / 2**20:,.0f} MB ({plan.what}, XLA's compiled step), {speed(chosen)}"]
    if rest:
        lines.append(f"[auto-fit] runner-up: {setting(rest[0])}: predicted peak {rest[0]['predicted_peak_mb']:,.0f} "
                     f"MB, {speed(rest[0])}")
    return lines


def memory_plan(c: Config, built: Any, data: TrainData, budget_mb: float | None) -> tuple[Any, MemoryPlan]:
    """Compile `built`'s step and put XLA's figure beside the estimate and the machine's limit:
    (the compiled step, the plan)."""
    import jax

    from slm.train.builder import compile_step

    compiled, compile_s, compiled_mb = compile_step(built)
    mesh = built.mesh
    open_device_pools(mesh.devices.flat)  # a GPU allocator's host table, in the RSS measured next
    release_free_heap()  # the compiler's freed memory: back to the OS, so the RSS measured next is the runtime's
    n_dev, platform = int(mesh.devices.size), mesh.devices.flat[0].platform
    lora = {} if c.lora_rank is None else {"model": data.shape, "lora_rank": c.lora_rank, "base_dtype": c.base_dtype,
                                           "lora_targets": lora_target_list(c.lora_targets)}
    estimate = dict(shape=None if lora else data.shape, mixed_precision=c.use_mixed_precision,
                    use_8bit_optimizer=c.use_8bit_optimizer, gradient_accumulation_steps=c.gradient_accumulation_steps,
                    gradient_checkpointing=c.gradient_checkpointing, streaming=c.use_streaming, devices=n_dev,
                    platform=platform, sharding=c.sharding, optimizer=c.optimizer, loss_chunk=c.loss_chunk, **lora)
    est = estimate_memory_usage(0, c.seq_len, c.batch_size, c.shuffle_buffer_size, **estimate)
    alone = estimate_memory_usage(0, c.seq_len, c.batch_size, c.shuffle_buffer_size, checkpoint_sync=True,
                                  **estimate)["checkpoint_staging_mb"]  # no step beside a save
    est["data_pipeline_mb"] = round(data.data_mb, 3)
    if platform == "cpu":
        limit = available_host_mb()
    else:
        stats = mesh.devices.flat[0].memory_stats() or {}
        limit = stats["bytes_limit"] / 2**20 if "bytes_limit" in stats else None
    local = sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index())  # this host's share
    load_mb, layer_mb = init_read_mb(c, data)
    return compiled, MemoryPlan(est, compiled_mb, compile_s, platform, n_dev, local, data.data_mb, limit, budget_mb,
                                staging_alone_mb=alone, saves_beside_steps=saves_beside_steps(c),
                                load_mb=load_mb, load_layer_mb=layer_mb)
