"""Memory pre-flight: put XLA's figure for the compiled step beside the estimate, predict the run's peaks,
and decide whether the run fits the machine and --memory-budget. Pure Python: the trainer compiles the
step (slm.train.builder.compile_step) and hands the figures in, then runs that same executable, so
pre-flight costs no extra compile.

The prediction is deterministic: the formula's runtime term (Python, JAX, the tokenizer, the eval set and
the compiled programs, measured after the heap's free pages went back to the OS), the data pipeline, on CPU
every local device's compiled step (XLA's figure), the step slack and the checkpoint staging
(slm/memory/estimate.py). The RSS measured after the compile (`base_rss_mb`, taken after a malloc_trim) is
shown beside it but decides nothing unless it is far above the formula (a notebook kernel holding data of
its own): an RSS read moves by 100+ MB between runs, and a decision that hangs on it flips (issue 30: the
same 20M command was refused once and fitted the next time).

With --init-from the prediction is the larger of that and the weights' load: the runtime, the data, what
the read holds beyond what it has placed (slm.io.hf_import.read_transient_mb) and on CPU the weights placed
by then. On a GPU the runtime is the measured RSS (the formula has neither jax's CUDA client nor its
allocator's host table, 1/32 of the pool: slm.train.devices.open_device_pools), read again after the
sampler's pre-flight compile.

The checkpoint staging counts in full when steps run beside an asynchronous save; when saves wait for their
write (`checkpoint_sync`), or the run ends before its first save, only what the save's copy adds over the
step's temporaries counts. `settle_sync` turns waiting saves on when that copy is what does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slm.memory.estimate import MemoryEstimate
from slm.memory.host import rss_mb


@dataclass
class MemoryPlan:
    """What a run will hold, predicted before its first step (MB throughout)."""

    estimate: MemoryEstimate  # the arithmetic's per-device breakdown (estimate_memory_usage)
    compiled_device_mb: float  # XLA's memory analysis of the compiled step, per device
    compile_s: float
    platform: str
    devices: int  # devices in the mesh
    local_devices: int  # of those, on this host
    data_mb: float  # the data pipeline's host memory
    limit_mb: float | None  # what the machine has (host RSS room on CPU, device bytes_limit elsewhere)
    budget_mb: float | None  # --memory-budget (x 0.9 under --auto-fit)
    base_rss_mb: float = field(default_factory=rss_mb)  # this process's RSS when the plan is made (after the compile)
    staging_alone_mb: float = 0.0  # the staging's share when no step runs beside a save
    saves_beside_steps: bool = True  # the run steps after a save (longer than --checkpoint-every, or time-bound)
    checkpoint_sync: bool = False  # saves wait for their write
    load_mb: float = 0.0  # --init-from: what reading the weights holds on the host beyond what it has placed
    load_layer_mb: float = 0.0  # of which one layer, not yet placed while it is assembled

    @property
    def estimated_device_mb(self) -> float:
        return self.estimate["device_total_mb"]

    @property
    def shared_base_mb(self) -> float:
        """On CPU a LoRA base replicated over this host's devices, which all alias one host buffer
        (slm.train.devices.put_frozen): counted once, not once a device."""
        e = self.estimate
        return e.get("base_params_mb", 0.0) if self.platform == "cpu" and "gathered_params_mb" not in e else 0.0

    @property
    def devices_mb(self) -> float:
        """On CPU this host's devices' compiled steps (device memory *is* host memory there); else 0."""
        held = self.local_devices * self.compiled_device_mb - (self.local_devices - 1) * self.shared_base_mb
        return held if self.platform == "cpu" else 0.0

    @property
    def staging_mb(self) -> float:
        """The checkpoint save's host copy of the state, as far as it adds to the peak (module docstring)."""
        beside = self.saves_beside_steps and not self.checkpoint_sync
        return self.estimate["checkpoint_staging_mb"] if beside else self.staging_alone_mb

    @property
    def runtime_mb(self) -> float:
        """The formula's runtime term, or the measured RSS when that is far above it (module docstring)."""
        formula = self.estimate.get("framework_mb", 0.0)
        return self.base_rss_mb if self.base_rss_mb > 1.25 * formula + 100 else formula

    def settle_sync(self, mode: str) -> None:
        """--checkpoint-sync: on, off, or auto (on only when it turns a refusal into a fit)."""
        self.checkpoint_sync = mode == "on"
        if mode == "auto" and self.refusal is not None:
            self.checkpoint_sync = True
            if self.refusal is not None:
                self.checkpoint_sync = False

    @property
    def stepping_rss_mb(self) -> float:
        """The steps' peak RSS: runtime + data pipeline + devices + step slack + checkpoint staging."""
        return self.runtime_mb + self.data_mb + self.devices_mb + self.slack_mb + self.staging_mb

    @property
    def loading_rss_mb(self) -> float:
        """--init-from's peak RSS while its weights are read: runtime + data pipeline + the read's transient,
        and on CPU the weights placed by then (device memory is host memory there: all but the layer being
        assembled); 0 without --init-from."""
        if not self.load_mb:
            return 0.0
        e = self.estimate
        weights = self.local_devices * e.get("base_params_mb", e["params_mb"])
        placed = max(weights - (self.local_devices - 1) * self.shared_base_mb - self.load_layer_mb, 0.0)
        return self.runtime_mb + self.data_mb + self.load_mb + (placed if self.platform == "cpu" else 0.0)

    @property
    def load_is_peak(self) -> bool:
        """On CPU, whether the weights' load and not the steps decides the peak (what a refusal then names)."""
        return self.platform == "cpu" and self.loading_rss_mb > self.stepping_rss_mb

    @property
    def estimated_peak_rss_mb(self) -> float:
        """The whole run's peak RSS: the steps', or the weights' load where that is higher (a GPU run of
        Gemma-3-1B: its embedding read as bf16 beside a 64 MB float32 buffer, 640 MB on the host)."""
        return max(self.stepping_rss_mb, self.loading_rss_mb)

    @property
    def slack_mb(self) -> float:
        return self.estimate["step_slack_mb"]

    @property
    def what(self) -> str:
        return "peak host RSS" if self.platform == "cpu" else "device memory"

    @property
    def predicted_peak_mb(self) -> float:
        return self.estimated_peak_rss_mb if self.platform == "cpu" else self.compiled_device_mb

    @property
    def shortfall(self) -> str | None:
        """What does not fit, without the fix (one clause), or None when the run fits."""
        need, what = self.predicted_peak_mb, self.what
        if self.limit_mb is not None and need > self.limit_mb:
            return (f"this run needs ~{need:,.0f} MB of {what} but the {self.platform} has {self.limit_mb:,.0f} MB "
                    f"available")
        if self.budget_mb is not None and need > self.budget_mb:
            why = ("while its weights load" if self.load_is_peak
                   else f"compiled step {self.compiled_device_mb:,.0f} MB/device x {self.devices}")
            return f"--memory-budget {self.budget_mb:,.0f} MB: this run needs ~{need:,.0f} MB of {what} ({why})"
        return None

    @property
    def refusal(self) -> str | None:
        """Why the run cannot start and the changes that may fix it (one line), or None when it fits."""
        short = self.shortfall
        if short is None:
            return None
        if self.load_is_peak:
            return (f"{short}; the weights' read is the peak: " + ("a lower --base-dtype (bfloat16 or nf4) holds "
                    "less" if "base_params_mb" in self.estimate else "--lora-rank with a bfloat16 or nf4 base holds "
                    "less"))
        if self.limit_mb is not None and self.predicted_peak_mb > self.limit_mb:
            return (f"{short}; try --use-8bit-optimizer, a smaller --batch-size with more "
                    f"--gradient-accumulation-steps, or --memory-budget {self.limit_mb * 0.9 / 1024:.1f}GB --auto-fit")
        return (f"{short}; add --auto-fit, or try --use-8bit-optimizer / a smaller --batch-size with more "
                f"--gradient-accumulation-steps")

    def record(self) -> dict:
        """The predictions kept in config.json and summary.json (every run checks the estimate)."""
        return {"estimated_peak_rss_mb": round(self.estimated_peak_rss_mb, 1),
                "estimated_device_mb": round(self.estimated_device_mb, 1),
                "compiled_device_mb": round(self.compiled_device_mb, 1),
                "base_rss_mb": round(self.base_rss_mb, 1), "checkpoint_sync": self.checkpoint_sync,
                "formula_peak_rss_mb": round(self.estimate["host_rss_mb"], 1),
                "loading_rss_mb": round(self.loading_rss_mb, 1)}

    def describe(self) -> list[str]:
        """The plan as log lines: the breakdown, XLA's figure, the predicted peaks."""
        e = self.estimate
        keys = ("base_params_mb", "base_casts_mb", "params_mb", "gradients_mb", "optimizer_state_mb", "accumulation_mb",
                "activations_mb", "logits_mb", "update_mb", "runtime_mb")  # base_*: a LoRA run's frozen base
        parts = ", ".join(f"{k[:-3].replace('_', ' ')} {e[k]:,.1f}" for k in keys if k in e)
        cpu = self.platform == "cpu"
        saves = ("saves wait for their write" if self.checkpoint_sync else
                 "saves in the background" + ("" if self.saves_beside_steps else ", none before the last step"))
        return [f"[memory] per device (MB, estimate): {parts}; total {e['device_total_mb']:,.1f} "
                f"| XLA's compiled step: {self.compiled_device_mb:,.1f} MB/device x {self.devices} "
                f"(compiled in {self.compile_s:.1f}s)",
                f"[memory] predicted peak host RSS {self.estimated_peak_rss_mb:,.0f} MB (runtime "
                f"{self.runtime_mb:,.0f} (measured now {self.base_rss_mb:,.0f}) + data {self.data_mb:,.1f}"
                + (f" + devices {self.devices_mb:,.0f}" if cpu else "")
                + f" + step {self.slack_mb:,.0f} + checkpoint staging {self.staging_mb:,.0f}: {saves})"
                + (f"; {self.loading_rss_mb:,.0f} MB while the weights load (the read holds {self.load_mb:,.0f} MB "
                   f"beside what it has placed)" if self.load_mb else "")
                + (f"; device memory {self.compiled_device_mb:,.0f} MB" if not cpu else "")
                + (f"; available {self.limit_mb:,.0f} MB" if self.limit_mb else "")]
