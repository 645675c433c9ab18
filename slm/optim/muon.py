"""Muon for the hidden matrices, AdamW for the rest (embedding, untied head, norm scales, biases).

Muon (Jordan et al. 2024; optax.contrib.scale_by_muon) replaces each hidden matrix's momentum by its
nearest semi-orthogonal matrix (5 Newton-Schulz iterations), so every direction of the matrix moves at the
same rate. On this trainer's 800K-parameter tinyshakespeare model at a fixed time budget it lowered held-out
bits/byte by 2.8-3.5% against AdamW on every seed (bench/levers.py@1a39af2, docs/performance.md).

The hidden matrices are the attention's fused q/k/v and output kernels and the MLP's fused gate/up and down
kernels of every block. A fused kernel is orthogonalised as the separate matrices it holds: qkv (D, 3D) is
viewed as (D, 3, D) and gate_up (D, 2F) as (D, 2, F), the middle axis a batch of matrices (with grouped-query
attention, q and k/v differ in width and qkv is taken whole). Embedding, head, norms and biases are not
matrices acting on hidden states, and Muon is not meant for them: they get the trainer's AdamW.

Like the AdamW chain, the output is a direction without the learning rate: the train step multiplies it by
the scheduled rate. The Muon branch is scaled by `lr_ratio` = Muon's peak rate / AdamW's, so both branches
follow one schedule, each from its own peak.

Split over devices (`shard_over`, a data-parallel mesh of more than one device): every device holds the whole
state and, with optax's Muon, would run every matrix's Newton-Schulz iterations itself, the same work on each
(a quarter of the step at the quality race's setting on 2 host devices). `scale_by_grouped_muon` instead stacks
the matrices of one shape, shards the stack over the devices, so each orthogonalises its share, and gathers
the results: the same numbers as optax's Muon, in the same state layout (checkpoints of either resume with the
other), for less compute per device.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from optax import contrib

# optax.contrib.muon's defaults: the quintic Newton-Schulz coefficients and the epsilon of the norm and Adam.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
EPS = 1e-8

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


def _newton_schulz(x_NxRxO: jax.Array, coeffs: jax.Array, steps: int) -> jax.Array:
    """optax's orthogonalisation of each of N matrices: Frobenius-normalised, `steps` quintic iterations,
    on the transpose when a matrix is taller than wide."""
    tall = x_NxRxO.shape[1] > x_NxRxO.shape[2]
    x = jnp.swapaxes(x_NxRxO, 1, 2) if tall else x_NxRxO
    x = x / (jnp.linalg.norm(x, axis=(1, 2), keepdims=True) + EPS)
    c = coeffs.astype(x.dtype)
    for _ in range(steps):
        a = x @ jnp.swapaxes(x, 1, 2)
        x = c[0] * x + (c[1] * a + c[2] * a @ a) @ x
    return jnp.swapaxes(x, 1, 2) if tall else x


def orthogonalize_grouped(tree: Any, coeffs: jax.Array, steps: int, mesh: Any) -> Any:
    """Each leaf ((R, O) or a (R, k, O) stack of k matrices) orthogonalised, the matrices of one shape stacked
    and their stack split over `mesh`'s devices (padded with zero matrices to a multiple of its size)."""
    leaves, treedef = jax.tree.flatten(tree)
    stacks = [x[None] if x.ndim == 2 else jnp.swapaxes(x, 0, 1) for x in leaves]  # (k, R, O)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, st in enumerate(stacks):
        groups[st.shape[1:]].append(i)
    padded = []
    for shape, members in groups.items():
        stack = jnp.concatenate([stacks[i] for i in members])
        padded.append(jnp.concatenate([stack, jnp.zeros(((-stack.shape[0]) % mesh.size, *shape), stack.dtype)]))
    out: list[Any] = [None] * len(leaves)
    for members, done in zip(groups.values(), shared_newton_schulz(padded, coeffs, steps, mesh)):
        start = 0
        for i in members:
            k = stacks[i].shape[0]
            part = done[start:start + k]
            out[i] = part[0] if leaves[i].ndim == 2 else jnp.swapaxes(part, 0, 1)
            start += k
    return jax.tree.unflatten(treedef, out)


