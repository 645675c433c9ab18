"""One builder of model + optimizer + train state: for training, the memory pre-flight, resume, generate and export.

`StepSpec` is everything the compiled train step depends on; `build` turns it into the Flax model, the
optax transformation and the state's shardings on a mesh; `compile_step` lowers and compiles the jitted
step at abstract shapes (nothing allocated) and reads XLA's memory analysis, and the trainer then runs
that same executable; `init_state` builds the state in place with its final layout; `load_run` restores
a run directory's parameters on one device, whatever mesh saved them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from slm.data.tokenizer import SpecialIds, load_tokenizer, special_ids
from slm.errors import RunError, TokenizerError, first_line
from slm.io.checkpoints import Checkpointer
from slm.memory.host import MB
from slm.model.lora import LoraSpec, split
from slm.model.sizing import ModelShape, default_loss_chunk
from slm.model.transformer import Transformer, init_params
from slm.optim.adam8bit import CHUNK_BLOCKS
from slm.optim.optimizer import make_optimizer
from slm.train.config import BEFORE_THE_SETTING
from slm.train.devices import data_mesh, shardings, state_shardings
from slm.train.step import TrainState, make_train_step
from slm.train.step import init_state as fresh_state


@dataclass(frozen=True)
class StepSpec:
    """What the compiled train step depends on (the model, the optimizer, the batch and its layout)."""

    shape: ModelShape
    seq_len: int
    batch_size: int  # the global micro-batch, split over the mesh
    accumulation: int = 1
    mixed_precision: bool = False
    remat: bool = False
    use_8bit: bool = False
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    sharding: str = "dp"
    seed: int = 0
    doc_start: int | None = None  # document masking: the token packed documents begin at
    lora: LoraSpec | None = None  # adapters train, the base is frozen (an input of the step)
    base_dtype: str = "float32"  # the frozen base's dtype, with lora
    optimizer: str = "adamw"  # or "muon" (slm.optim.muon)
    muon_lr_ratio: float = 1.0  # Muon's peak learning rate / AdamW's
    matmul: str = "float32"  # the matrix products' operand dtype (slm.model.matmul)
    loss_chunk: int | None = None  # the loss's vocabulary chunk (slm.model.loss); 0: the whole logits; None: default
    dropout: float = 0.0  # on the embeddings and residual branches, in training
    platform: str | None = None  # the backend compiled for: None, jax's default; --plan-for, the target's

    @classmethod
    def from_config(cls, c: Any, shape: ModelShape, doc_start: int | None = None) -> StepSpec:
        """The spec of a slm.train.config.Config (or a run's config.json as a namespace)."""
        return cls(shape, c.seq_len, c.batch_size, c.gradient_accumulation_steps, c.use_mixed_precision,
                   c.gradient_checkpointing, c.use_8bit_optimizer, c.weight_decay, c.grad_clip, c.sharding, c.seed,
                   doc_start, lora_spec(c), getattr(c, "base_dtype", None) or "float32", *optimizer_of(c),
                   getattr(c, "matmul_precision", None) or "float32", getattr(c, "loss_chunk", None),
                   0.0 if getattr(c, "dropout_from_epoch", 0) else getattr(c, "dropout", 0.0) or 0.0)


def optimizer_of(c: Any) -> tuple[str, float]:
    """(optimizer, Muon's peak rate / AdamW's) of a Config or a run's config (runs before Muon: adamw)."""
    get = c.get if isinstance(c, dict) else lambda k, d=None: getattr(c, k, d)
    optimizer = get("optimizer") or BEFORE_THE_SETTING["optimizer"]
    return optimizer, (get("muon_learning_rate", 0.02) / get("learning_rate") if optimizer == "muon" else 1.0)


def lora_spec(c: Any) -> LoraSpec | None:
    """The LoRA of a Config or a run's config (a namespace or dict); None for full training."""
    get = c.get if isinstance(c, dict) else lambda k, d=None: getattr(c, k, d)
    if not get("lora_rank"):
        return None
    targets = get("lora_targets", "q_proj,v_proj")
    targets = targets.split(",") if isinstance(targets, str) else targets
    return LoraSpec(int(get("lora_rank")), float(get("lora_alpha", 16.0)), float(get("lora_dropout", 0.0)),
                    tuple(t.strip() for t in targets if t.strip()))


@dataclass
class Built:
    """The model, optimizer and layout of one spec on one mesh; `abstract` is the state's shapes only."""

    spec: StepSpec
    model: Transformer
    tx: optax.GradientTransformation
    mesh: Any
    state_sharding: Any
    batch_sharding: Any
    abstract: TrainState
    base_abstract: Any = None  # LoRA: the frozen base's shapes in its dtype (None: full training)
    base_sharding: Any = None


def model_and_optimizer(spec: StepSpec, mesh: Any = None) -> tuple[Transformer, optax.GradientTransformation, TrainState]:
    """The Flax model, the optax transformation and the state's shapes (jax.eval_shape: nothing allocated).
    `mesh`: where the state is replicated (dp), so Muon can share its Newton-Schulz work over the devices."""
    platform = spec.platform or jax.default_backend()
    model = Transformer(spec.shape, dtype=jnp.bfloat16 if spec.mixed_precision else jnp.float32, remat=spec.remat,
                        doc_start=spec.doc_start, lora=spec.lora, matmul=spec.matmul,
                        loss_chunk=default_loss_chunk(spec.shape.vocab_size, platform, spec.matmul)
                        if spec.loss_chunk is None else spec.loss_chunk, dropout=spec.dropout,
                        nf4=spec.lora is not None and spec.base_dtype == "nf4", platform=spec.platform)
    # XLA:GPU holds a lax.cond's results apart: 8-bit Adam's update of Qwen3-0.6B took 5,065 MB of temporaries
    # under optax's cond, 1,785 under `where` (float32 Adam: 594 either way; compile-only H100, 2026-11-30). So
    # does libtpu: with 8-bit state, in chunks (adam8bit.CHUNK_BLOCKS), Qwen3-0.6B's step on a v5e 12,586 MB under
    # the cond, 7,467 under `where` (2026-12-03). Kept elsewhere: XLA:CPU's float32 update grows under `where`, and
    # the TPU terms of float32 state are fitted to the cond.
    tpu_8bit = platform == "tpu" and spec.use_8bit
    tx = make_optimizer(spec.weight_decay, spec.grad_clip, spec.accumulation, use_8bit=spec.use_8bit,
                        optimizer=spec.optimizer, muon_lr_ratio=spec.muon_lr_ratio, muon_mesh=mesh,
                        skip_by="where" if platform == "gpu" or tpu_8bit else "cond",
                        chunk_blocks=CHUNK_BLOCKS if platform == "tpu" else None)
    return model, tx, jax.eval_shape(lambda: fresh_state(trainable_init(model, spec), tx))


def trainable_init(model: Transformer, spec: StepSpec) -> Any:
    """The trained parameters at step 0 (traced): all of them, or with LoRA only the adapters (jit drops the
    base's random init, which nothing uses)."""
    params = init_params(model, spec.seed, spec.seq_len)
    return params if spec.lora is None else split(params)[1]


def base_shapes(model: Transformer, spec: StepSpec) -> Any:
    """LoRA: the frozen base's shapes in --base-dtype; None for full training."""
    if spec.lora is None:
        return None
    base = split(jax.eval_shape(lambda: init_params(model, spec.seed, spec.seq_len)))[0]
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, held_dtype(x.dtype, x.ndim, spec.base_dtype)), base)


