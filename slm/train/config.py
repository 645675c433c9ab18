"""Config: every setting of a run, declared once with its flag, help, units and what --resume and --config do
with it. argparse (slm.cli.flags), config files (slm.cli.config_file), resume (slm.train.resume) and the
flag table in docs/flags.md are all generated from these declarations.

What a resumed or repeated run does with a field (its `policy`):

    identity    what the run *is* (data, tokenizer, model, optimizer, schedule): a --config file or a
                run's config.json repeats it, and --resume keeps the run's value (a different one given on
                the command line is refused, naming it)
    adjustable  how long and how visibly it runs (steps, time, logging, checkpoint cadence, devices):
                repeated by --config; --resume keeps the run's value unless the command line gives one
    launch      how this process was started (jax.distributed settings): never taken from a file's run
                or a resumed run
    per_run     output dir, --resume itself, --preset and --auto-fit: not repeated from a run's
                config.json (the preset's and auto-fit's choices are already in the saved values)

Some values are resolved when a run starts (the learning rate, warmup, stride and vocabulary) and saved
resolved in config.json beside `RunFacts`, the run's derived facts (shape, parameter count, devices):
a config.json passed back as --config therefore trains the same model the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from slm.errors import ConfigError
from slm.memory.estimate import parse_size

IDENTITY, ADJUSTABLE, LAUNCH, PER_RUN = "identity", "adjustable", "launch", "per_run"


def setting(default: Any, help: str, policy: str, units: str = "", unset: str | None = None,
            choices: tuple[str, ...] | None = None, optional_value: str | None = None,
            repeatable: bool = False) -> Any:
    """A Config field: `help` (no % escaping), `units` shown in the flag table, `unset` the word for a
    None default (default "auto"), `choices` for a string, `optional_value` for a flag that may be given
    bare (argparse nargs="?": --resume alone means "latest"), `repeatable` for a flag that may be given
    several times (a list)."""
    meta = {"help": help, "policy": policy, "units": units, "unset": unset, "choices": choices,
            "optional_value": optional_value, "repeatable": repeatable}
    return field(default=default, metadata=meta)


@dataclass
class Config:
    # data
    dataset_id: str | list[str] | None = setting(None, "Hub id (e.g. roneneldan/TinyStories), file, directory, glob or http(s) URL; repeat it for a weighted mixture (see --dataset-weights). Default: TinyStories when the hub answers, else the built-in offline corpus", IDENTITY, repeatable=True)
    dataset_weights: list[float] | None = setting(None, "With several --dataset-id: shares of training tokens, e.g. 0.7,0.3 (config files: a list; normalised). Default: equal", IDENTITY, "shares")
    mixture_exhausted: str = setting("restart", "With several --dataset-id: a source that runs out is restarted on its next epoch (restart) or dropped, the others renormalised (drop)", IDENTITY, choices=("restart", "drop"))
    dataset_config: str | None = setting(None, "Hub dataset configuration name", IDENTITY)
    split: str = setting("train", "Split to train on", IDENTITY)
    text_column: str | None = setting(None, "Column holding the text (auto-detected: text, content, story, ...)", IDENTITY)
    eval_dataset_id: str | None = setting(None, "Separate held-out source, scored whole. Default: the source's validation split, else its first documents (held out from training)", IDENTITY)
    use_streaming: bool = setting(False, "Stream and tokenize on the fly in constant memory (off: load and tokenize everything up front)", IDENTITY)
    shuffle_buffer_size: int = setting(10_000, "Documents in the shuffle buffer (0 or 1: no shuffling)", IDENTITY, "documents")
    max_examples: int | None = setting(None, "Use at most this many training documents per epoch", IDENTITY, "documents")
    # start from a pretrained model
    init_from: str | None = setting(None, "A Hugging Face model folder or hub id (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM; safetensors only) to start from: its shape, weights and tokenizer replace --target-params and the BPE", IDENTITY, unset="off")
    init_revision: str | None = setting(None, "With a hub --init-from: the commit to download (default: the newest, recorded here so a resume loads the same weights)", IDENTITY, unset="newest")
    lora_rank: int | None = setting(None, "LoRA: train rank-R adapters on --lora-targets of a frozen --init-from base (no gradients or optimizer state for the base); off: full fine-tuning", IDENTITY, "rank", unset="off")
    lora_alpha: float = setting(16.0, "LoRA scale numerator: adapters add (alpha / rank) * x A B", IDENTITY)
    lora_dropout: float = setting(0.0, "LoRA: dropout on the adapters' input during training", IDENTITY, "probability")
    lora_targets: str = setting("q_proj,v_proj", "LoRA: comma-separated Hugging Face module names among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj", IDENTITY)
    base_dtype: str | None = setting(None, "With --lora-rank: the dtype the frozen base is held in (adapters always train in float32); nf4: QLoRA's 4-bit NormalFloat for the blocks' matrices (block 64, float32 absmax; embeddings bfloat16), dequantised per matmul. Default: bfloat16 where that changes no value (the checkpoint stored in bfloat16, bf16 products or --use-mixed-precision), else float32", IDENTITY, choices=("float32", "bfloat16", "float16", "nf4"))
    # instruction data
    prompt_column: str | None = setting(None, "Instruction data: the prompt column (with --response-column); the loss is taken on response tokens only", IDENTITY, unset="off")
    response_column: str | None = setting(None, "Instruction data: the response column (with --prompt-column)", IDENTITY, unset="off")
    chat_template: bool = setting(False, "Instruction data: format each example with the chat template of the tokenizer's tokenizer_config.json (user: prompt, assistant: response)", IDENTITY)
    # tokenizer
    tokenizer: str | None = setting(None, "Path to a tokenizer.json; otherwise a byte-level BPE is trained on the stream", IDENTITY)
    vocab_size: int | None = setting(None, "Vocabulary of the BPE to train (default: 512-8192 by --target-params)", IDENTITY, "tokens")
    # model
    target_params: int = setting(1_000_000, "Parameter target; the shape is chosen within 5% (see slm/model/sizing.py)", IDENTITY, "parameters")
    n_layers: int | None = setting(None, "Override: number of layers", IDENTITY)
    d_model: int | None = setting(None, "Override: model width", IDENTITY)
    n_heads: int | None = setting(None, "Override: attention heads", IDENTITY)
    seq_len: int = setting(128, "Tokens per training sequence", IDENTITY, "tokens")
    document_mask: bool = setting(False, "Packed documents attend only within themselves, positions restarting at each (needs a tokenizer with an end-of-text or bos token)", IDENTITY)
    stride: int | None = setting(None, "Tokens between sequence starts (default --seq-len: no overlap, nothing lost)", IDENTITY, "tokens")
    # optimisation
    batch_size: int = setting(32, "Sequences per micro-batch", IDENTITY, "sequences")
    gradient_accumulation_steps: int = setting(1, "Micro-batches per optimizer step (optax.MultiSteps)", IDENTITY, "micro-batches")
    learning_rate: float | None = setting(None, "Peak AdamW learning rate (default: 6e-4 * sqrt(125M / params), at most 1e-2)", IDENTITY)
    optimizer: str | None = setting(None, "muon: Muon on the hidden matrices (attention and MLP kernels), AdamW on embedding, head, norms (slm/optim/muon.py); adamw: AdamW on every parameter. Default: muon from scratch; adamw with --lora-rank or --init-from (every trained parameter gets --learning-rate)", IDENTITY, unset="auto", choices=("adamw", "muon"))
    muon_learning_rate: float = setting(0.02, "With --optimizer muon: peak learning rate of the hidden matrices (follows the same schedule as --learning-rate)", IDENTITY)
    schedule: str = setting("wsd", "cosine: warmup, then cosine to 10% of the peak; wsd: warmup, the peak until --decay-fraction of the run (of --max-time's time, --max-steps' steps) is left, then linear to 0", IDENTITY, choices=("cosine", "wsd"))
    decay_fraction: float = setting(0.5, "With --schedule wsd: the last fraction of the run over which the rate decays to 0 (0.5: measured in docs/performance.md)", IDENTITY, "fraction")
    warmup_steps: int = setting(100, "Linear warmup (optimizer steps; over at most the first 20% of the run: of its steps, or of its time with --max-time)", IDENTITY, "steps")
    weight_decay: float = setting(0.1, "Decoupled weight decay on matrices", IDENTITY)
    grad_clip: float = setting(1.0, "Clip gradients to this global norm (0: off)", IDENTITY)
    dropout: float | None = setting(None, "Dropout on the embeddings and on each attention and MLP output, in training only, from --dropout-from-epoch on: a regulariser for data seen many times over (docs/performance.md). Default: 0.1 from scratch, 0 with --init-from", IDENTITY, "probability", unset="auto")
    dropout_from_epoch: int = setting(1, "The epoch (pass over the data, from 0) --dropout starts at: 1, once the data starts to repeat (measured better than from the start: docs/performance.md); the step with dropout compiles when that epoch begins", IDENTITY, "epoch")
    use_mixed_precision: bool = setting(False, "bfloat16 compute with float32 master weights", IDENTITY)
    matmul_precision: str | None = setting(None, "Operands of the matrix products (projections, MLP, head): bfloat16 rounds them to bf16 and sums in float32, forward and backward, activations unchanged (1.2-1.6x faster steps on CPUs with AVX512-BF16, same losses: docs/performance.md). Default: bfloat16 on such CPUs (AVX512-BF16 or AMX-BF16), else float32", ADJUSTABLE, unset="auto", choices=("float32", "bfloat16"))
    loss_chunk: int | None = setting(None, "The loss over the vocabulary this many entries at a time, never the whole (batch, seq, vocab) logits (0: the whole logits; same loss, more compute: slm/model/loss.py). Default on CPU: 512 with bf16 products (1.0-1.5x faster steps measured), else 512 above a vocabulary of 8192; on accelerators 8192 above 8192 (Mistral, Qwen2.5: GBs less memory)", ADJUSTABLE, "vocabulary entries", unset="auto")
    gradient_checkpointing: bool = setting(False, "Recompute each block's activations in the backward pass (less memory, ~30% more compute)", IDENTITY)
    use_8bit_optimizer: bool = setting(False, "Keep Adam's moments as 8-bit block-quantized codes: ~2 bytes/param instead of 8 (slm/optim/adam8bit.py)", IDENTITY)
    # length of the run
    epochs: int | None = setting(None, "Passes over the data, reshuffled each epoch (default: repeat until --max-steps/--max-time, else 1)", IDENTITY)
    max_steps: int | None = setting(None, "Stop after this many optimizer steps (the run's total: given on --resume it replaces the run's limits and the schedule is re-planned to end there)", ADJUSTABLE, "steps")
    max_time: float | None = setting(None, "Wall-clock budget from process start: train until spent, then eval and save. A resumed run counts its earlier sessions' time; given on --resume it replaces the run's limits (docs/resume.md)", ADJUSTABLE, "seconds")
    seed: int = setting(0, "Seed for init, shuffling and sampling", IDENTITY)
    # evaluation, logging, outputs
    eval_every: int = setting(500, "Evaluate (and write a sample) every N optimizer steps, and at the end", ADJUSTABLE, "steps")
    eval_tokens: int = setting(65_536, "Tokens scored per eval (a separate --eval-dataset-id file is scored whole)", ADJUSTABLE, "tokens")
    log_every: int = setting(10, "Log a metrics row every N optimizer steps", ADJUSTABLE, "steps")
    checkpoint_every: int = setting(1000, "Save a checkpoint every N optimizer steps, and at the end", ADJUSTABLE, "steps")
    checkpoint_minutes: float | None = setting(None, "Also save a checkpoint every M minutes of wall time", ADJUSTABLE, "minutes", unset="off")
    checkpoint_sync: str = setting("auto", "on: each save waits for its write before training goes on, so no step runs beside the save's copy of the state; off: saves write in the background; auto: on only when that copy is what does not fit --memory-budget or the machine", ADJUSTABLE, choices=("auto", "on", "off"))
    keep_checkpoints: int = setting(3, "Keep the newest N checkpoints plus the best by eval loss and, with --schedule wsd, the last before the decay (a longer run branches from it; the newest is never deleted)", ADJUSTABLE, "checkpoints")
    skip_nonfinite: int = setting(0, "Skip up to N steps whose loss or gradient is NaN/Inf (each logged) before stopping the run", ADJUSTABLE, "steps")
    output_dir: str | None = setting(None, "Where outputs go (default: a new folder under runs/)", PER_RUN)
    cpu_devices: int | None = setting(None, "CPU only: host devices to split each batch over (default: one per core, at most 8; see slm/train/devices.py)", ADJUSTABLE, "devices")
    sharding: str = setting("dp", "dp: each device holds the whole train state (batch split over the devices); fsdp: params and optimizer state split over them too (less memory per device, same steps)", ADJUSTABLE, choices=("dp", "fsdp"))
    coordinator_address: str | None = setting(None, "Several processes (jax.distributed): host:port of process 0, with --num-processes and --process-id (clusters JAX detects, e.g. SLURM, need none of them)", LAUNCH, unset="off")
    num_processes: int | None = setting(None, "Several processes: how many; each reads its own part of the data and --batch-size is split over all devices", LAUNCH, "processes", unset="off")
    process_id: int | None = setting(None, "Several processes: this one's index, 0 to --num-processes - 1 (process 0 writes logs, samples and summary)", LAUNCH, unset="off")
    # memory
    memory_budget: str | None = setting(None, "Refuse to start (exit 2) if the predicted peak exceeds this, e.g. 8GB: host RSS on CPU, device memory on an accelerator", ADJUSTABLE, "bytes (8GB, 512MB)", unset="off")
    plan_for: str | None = setting(None, "Plan the run for a GPU or TPU you will rent, from this machine: every program it runs on the device (train, eval, sample prefill and decode) compiled ahead of time for the target by XLA; prints each one's peak against the target's memory, writes plan.json, trains nothing, reads no weights or data; exit 0 if all fit, else 2 naming the program and the smallest change that fits (with --auto-fit: choose it). Targets: a10g-24gb, l4-24gb, rtx4090-24gb, a100-40gb, a100-80gb, h100-80gb, h200-141gb (xN: N in one host), v5e-1, v5e-4, v5e-8, v4-8, v5p-8, v6e-8", PER_RUN, unset="off")
    auto_fit: bool = setting(False, "With --memory-budget: the fastest setting predicted to fit, keeping the effective batch: micro-batch x accumulation, host devices, 8-bit state, mixed precision, remat and checkpoint saves that wait for their write", PER_RUN)
    preset: str | None = setting(None, "limited-ram, medium-ram, high-ram, tpu or auto: the guide's settings for that hardware; explicit flags win", PER_RUN, unset="off")
    resume: str | None = setting(None, "Continue a run exactly (model, optimizer, schedule, data stream) from its newest checkpoint: --resume with --output-dir, or --resume RUN_DIR", PER_RUN, unset="off", optional_value="latest")
    memory_alert_mb: float | None = setting(None, "Print a warning each time host RSS crosses this many MB", ADJUSTABLE, "MB", unset="off")
    # tracking (TensorBoard event files and loss.png are always written to the output dir)
    wandb: bool = setting(False, "Also log to Weights & Biases (pip install wandb; WANDB_MODE=offline works)", ADJUSTABLE)
    wandb_project: str | None = setting(None, "W&B project", ADJUSTABLE, unset="slm-trainer")


@dataclass
class RunFacts:
    """What a run resolved or measured at start, saved beside the Config fields in its config.json (the
    keys of config.json that are not flags; a --config file ignores them)."""

    dataset: str
    eval_dataset: str
    model: dict
    params: int
    trainable_params: int  # params without LoRA; the adapters' with it
    base_fingerprint: str | None  # --init-from: sha256 of the pretrained weights as read
    model_flops_per_token: int
    optimizer_state_bytes: int
    memory_plan: dict
    held_out_documents: int
    device: str
    devices: int
    processes: int
    jax_version: str
    defaults: dict = dataclasses.field(default_factory=dict)  # each setting the run chose for the user: its reason


DERIVED_KEYS = frozenset(f.name for f in dataclasses.fields(RunFacts))


def fields_with(policy: str) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config) if f.metadata["policy"] == policy)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def explicit_fields(c: Config) -> set[str]:
    """The fields of `c` that differ from Config's defaults: what a notebook caller set explicitly."""
    defaults = Config()
    return {f.name for f in dataclasses.fields(Config) if getattr(c, f.name) != getattr(defaults, f.name)}


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


