"""Muon for the hidden matrices, AdamW for the rest (embedding, untied head, norm scales, biases).

Muon (Jordan et al. 2024; optax.contrib.scale_by_muon) replaces each hidden matrix's momentum by its
nearest semi-orthogonal matrix (5 Newton-Schulz iterations), so every direction of the matrix moves at the
same rate. On this trainer's 800K-parameter tinyshakespeare model at a fixed time budget it lowered held-out
bits/byte by 2.8-3.5% against AdamW on every seed (bench/levers.py, docs/performance.md).

The hidden matrices are the attention's fused q/k/v and output kernels and the MLP's fused gate/up and down
kernels of every block. A fused kernel is orthogonalised as the separate matrices it holds: qkv (D, 3D) is
viewed as (D, 3, D) and gate_up (D, 2F) as (D, 2, F), the middle axis a batch of matrices (with grouped-query
attention, q and k/v differ in width and qkv is taken whole). Embedding, head, norms and biases are not
matrices acting on hidden states, and Muon is not meant for them: they get the trainer's AdamW.

Like the AdamW chain, the output is a direction without the learning rate: the train step multiplies it by
the scheduled rate. The Muon branch is scaled by `lr_ratio` = Muon's peak rate / AdamW's, so both branches
follow one schedule, each from its own peak.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from optax import contrib

# Kernels of the hidden matrices, by module name, and how many matrices each fused kernel holds side by side.
HIDDEN = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}


def hidden_kernel(path: tuple) -> str | None:
    """The module name when `path` is a hidden matrix's kernel ('qkv', 'o', 'gate_up', 'down'), else None."""
    keys = [getattr(k, "key", None) for k in path]
    return keys[-2] if len(keys) >= 2 and keys[-1] == "kernel" and keys[-2] in HIDDEN else None


def labels(params: Any) -> Any:
    """'muon' for the hidden matrices, 'adamw' for every other leaf."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "muon" if hidden_kernel(path) else "adamw", params)


def _parts(path: tuple, x: Any) -> int:
    """How many matrices a fused kernel is viewed as (1 when they differ in width)."""
    name = hidden_kernel(path)
    k = HIDDEN.get(name, 1) if name else 1
    return k if k > 1 and x.shape[-1] % k == 0 and (name != "qkv" or x.shape[-1] == 3 * x.shape[0]) else 1


def split_view(tree: Any) -> Any:
    """Fused kernels as stacks of matrices: qkv (D, 3D) -> (D, 3, D), gate_up (D, 2F) -> (D, 2, F)."""
    def view(path, x):
        k = _parts(path, x)
        return x.reshape(x.shape[0], k, -1) if k > 1 else x
    return jax.tree_util.tree_map_with_path(view, tree)


def _with_split_view(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` sees (and keeps its state in) the split view; its updates come back in the parameters' shapes."""
    def init(params):
        return inner.init(split_view(params))

    def update(updates, state, params=None):
        out, state = inner.update(split_view(updates), state, None if params is None else split_view(params))
        return jax.tree.map(lambda u, ref: u.reshape(ref.shape), out, updates), state

    return optax.GradientTransformation(init, update)


def muon_direction(lr_ratio: float, weight_decay: float, mu_dtype: Any = None,
                   beta: float = 0.95, ns_steps: int = 5) -> optax.GradientTransformation:
    """Muon's update for hidden matrices (each leaf a matrix, or a (D, k, F) stack of k), decoupled weight
    decay, times `lr_ratio`: optax.contrib.muon with every leaf it is given labelled a Muon matrix. Its
    orthogonalised momentum is scaled by sqrt(max(1, fan_out / fan_in)) (optax's width scaling) so the rate
    carries across widths; its sign is flipped back to a direction (the train step subtracts lr * it)."""
    def dims(tree):
        return jax.tree.map(lambda x: contrib.MuonDimensionNumbers(0, x.ndim - 1), tree)

    muon = contrib.muon(learning_rate=lr_ratio, ns_steps=ns_steps, beta=beta, weight_decay=weight_decay,
                        mu_dtype=mu_dtype, nesterov=True, muon_weight_dimension_numbers=dims)
    return optax.chain(muon, optax.scale(-1.0))


def partition_muon(adamw: optax.GradientTransformation, lr_ratio: float, weight_decay: float,
                   mu_dtype: Any = None) -> optax.GradientTransformation:
    """Muon on the hidden matrices, `adamw` (a direction without learning rate) on the rest."""
    inner = optax.partition({"muon": muon_direction(lr_ratio, weight_decay, mu_dtype), "adamw": adamw}, labels)
    return _with_split_view(inner)