def held_dtype(dtype: Any, ndim: int, base_dtype: str) -> Any:
    """The dtype a frozen base's leaf is held in: `base_dtype`; with "nf4" the blocks' kernels are NF4 codes
    (uint8) and absmax (float32, as any vector: norms, biases), and the other matrices (embedding, head) bfloat16."""
    if base_dtype != "nf4":
        return jnp.dtype(base_dtype)
    if jnp.dtype(dtype) == jnp.uint8:
        return jnp.dtype(jnp.uint8)
    return jnp.dtype(jnp.bfloat16 if ndim == 2 else jnp.float32)


def shares_muon_work(spec: StepSpec, mesh: Any) -> bool:
    """Whether the devices share Muon's Newton-Schulz work (slm.optim.muon.grouped_muon): with the state
    replicated (dp) over several devices, host CPU devices included."""
    return spec.sharding == "dp" and mesh.size > 1


def build(spec: StepSpec, mesh: Any) -> Built:
    """Model, optimizer and the state's shardings on `mesh` (nothing allocated)."""
    model, tx, abstract = model_and_optimizer(spec, mesh if shares_muon_work(spec, mesh) else None)

    def placed(tree: Any) -> tuple[Any, Any]:
        sh = state_shardings(tree, mesh, spec.sharding)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh), sh

    abstract, state_sharding = placed(abstract)
    base = base_shapes(model, spec)
    base_abstract, base_sharding = placed(base) if base is not None else (None, None)
    return Built(spec, model, tx, mesh, state_sharding, shardings(mesh)[1], abstract, base_abstract, base_sharding)