def shared_newton_schulz(stacks: list, coeffs: jax.Array, steps: int, mesh: Any) -> list:
    """`_newton_schulz` of each (n, R, O) stack (n a multiple of the mesh's size), replicated in and out:
    device d orthogonalises rows d*n/size to (d+1)*n/size of every stack, and one all-gather of all its
    results brings every device all of them.

    Why shard_map on replicated inputs rather than sharding constraints on the stacks: with the constraints,
    XLA's partitioner spread the split into the update around them (9 all-gathers, 15 all-to-alls and 3
    all-reduces more in one step, some inside apply_if_finite's conditional), and on host CPU devices the
    two devices then sometimes waited in different collectives of one step until XLA's 40 s rendezvous
    timeout aborted the process (4 of 12 runs of tests/train/test_resume.py beside two others). Here the
    step has exactly one collective more than with AdamW, after the gradient all-reduce in data order."""
    axes, size = tuple(mesh.axis_names), mesh.size

    def local(coeffs: jax.Array, *stacks: jax.Array) -> jax.Array:
        d = jax.lax.axis_index(axes)
        mine = [_newton_schulz(jax.lax.dynamic_slice_in_dim(st, d * (st.shape[0] // size), st.shape[0] // size),
                               coeffs, steps).reshape(-1) for st in stacks]
        return jax.lax.all_gather(jnp.concatenate(mine), axes)  # (size, this device's results)

    every = jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
                          check_vma=False)(coeffs, *stacks)
    out, start = [], 0
    for st in stacks:
        n = st.size // size  # one device's share, flattened; device-major order is row order
        out.append(every[:, start:start + n].reshape(st.shape).astype(st.dtype))
        start += n
    return out


def scale_by_grouped_muon(mesh: Any, beta: float = 0.95, ns_steps: int = 5,
                          mu_dtype: Any = None) -> optax.GradientTransformation:
    """optax.contrib.scale_by_muon (Nesterov momentum, frobenius preconditioning, its state: MuonState) for
    leaves of the split view, with the orthogonalisation shared out over `mesh` (orthogonalize_grouped)."""
    def init(params):
        return contrib.MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params, dtype=mu_dtype),
                                 ns_coeffs=jnp.asarray(NS_COEFFS))

    def update(updates, state, params=None):
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                              optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                              optax.tree.bias_correction(updates, beta, count))
        out = orthogonalize_grouped(mu_hat, state.ns_coeffs, ns_steps, mesh)
        return out, contrib.MuonState(count=count, mu=optax.tree.cast(mu, mu_dtype), ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(init, update)


def _dims(tree: Any) -> Any:
    return jax.tree.map(lambda x: contrib.MuonDimensionNumbers(0, x.ndim - 1), tree)


def scale_by_width() -> optax.GradientTransformation:
    """optax.contrib.muon's width scaling, sqrt(max(1, fan_out / fan_in)) (fan_in: the first axis, fan_out the
    last), as the same stateless transformation (not exported by optax.contrib)."""
    return optax.stateless(lambda u, _: jax.tree.map(lambda x: x * max(1.0, x.shape[-1] / x.shape[0]) ** 0.5, u))


def grouped_muon(lr_ratio: float, weight_decay: float, mesh: Any, mu_dtype: Any = None,
                 beta: float = 0.95, ns_steps: int = 5) -> optax.GradientTransformation:
    """optax.contrib.muon as `muon_direction` configures it, built from the same parts (so its state has the
    same structure) with `scale_by_grouped_muon` in place of optax's per-matrix Newton-Schulz."""
    branch = optax.chain(scale_by_grouped_muon(mesh, beta, ns_steps, mu_dtype), scale_by_width(),
                         optax.add_decayed_weights(weight_decay, None), optax.scale_by_learning_rate(lr_ratio))
    adam = optax.adamw(lr_ratio, b1=0.9, b2=0.999, eps=EPS, eps_root=0.0, weight_decay=0.0, mu_dtype=mu_dtype,
                       nesterov=True)  # contrib.muon's branch for non-matrices: empty here, kept for the layout
    return optax.partition({"muon": branch, "adam": adam}, lambda p: jax.tree.map(lambda _: "muon", p))


def muon_direction(lr_ratio: float, weight_decay: float, mu_dtype: Any = None,
                   beta: float = 0.95, ns_steps: int = 5, shard_over: Any = None) -> optax.GradientTransformation:
    """Muon's update for hidden matrices (each leaf a matrix, or a (D, k, F) stack of k), decoupled weight
    decay, times `lr_ratio`: optax.contrib.muon with every leaf it is given labelled a Muon matrix. Its
    orthogonalised momentum is scaled by sqrt(max(1, fan_out / fan_in)) (optax's width scaling) so the rate
    carries across widths; its sign is flipped back to a direction (the train step subtracts lr * it).
    With `shard_over` (a mesh of several devices holding the state replicated) the Newton-Schulz work is
    shared out over its devices (grouped_muon)."""
    if shard_over is not None and shard_over.size > 1:
        muon = grouped_muon(lr_ratio, weight_decay, shard_over, mu_dtype, beta, ns_steps)
    else:
        muon = contrib.muon(learning_rate=lr_ratio, ns_steps=ns_steps, beta=beta, weight_decay=weight_decay,
                            mu_dtype=mu_dtype, nesterov=True, muon_weight_dimension_numbers=_dims)
    return optax.chain(muon, optax.scale(-1.0))


def partition_muon(adamw: optax.GradientTransformation, lr_ratio: float, weight_decay: float,
                   mu_dtype: Any = None, shard_over: Any = None) -> optax.GradientTransformation:
    """Muon on the hidden matrices, `adamw` (a direction without learning rate) on the rest; `shard_over`: a
    data-parallel mesh whose devices share the orthogonalisation (muon_direction)."""
    inner = optax.partition({"muon": muon_direction(lr_ratio, weight_decay, mu_dtype, shard_over=shard_over),
                             "adamw": adamw}, labels)
    return _with_split_view(inner)
