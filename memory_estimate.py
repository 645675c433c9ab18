"""Whole-run memory arithmetic: what a training run will hold, per device and in host RSS. Pure Python.

Per device (bytes; N = parameters, Bd = micro-batch per device, S = seq len, L/D/F/H/V = layers, width,
MLP width, heads, vocab; see model_sizing.py):

    params        4N                      float32 master weights (also under mixed precision)
    gradients     4N                      float32, a temporary of the step
    optimizer     8N  float32 AdamW m, v  | ~2.03N with 8-bit state (model_sizing.optimizer_state_bytes)
    accumulation  4N  when accumulating   optax.MultiSteps' float32 gradient sum
    activations   Bd*S*L*(a*D + b*F + c*H*S)   what the backward pass keeps, incl. attention scores
    logits        Bd*S*V*e                     logits, softmax and their gradient
    device total  the sum: the compiled step's peak (arguments + outputs + temporaries - donated)

With FSDP over n devices (`fsdp=True`) params, optimizer state and accumulation are divided by n, and
`gathered` (4N) is added: XLA:CPU all-gathers the full weights for the step, and the gradients stay
full-size before their reduce-scatter (bench/sharding.py: 10M params on 8 devices, 237 MB/device
compiled vs 259 predicted, +9%; DP 300 vs 321, +7%).

The coefficients a, b, c, e (bytes) are fitted to XLA's memory analysis of this trainer's compiled step
(jax 0.10.2, XLA:CPU; one device: 48 configurations, 4 shapes x 3 batch/seq x remat x bf16, worst error
3.7%; two devices (the step partitioned over a mesh): 64 configurations, worst error 4.1%):
XLA's CPU scheduler keeps most activations live even with remat, so gradient checkpointing saves only
5-12% on CPU. Other backends and versions differ; the trainer's pre-flight compiles the real step and
reads XLA's own figure, and bench/memory_accuracy.py measures these formulas against it.

Host RSS = framework (the Python + JAX/XLA runtime, compiled programs; measured) + data pipeline
(streaming_data_loader.estimate_memory_usage) + on CPU, every host device's total (device memory *is*
host memory there; parameters and state are replicated on each).
"""

from __future__ import annotations

from dataclasses import dataclass

from model_sizing import ModelShape, count_params, optimizer_state_bytes

MB = 1 << 20


@dataclass(frozen=True)
class ActivationCoefficients:
    """Bytes per token per layer per unit of D, F and H*S, and per token per vocab entry."""

    a: float
    b: float
    c: float
    e: float


# Fitted on XLA:CPU (jax 0.10.2) by relative least squares; keys: (remat, mixed_precision, partitioned).
# A step partitioned over several devices keeps fewer attention bytes per token than a one-device step.
COEFFICIENTS = {
    (False, False, False): ActivationCoefficients(3.29, 29.04, 12.47, 11.45),
    (False, True, False): ActivationCoefficients(35.12, 14.68, 12.03, 8.40),
    (True, False, False): ActivationCoefficients(1.98, 25.50, 12.47, 11.48),
    (True, True, False): ActivationCoefficients(41.79, 13.19, 11.75, 7.50),
    (False, False, True): ActivationCoefficients(11.94, 26.03, 8.29, 12.45),
    (False, True, True): ActivationCoefficients(39.16, 12.77, 7.84, 9.96),
    (True, False, True): ActivationCoefficients(10.94, 22.37, 8.29, 12.49),
    (True, True, True): ActivationCoefficients(49.57, 10.24, 7.60, 8.52),
}
FRAMEWORK_MB = 560.0  # RSS of the trainer's process before its first step's buffers (measured here)


def device_breakdown(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    *,
    mixed_precision: bool = False,
    gradient_checkpointing: bool = False,
    use_8bit_optimizer: bool = False,
    gradient_accumulation_steps: int = 1,
    devices: int = 1,
    fsdp: bool = False,
) -> dict[str, int]:
    """Bytes per device for one replica of the train step (micro_batch = sequences on this device)."""
    n = count_params(shape)
    k = COEFFICIENTS[(bool(gradient_checkpointing), bool(mixed_precision), devices > 1)]
    L, D, F, H, V = shape.n_layers, shape.d_model, shape.d_ff, shape.n_heads, shape.vocab_size
    tokens = micro_batch * seq_len
    accumulation = 4 * n + 8 if gradient_accumulation_steps > 1 else 0
    out = {
        "params": 4 * n,
        "gradients": 4 * n,
        "optimizer_state": optimizer_state_bytes(shape, use_8bit_optimizer, gradient_accumulation_steps) - accumulation,
        "accumulation": accumulation,
        "activations": int(tokens * L * (k.a * D + k.b * F + k.c * H * seq_len)),
        "logits": int(tokens * V * k.e),
    }
    if fsdp and devices > 1:
        for key in ("params", "optimizer_state", "accumulation"):
            out[key] //= devices
        out["gathered_params"] = 4 * n
    out["total"] = sum(out.values())
    return out