def training_mesh(batch_size: int, devices_chosen: bool, max_devices: int | None = None) -> Any:
    """The data mesh for a global micro-batch. The trainer makes up one host device per core for speed,
    and uses as many of those as divide the batch (at most `max_devices`: --auto-fit's choice); any other
    device count (several processes, an accelerator, --cpu-devices) is the user's, and a batch that does not
    divide over it is an error."""
    strict = jax.process_count() > 1 or jax.devices()[0].platform != "cpu" or devices_chosen
    return data_mesh(batch_size, None if strict else max_devices, strict=strict)


def compiled_memory(jitted: Any, *args: Any, options: dict | None = None) -> dict:
    """XLA's memory analysis of a jitted function for these (possibly abstract) arguments, in bytes.

    peak = arguments + outputs + temporaries - aliased (outputs written into donated arguments):
    what the compiled program holds at once, before the runtime's own overhead (compiled_peak). Also returns
    the executable under "compiled". `options`: XLA compiler options for this compile only (XLA_FLAGS' names).
    """
    compiled = jitted.lower(*args).compile(options)
    m = compiled.memory_analysis()
    out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "temporaries": m.temp_size_in_bytes, "aliased": m.alias_size_in_bytes}
    return {**out, "peak": compiled_peak(compiled), "compiled": compiled}


# libtpu's HBM beyond the arguments (fitted 2026-11-28 to the least HBM it compiles 8 steps in, v5e; docs/memory.md):
TPU_OVERLAY_MIB = (13.3, 0.0284)  # its program lives in overlays: ~13.3 MiB + 2.84% of the code (40 MiB of code: 14.4)
TPU_TEMP_PACKED = 0.75  # with HBM short it packs the temporaries' arena to ~0.57-0.84 of its size with room to spare


def compiled_peak(compiled: Any) -> int:
    """XLA's peak bytes of a compiled program in one device's memory: arguments + outputs + temporaries -
    aliased, or the backend's own peak figure where it is larger. On a TPU, the least HBM libtpu compiles the
    program in (tpu_hbm): neither of its own figures is that."""
    m = compiled.memory_analysis()
    if compiled_platform(compiled) == "tpu":
        return tpu_hbm(m)
    summed = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return max(summed, getattr(m, "peak_memory_in_bytes", 0) or 0)


