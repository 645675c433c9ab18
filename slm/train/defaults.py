"""The settings a user left unset, resolved in one place, each with the reason it was chosen (issue 41, item 9).

A flag the user gave is never changed here. What is resolved depends on facts known only once the data and the
backend are: the learning rate on the model's size, the matmul precision on the CPU, the loss chunk on the
vocabulary. `resolve_defaults` runs once, when they are known (before the step is compiled); the run logs its
choices as one `[defaults]` block and records them in config.json under "defaults". A pretrained start's own
tokenizer (--init-from) is chosen where the folder is read and joins the same block. --auto-fit's settings have
their own block (slm.train.prepare.fit_report), as --preset's have theirs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from slm.model.sizing import (
    ModelShape,
    count_params,
    default_dropout,
    default_learning_rate,
    default_loss_chunk,
    default_optimizer,
)
from slm.train.config import Config


@dataclass(frozen=True)
class Choice:
    """One setting the user did not give: its field, the value chosen and why."""

    key: str
    value: Any
    reason: str

    def line(self) -> str:
        flag = "--" + self.key.replace("_", "-")
        value = f"{self.value:.3g}" if isinstance(self.value, float) else self.value
        return f"[defaults] {flag} {value}: {self.reason}"


def resolve_defaults(c: Config, shape: ModelShape, backend: str, precision: str,
                     stored: str | None = None) -> tuple[Config, list[Choice]]:
    """`c` with every unset (None) default filled in, and the choices made; the user's values are kept as given.
    `backend`: jax's platform; `precision`: slm.model.matmul.default_matmul_precision() there; `stored`: the
    dtype --init-from's weights are stored in (slm.io.hf_import.checkpoint_dtype; None: mixed or unknown)."""
    choices = []

    def choose(key: str, value: Any, reason: str) -> None:
        if getattr(c, key) is None:
            choices.append(Choice(key, value, reason))

    n = count_params(shape)
    lora, pretrained = c.lora_rank is not None, bool(c.init_from)
    choose("learning_rate", default_learning_rate(n), f"sized for {n:,} parameters (6e-4 x sqrt(125M / N), at most 1e-2)")
    choose("optimizer", default_optimizer(lora, pretrained),
           "LoRA's adapters train with AdamW" if lora else
           "a pretrained start: AdamW, so --learning-rate is every trained parameter's rate (docs/pretrained.md)"
           if pretrained else "from scratch: Muon on the hidden matrices (docs/performance.md)")
    choose("dropout", default_dropout(pretrained), "a pretrained model was trained without it" if pretrained else
           f"from scratch, from epoch {c.dropout_from_epoch} (once the data repeats)")
    choose("matmul_precision", precision,
           "this CPU multiplies bfloat16 natively (1.2-1.6x faster steps, the same losses)" if precision == "bfloat16"
           else ("an accelerator: --use-mixed-precision sets its compute dtype" if backend != "cpu"
                 else "this CPU has no native bfloat16 products"))
    chunk = default_loss_chunk(shape.vocab_size, backend, c.matmul_precision or precision)
    choose("loss_chunk", chunk, f"the loss over {chunk}-entry vocabulary chunks at vocabulary {shape.vocab_size:,}"
           if chunk else f"the whole logits at vocabulary {shape.vocab_size:,} (measured the faster here)")
    if lora:
        choose("base_dtype", *base_dtype_choice(stored, c.matmul_precision or precision, c.use_mixed_precision))
    return dataclasses.replace(c, **{ch.key: ch.value for ch in choices}), choices


def base_dtype_choice(stored: str | None, products: str, mixed_precision: bool) -> tuple[str, str]:
    """LoRA's frozen base: bfloat16 where that changes no value and saves memory, i.e. the checkpoint is stored
    in bfloat16 and every product rounds its kernels to bf16 anyway; float32 otherwise. Under float32 products
    XLA:CPU keeps a float32 copy of each bf16 kernel for the backward: a bf16 base would cost more (issue 41)."""
    if stored != "bfloat16":
        return "float32", f"the checkpoint is stored in {stored or 'mixed or unknown dtypes'}; float32 holds it exactly"
    if products == "bfloat16" or mixed_precision:
        return "bfloat16", ("the checkpoint is stored in bfloat16 and the products round the kernels to bf16: the "
                            "same values and losses in half the base's memory")
    return "float32", "float32 products would keep a float32 copy of each bf16 kernel (more memory, not less)"