def apply_preset(c: Config, name: str, explicit: set[str] | None = None) -> list[str]:
    """Fill `c` from preset `name` (not "auto": resolve that first), except fields set explicitly
    (default: those that differ from Config's defaults). Returns the flags it changed."""
    explicit = explicit_fields(c) if explicit is None else explicit
    changed = []
    for k, v in PRESETS[name].items():
        if k not in explicit and getattr(c, k) != v:
            setattr(c, k, v)
            changed.append(flag_name(k) if isinstance(v, bool) else f"{flag_name(k)} {v}")
    c.preset = name
    return changed


# What a run saved before a setting existed used (its config.json lacks the key): a default that changed later
# must not change how such a run resumes or loads.
BEFORE_THE_SETTING = {"optimizer": "adamw", "schedule": "cosine", "matmul_precision": "float32", "loss_chunk": 0,
                      "dropout": 0.0, "dropout_from_epoch": 0}

POSITIVE = ("checkpoint_minutes", "keep_checkpoints", "memory_alert_mb", "batch_size", "gradient_accumulation_steps",
            "target_params", "epochs", "eval_every", "eval_tokens", "log_every", "checkpoint_every",
            "max_time", "learning_rate", "muon_learning_rate", "vocab_size", "n_layers", "d_model", "n_heads", "max_examples",
            "cpu_devices", "num_processes")
