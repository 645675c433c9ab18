"""--init-from: the pretrained start's shape and folder (before the data), what reading its weights will hold
on the host (for pre-flight's plan), and the read itself once the step's layout is known. `data` is
slm.train.prepare's TrainData."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from slm.errors import ConfigError
from slm.memory.host import release_free_heap
from slm.model.hf_config import attention_window
from slm.model.sizing import ModelShape, count_params
from slm.train.config import Config

Log = Callable[[str], None]


def pretrained(c: Config, log: Log) -> tuple[ModelShape, str, str | None]:
    """--init-from: (shape, local folder, the commit to pin in --init-revision) of a Hugging Face folder or hub
    id, or of one of this trainer's runs. The weights are read later (load_init_weights), once the step is
    planned and their layout known."""
    from slm.io.hf_import import load_hf_folder, resolve_pretrained

    folder, revision = resolve_pretrained(c.init_from, c.init_revision, log)
    if os.path.isdir(os.path.join(folder, "checkpoints")):  # a run of this trainer
        with open(os.path.join(folder, "config.json")) as f:
            return ModelShape(**json.load(f)["model"]), folder, revision
    shape, _, cfg = load_hf_folder(folder, weights=False)
    window = attention_window(cfg)
    if window is not None and c.seq_len > window:
        raise ConfigError(f"--seq-len {c.seq_len}: {c.init_from} attends within a sliding window of {window} tokens "
                          f"(config.json sliding_window), this trainer over the whole sequence; use --seq-len "
                          f"{window} or less, where the two are the same")
    return shape, folder, revision


def reads_init_weights(c: Config) -> bool:
    """Whether the run reads --init-from's weights: not on --resume of a full fine-tune (the checkpoint has
    them), always for LoRA (the base is not saved)."""
    return bool(c.init_from) and not (c.resume and c.lora_rank is None)


def init_read_mb(c: Config, data: Any) -> tuple[float, float]:
    """(what reading --init-from's weights holds on the host beyond what is placed, the part of it that one
    layer is), MB; (0, 0) when none are read. A Hugging Face folder's from its headers
    (hf_import.read_transient_mb), in the dtype load_weights reads them in (builder.read_dtype). A run of this
    trainer's: its newest checkpoint's size on disk (restored whole, optimizer state included) and its params
    in float32 (a LoRA run's base with the adapters folded in), both on the host before they are placed."""
    if not reads_init_weights(c) or data.init_folder is None:
        return 0.0, 0.0
    ckpts = os.path.join(data.init_folder, "checkpoints")
    if os.path.isdir(ckpts):
        steps = [n for n in os.listdir(ckpts) if n.isdigit()]
        newest = os.path.join(ckpts, max(steps, key=int)) if steps else ckpts
        restored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(newest) for f in fs)
        return (restored + count_params(data.shape) * 4) / 2**20, 0.0
    from slm.io.hf_import import read_transient_mb
    from slm.train.builder import read_dtype

    return read_transient_mb(data.init_folder, read_dtype("float32" if c.lora_rank is None else c.base_dtype))


def load_init_weights(c: Config, data: Any, built: Any, log: Log) -> None:
    """--init-from's weights into data.init_params (and their sha256), laid out as the run keeps them, where
    the run reads them (reads_init_weights)."""
    if not reads_init_weights(c):
        return
    from slm.train.builder import load_weights

    t = time.time()
    data.init_params, data.base_fingerprint, what = load_weights(built, data.init_folder)
    release_free_heap()  # the tensors read and converted on the way: back to the OS, not kept beside the steps
    # the shape's count: an nf4 leaf holds two weights a byte and a scale a block, so leaf sizes undercount
    log(f"[init] {c.init_from}: {count_params(data.shape) / 1e6:.3f}M parameters loaded from {what} in "
        f"{time.time() - t:.1f}s{f' as the frozen {c.base_dtype} base' if c.lora_rank else ''}")