def tpu_hbm(m: Any) -> int:
    """The HBM libtpu needs for a program of memory analysis `m`: its arguments and unaliased outputs, its code's
    overlays and its temporaries packed as when HBM is short. Against the least HBM a step compiled in beside a
    placeholder argument (tests/train/test_tpu_hbm.py), within -5.4% ... +6.8% on 8 steps: LoRA with SmolLM2-135M's
    nf4 base at 2, 4, 8 and 30 layers (80.6, 93.6, 118, ~255 MiB), its bf16 base at 2 (81), Qwen2.5-0.5B's at 2
    (~332), Mistral-7B's nf4 at 2 (1,879), and Qwen2.5-0.5B's full fine-tune at 2 (~3,095). libtpu's peak_memory_in_bytes counts what it stages in on-chip VMEM
    (+53% at 4 layers) and misses the arena at depth (-20% at 30); the plain sum counts the whole code (578 MiB at
    30 layers, held as 30 MiB of overlays) and the arena laid out with HBM to spare (+33% at 2 layers)."""
    code = m.generated_code_size_in_bytes
    overlays = min(code, TPU_OVERLAY_MIB[0] * 2**20 + TPU_OVERLAY_MIB[1] * code)
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + overlays
               + TPU_TEMP_PACKED * m.temp_size_in_bytes)


def compiled_platform(compiled: Any) -> str:
    """The platform ("cpu", "gpu", "tpu") of the devices a compiled program takes its inputs on."""
    for sharding in jax.tree.leaves(compiled.input_shardings):
        return next(iter(sharding.device_set)).platform
    return jax.devices()[0].platform


def compile_step(built: Built, options: dict | None = None) -> tuple[Any, float, float]:
    """(the compiled train step, seconds to compile, XLA's peak MB per device), at abstract shapes; `options`:
    XLA compiler options for this compile only (bench/profile_step.py --compare-options)."""
    spec = built.spec
    batch = {k: jax.ShapeDtypeStruct((spec.batch_size, spec.seq_len), jnp.int32, sharding=built.batch_sharding)
             for k in ("input_ids", "targets")}
    t0 = time.time()
    step = make_train_step(built.model, built.tx, built.state_sharding, built.batch_sharding, built.base_sharding,
                           spec.seed)
    base = () if built.base_abstract is None else (built.base_abstract,)
    mem = compiled_memory(step, built.abstract, batch, np.float32(0), *base, options=options)
    return mem["compiled"], time.time() - t0, mem["peak"] / MB


def with_dropout(built: Built, rate: float) -> Built:
    """`built` with dropout `rate` (--dropout-from-epoch's later step): the same state, shardings and mesh."""
    model = built.model.clone(dropout=rate)
    return dataclasses.replace(built, spec=dataclasses.replace(built.spec, dropout=rate), model=model)


def load_weights(built: Built, folder: str) -> tuple[Any, str, str]:
    """--init-from's weights, read after the step is planned, straight into the layout the run keeps them in
    (the state's, or the LoRA base's, in --base-dtype): (params, sha256, what they were)."""
    from slm.train.devices import leaf_sharding

    spec = built.spec
    dtype = spec.base_dtype if spec.lora is not None else "float32"
    _, params, fingerprint, what = load_pretrained(folder, dtype, sharding=lambda s: leaf_sharding(s, built.mesh,
                                                                                                    spec.sharding),
                                                   frozen=spec.lora is not None)
    return params, fingerprint, what


def init_state(built: Built, params: Any = None) -> TrainState:
    """The step-0 state, built in place with its final layout (under FSDP no device holds the whole state):
    from a random init, or from `params` (--init-from's weights, host arrays). With LoRA the state holds
    the fresh adapters only; `params` is the base (see place_base)."""
    spec = built.spec
    if params is not None and spec.lora is None:
        # donated: the params move into the state's layout instead of being copied beside it
        return jax.jit(lambda p: fresh_state(p, built.tx), out_shardings=built.state_sharding,
                       donate_argnums=0)(params)
    return jax.jit(lambda: fresh_state(trainable_init(built.model, spec), built.tx),
                   out_shardings=built.state_sharding)()