NON_NEGATIVE = ("dropout_from_epoch", "warmup_steps", "weight_decay", "grad_clip", "shuffle_buffer_size", "skip_nonfinite", "loss_chunk")


def validate(c: Config) -> None:
    """Raise ConfigError (one line naming the flag and the fix) for a value or combination that cannot work."""
    for name in POSITIVE:
        v = getattr(c, name)
        if v is not None and not v > 0:
            raise ConfigError(f"{flag_name(name)} {v}: must be positive")
    for name in NON_NEGATIVE:
        if (getattr(c, name) or 0) < 0:
            raise ConfigError(f"{flag_name(name)} {getattr(c, name)}: must be >= 0")
    if c.seq_len < 2:
        raise ConfigError(f"--seq-len {c.seq_len}: must be at least 2")
    if c.stride is not None and not 1 <= c.stride <= c.seq_len:
        raise ConfigError(f"--stride {c.stride}: must be between 1 and --seq-len ({c.seq_len})")
    if c.optimizer not in (None, "adamw", "muon"):
        raise ConfigError(f"--optimizer {c.optimizer}: choose adamw or muon")
    if c.optimizer == "muon" and c.lora_rank is not None:
        raise ConfigError("--optimizer muon with --lora-rank: adapters are low-rank by design; use --optimizer adamw")
    if c.schedule not in ("cosine", "wsd"):
        raise ConfigError(f"--schedule {c.schedule}: choose cosine or wsd")
    if not 0 < c.decay_fraction <= 1:
        raise ConfigError(f"--decay-fraction {c.decay_fraction}: must be in (0, 1]")
    if c.sharding not in ("dp", "fsdp"):
        raise ConfigError(f"--sharding {c.sharding}: choose dp (replicated state) or fsdp (state split over devices)")
    if c.process_id is not None and not 0 <= c.process_id < (c.num_processes or 1):
        raise ConfigError(f"--process-id {c.process_id}: must be between 0 and --num-processes - 1 "
                          f"({(c.num_processes or 1) - 1})")
    if c.memory_budget is not None:
        parse_size(c.memory_budget)
    if c.plan_for is not None:
        from slm.memory.targets import load_target

        load_target(c.plan_for)  # an unknown name: one line listing the known ones
    if c.auto_fit and not c.memory_budget and not c.plan_for:
        raise ConfigError("--auto-fit needs --memory-budget (e.g. --memory-budget 4GB) or --plan-for TARGET")
    if c.preset is not None and c.preset not in PRESETS and c.preset != "auto":
        raise ConfigError(f"--preset {c.preset}: choose one of {', '.join([*PRESETS, 'auto'])}")
    n_sets = len(c.dataset_id) if isinstance(c.dataset_id, list) else 1
    if c.dataset_weights is not None and n_sets == 1:
        raise ConfigError("--dataset-weights: needs several --dataset-id (a mixture); give one weight per dataset")
    if c.dataset_weights is not None and (len(c.dataset_weights) != n_sets or not all(w > 0 for w in c.dataset_weights)):
        raise ConfigError(f"--dataset-weights {','.join(map(str, c.dataset_weights))}: give {n_sets} positive "
                          f"weights, one per --dataset-id")
    if n_sets > 1 and not c.use_streaming:
        raise ConfigError("several --dataset-id (a mixture) need --use-streaming")
    if c.mixture_exhausted not in ("restart", "drop"):
        raise ConfigError(f"--mixture-exhausted {c.mixture_exhausted}: choose restart or drop")
    if c.max_steps is not None and (c.max_steps < 0 or (c.max_steps == 0 and not c.init_from)):
        raise ConfigError(f"--max-steps {c.max_steps}: must be positive (0 only with --init-from: evaluate and "
                          f"save the pretrained model as a run)")
    if c.init_from and (c.vocab_size or c.n_layers or c.d_model or c.n_heads):
        raise ConfigError("--init-from: the shape and vocabulary come from the checkpoint; drop --vocab-size, "
                          "--n-layers, --d-model and --n-heads")
    if c.lora_rank is not None and not c.init_from:
        raise ConfigError(f"--lora-rank {c.lora_rank}: adapters train on a pretrained base; give --init-from")
    if c.lora_rank is not None and c.lora_rank < 1:
        raise ConfigError(f"--lora-rank {c.lora_rank}: must be a positive rank (e.g. 8 or 16)")
    bad = sorted(set(lora_target_list(c.lora_targets)) - set(LORA_TARGETS))
    if bad or not lora_target_list(c.lora_targets):
        raise ConfigError(f"--lora-targets {c.lora_targets}: choose among {','.join(LORA_TARGETS)}")
    if c.dropout is not None and not 0 <= c.dropout < 1:
        raise ConfigError(f"--dropout {c.dropout}: must be in [0, 1)")
    epochs = None if (c.max_steps or c.max_time) else (c.epochs or 1)  # None: as many as the limit takes
    if c.dropout and not c.resume and epochs is not None and epochs <= c.dropout_from_epoch:
        raise ConfigError(f"--dropout {c.dropout:g}: it starts at --dropout-from-epoch {c.dropout_from_epoch}, which a "
                          f"run of {epochs} epoch(s) never reaches; add --dropout-from-epoch 0, or --epochs "
                          f"{c.dropout_from_epoch + 1}")
    if not 0 <= c.lora_dropout < 1:
        raise ConfigError(f"--lora-dropout {c.lora_dropout}: must be in [0, 1)")
    if c.base_dtype not in (None, "float32") and c.lora_rank is None:
        raise ConfigError(f"--base-dtype {c.base_dtype}: only a frozen LoRA base can be held in a low dtype; add --lora-rank")
    if (c.prompt_column is None) != (c.response_column is None):
        raise ConfigError("--prompt-column and --response-column: give both (the loss is taken on the response)")
    if c.chat_template and c.prompt_column is None:
        raise ConfigError("--chat-template: needs --prompt-column and --response-column")
    if c.tokenizer and c.vocab_size:
        raise ConfigError("--tokenizer and --vocab-size: give one (the vocabulary comes from the tokenizer file)")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_target_list(targets: str | list[str]) -> list[str]:
    """--lora-targets as a list (a config file may give a list)."""
    return [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]


def flag_table() -> list[str]:
    """docs/flags.md's table: one markdown row per flag (tests keep the file equal to this)."""
    rows = ["| flag | default | units | on --resume / --config | meaning |", "|---|---|---|---|---|"]
    words = {IDENTITY: "kept / repeated", ADJUSTABLE: "may change / repeated", LAUNCH: "this launch only",
             PER_RUN: "this run only"}
    for f in dataclasses.fields(Config):
        d = f.default
        d = "off" if d is False else (f.metadata["unset"] or "auto") if d is None else f"{d:,}" if type(d) is int else d
        rows.append(f"| `{flag_name(f.name)}` | {d} | {f.metadata['units']} | {words[f.metadata['policy']]} "
                    f"| {f.metadata['help']} |")
    return rows