class MemoryEstimate(dict):
    """A dict of figures (MB unless the key says otherwise) that prints as a table in a terminal or notebook."""

    def rows(self) -> list[tuple[str, str]]:
        return [(k, f"{v:,.1f}" if isinstance(v, float) else str(v)) for k, v in self.items()]

    def __repr__(self) -> str:
        width = max(len(k) for k in self)
        return "\n".join(f"{k:<{width}}  {v:>12}" for k, v in self.rows())

    def _repr_html_(self) -> str:
        body = "".join(f"<tr><td>{k}</td><td style='text-align:right'>{v}</td></tr>" for k, v in self.rows())
        return f"<table><tr><th>item</th><th>value</th></tr>{body}</table>"


def host_rss_mb(device_total_bytes: int, devices: int, platform: str, data_mb: float) -> float:
    """Predicted peak RSS: framework + data pipeline + (on CPU) every host device's buffers."""
    on_host = devices * device_total_bytes / MB if platform == "cpu" else 0.0
    return FRAMEWORK_MB + data_mb + on_host


def fit_candidates(
    shape: ModelShape,
    seq_len: int,
    batch_size: int,
    accumulation: int,
    budget_bytes: int,
    *,
    max_devices: int,
    platform: str,
    data_mb: float,
    margin: float = 0.10,
    user: tuple[bool, bool, bool] = (False, False, False),
) -> list[dict]:
    """Settings that keep the effective batch (batch_size x accumulation sequences) and fit the budget.

    Each candidate: micro-batch (a divisor of the effective batch), the
    matching accumulation, 8-bit optimizer state, mixed precision, gradient checkpointing, on as many of
    `max_devices` as divide the micro-batch (as devices.data_mesh does); the user's own setting first
    when it fits, then the rest ordered by an estimated speed cost (halving the micro-batch ~10%, remat ~30%, bf16 on CPU ~30% (it is emulated) but
    a gain on accelerators, 8-bit state ~1%) and kept only when the predicted peak is within
    (1 - margin) x budget: host RSS on CPU, device memory elsewhere. The trainer compiles the first
    candidates and takes the first one XLA agrees fits.
    """
    import math

    effective = batch_size * accumulation
    out = []
    for micro in sorted({d for d in range(1, effective + 1) if effective % d == 0}, reverse=True):
        devices = max(k for k in range(1, min(max_devices, micro) + 1) if micro % k == 0)
        for eight in (False, True):
            for mixed in (False, True):
                for remat in (False, True):
                    dev = device_breakdown(shape, seq_len, micro // devices, mixed_precision=mixed,
                                           gradient_checkpointing=remat, use_8bit_optimizer=eight,
                                           gradient_accumulation_steps=effective // micro, devices=devices)
                    peak = host_rss_mb(dev["total"], devices, platform, data_mb) * MB if platform == "cpu" else dev["total"]
                    if peak > (1 - margin) * budget_bytes:
                        continue
                    cost = (0.1 * math.log2(effective / micro) + 0.3 * remat + 0.01 * eight
                            + (0.3 if platform == "cpu" else -0.1) * mixed)
                    if micro == batch_size and (eight, mixed, remat) == tuple(user):
                        cost = -1.0  # the user's own setting (user = their 8-bit, bf16, remat flags) when it fits
                    out.append({"batch_size": micro, "gradient_accumulation_steps": effective // micro,
                                "use_8bit_optimizer": eight, "use_mixed_precision": mixed,
                                "gradient_checkpointing": remat, "predicted_peak_mb": peak / MB, "cost": cost})
    return sorted(out, key=lambda c: (c["cost"], c["predicted_peak_mb"]))