def place_base(built: Built, params: Any) -> Any:
    """LoRA: the pretrained weights as the frozen base, in --base-dtype and the base's layout, one array at a
    time (load_pretrained already read them in that dtype and placed them, a replicated base as one host buffer
    the host devices alias: an array already in place is not copied)."""
    def put(x: Any, sharding: Any) -> Any:
        dtype = held_dtype(x.dtype, x.ndim, built.spec.base_dtype)
        return jax.device_put(x if x.dtype == dtype else x.astype(dtype), sharding)

    return jax.tree.map(put, params, built.base_sharding)


def read_dtype(dtype: str) -> np.dtype:
    """The dtype load_pretrained reads a Hugging Face folder's tensors in, for weights held in `dtype`: itself,
    or bfloat16 for nf4 (what it holds of the rest; the kernels are quantized from it)."""
    return np.dtype(jnp.dtype("bfloat16" if dtype == "nf4" else dtype))


def load_pretrained(folder: str, dtype: str = "float32", weights: bool = True, sharding: Any = None,
                    frozen: bool = False) -> tuple[ModelShape, Any, str | None, str]:
    """(shape, params in `dtype` or None, sha256 of the weights as read, what they were) of a Hugging Face
    folder or of one of this trainer's runs (its newest checkpoint). Each tensor goes to the device as soon as
    it is read and hashed, laid out by `sharding(shape)` (default: the default device): never all of them
    twice on the host, and under FSDP never whole on one device. `frozen`: a LoRA base, which no step donates,
    replicated over host CPU devices as one host buffer they all alias (slm.train.devices.put_frozen)."""
    from slm.io.hf_import import load_hf_folder

    from slm.model.nf4 import quantize_block, quantize_params
    from slm.train.devices import put_frozen

    nf4 = dtype == "nf4"  # each block's kernels quantized as assembled
    target = read_dtype(dtype)
    digest = hashlib.sha256()

    def place(x: np.ndarray) -> Any:
        digest.update(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data)  # bf16 has no buffer format
        x = x.astype(held_dtype(x.dtype, x.ndim, dtype) if nf4 else target, copy=False)
        if sharding is None:
            return jax.device_put(x)
        return (put_frozen if frozen else jax.device_put)(x, sharding(tuple(x.shape)))

    if os.path.isdir(os.path.join(folder, "checkpoints")):  # a run of this trainer
        run = load_run(folder)
        tree = jax.tree.map(np.asarray, run.params) if weights else None
        params = jax.tree.map(place, quantize_params(tree) if nf4 else tree) if weights else None
        shape, what = run.shape, f"step {run.step} of the run"
    else:
        shape, params, _ = load_hf_folder(folder, weights=weights, place=place, dtype=target,
                                          block_transform=quantize_block if nf4 else None)
        what = "safetensors"
    return shape, params, digest.hexdigest() if params is not None else None, what


@dataclass
class LoadedRun:
    """A run's checkpoint on one device: its config.json, shape, float32 params, tokenizer and step."""

    config: dict
    shape: ModelShape
    params: Any
    tokenizer: Any
    special: SpecialIds  # what training packed documents with
    step: int
    lora: LoraSpec | None = None  # a LoRA run's adapters' spec (None: full training)
    adapters: Any = None  # with load_run(..., fold_lora=False): the LoRA run's adapters, unfolded (params is None)


def load_run(run_dir: str, step: int | None = None, fold_lora: bool = True, held_base: bool = False) -> LoadedRun:
    """A finished or running run's newest (or given) checkpoint, for sampling and export.

    A LoRA run's params are its base with the adapters folded in; with `fold_lora=False` the base is not read
    at all: `adapters` holds the adapters as trained (`lora` their spec) and `params` is None (PEFT export).
    With `held_base` the params are the base as training held it (its --base-dtype, NF4 codes included) beside
    the unfolded adapters: what a Transformer with the run's `lora` (and nf4) applies, with no float32 copy.
    Every failure (missing file, unknown --step, a corrupt or foreign checkpoint) is a RunError with a
    one-line message.
    """
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if step is not None and os.path.isdir(ckpt_dir):
        steps = sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())
        if step not in steps:
            raise RunError(f"--step {step}: no such checkpoint in {ckpt_dir} (have: "
                           f"{', '.join(map(str, steps)) or 'none'})")
    for name in ("config.json", "tokenizer.json", "checkpoints"):
        if not os.path.exists(os.path.join(run_dir, name)):
            raise RunError(f"{run_dir}: no {name}; pass a run's output dir (the one with config.json)")
    try:
        tokenizer = load_tokenizer(os.path.join(run_dir, "tokenizer.json"))
    except TokenizerError as e:
        raise RunError(str(e)) from None
    special = special_ids(tokenizer, os.path.join(run_dir, "tokenizer.json"))
    try:
        return _restore(run_dir, step, tokenizer, special, fold_lora, held_base)
    except RunError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign checkpoint: say which and why, in one line
        raise RunError(f"--run {run_dir}: could not load the checkpoint ({type(e).__name__}: "
                       f"{first_line(e)})") from None


def _restore(run_dir: str, step: int | None, tokenizer: Any, special: SpecialIds, fold_lora: bool = True,
             held_base: bool = False) -> LoadedRun:
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    shape = ModelShape(**config["model"])
    optimizer, muon_lr_ratio = optimizer_of(config)
    spec = StepSpec(shape, 8, 1, config["gradient_accumulation_steps"], use_8bit=config.get("use_8bit_optimizer", False),
                    weight_decay=config["weight_decay"], grad_clip=config["grad_clip"], lora=lora_spec(config),
                    optimizer=optimizer, muon_lr_ratio=muon_lr_ratio, loss_chunk=config.get("loss_chunk", 0),
                    dropout=config.get("dropout", 0.0))
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # whatever mesh saved it
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device),
                            model_and_optimizer(spec)[2])
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=None)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise RunError(f"{run_dir}/checkpoints: no complete checkpoint yet")
        state, meta, _ = ckpt.restore(abstract, step)
    finally:
        ckpt.close()
    if spec.lora is not None and not fold_lora:
        return LoadedRun(config, shape, None, tokenizer, special, int(meta["step"]), spec.lora, state.params)
    params = state.params if spec.lora is None else _with_base(run_dir, config, state.params, spec.lora, not held_base)
    return LoadedRun(config, shape, params, tokenizer, special, int(meta["step"]), spec.lora)


def _with_base(run_dir: str, config: dict, adapters: Any, lora: LoraSpec, folded: bool = True) -> Any:
    """A LoRA run's model: its --init-from base (the same weights: sha256 checked) with the adapters folded in,
    or (not `folded`) beside the base as held."""
    from slm.io.hf_import import resolve_pretrained
    from slm.model.lora import fold, merge

    folder, _ = resolve_pretrained(config["init_from"], config.get("init_revision"), lambda *_: None)
    base_dtype = config.get("base_dtype", "float32")
    shape, base, fingerprint, _ = load_pretrained(folder, base_dtype)  # as hashed in training
    if config.get("base_fingerprint") and fingerprint != config["base_fingerprint"]:
        raise RunError(f"{run_dir}: its base {config['init_from']} has changed since training (sha256 "
                       f"{fingerprint[:12]}..., trained on {config['base_fingerprint'][:12]}...)")
    if not folded:
        return merge(base, adapters)
    if base_dtype == "nf4":  # the weights the adapters trained against: NF4's levels times each block's absmax
        from slm.model.nf4 import dequantize_params

        base = dequantize_params(base, shape)
    return fold(merge(base, adapters), shape, lora)
