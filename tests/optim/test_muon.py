"""slm.optim.muon through make_optimizer: which arrays Muon takes, fused kernels orthogonalised as their parts,
the state's exact size (sizing), and a Muon + WSD run resumed exactly."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slm.model.sizing import ModelShape, choose_shape, optimizer_state_bytes
from slm.model.transformer import Transformer, init_params
from slm.optim.adam8bit import state_bytes
from slm.optim.muon import labels, split_view
from slm.optim.optimizer import make_optimizer

GQA = ModelShape(vocab_size=300, n_layers=2, d_model=64, n_heads=4, d_ff=96, n_kv_heads=2, qkv_bias=True,
                 tie_embeddings=False)


def params_of(shape):
    return init_params(Transformer(shape), 0, 8)


def test_hidden_matrices_go_to_muon_the_rest_to_adamw():
    got = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(labels(params_of(GQA)))}
    muon = sorted(k for k, v in got.items() if v == "muon")
    assert muon == sorted(f"['block_{i}']['{m}']['{n}']['kernel']" for i in range(2)
                          for m, n in (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down")))
    rest = {k for k, v in got.items() if v == "adamw"}
    assert {"['embed']", "['block_0']['attn']['qkv']['bias']", "['block_0']['attn_norm']['scale']"} <= rest
    assert "['unembed']" in rest and len(muon) + len(rest) == len(got)


def test_fused_kernels_are_viewed_as_their_parts_unless_widths_differ():
    own = split_view(params_of(choose_shape(300_000, 512)))["block_0"]
    D = own["attn"]["o"]["kernel"].shape[0]
    assert own["attn"]["qkv"]["kernel"].shape == (D, 3, D)
    assert own["mlp"]["gate_up"]["kernel"].shape[1] == 2 and own["mlp"]["down"]["kernel"].ndim == 2
    gqa = split_view(params_of(GQA))["block_0"]["attn"]["qkv"]["kernel"]
    assert gqa.ndim == 2  # q is 64 wide, k and v 32: taken whole


@pytest.mark.parametrize("shape", [choose_shape(300_000, 512), GQA], ids=["own", "gqa"])
def test_the_memory_terms_count_the_stacks_the_optimizer_builds(shape):
    """slm.model.sizing.muon_stacks (the TPU update term's padding) against the split view's own matrices."""
    from slm.model.sizing import muon_stacks

    view, kinds = split_view(params_of(shape)), labels(params_of(shape))
    stacks: dict = {}
    for x, kind in zip(jax.tree.leaves(view), jax.tree.leaves(kinds)):
        if kind == "muon":
            key = (x.shape[0], x.shape[-1])
            stacks[key] = stacks.get(key, 0) + (x.shape[1] if x.ndim == 3 else 1)
    assert muon_stacks(shape) == stacks


def test_each_part_of_a_fused_kernel_gets_an_orthogonal_update():
    """A q gradient 1000x smaller than k's still moves q as much: Newton-Schulz runs on q, k and v apart."""
    shape = choose_shape(300_000, 512)
    params = params_of(shape)
    D = shape.d_model
    rng = np.random.default_rng(0)
    g = jax.tree.map(jnp.zeros_like, params)
    parts = [rng.normal(size=(D, D)) * s for s in (1e-3, 1.0, 0.1)]
    g["block_0"]["attn"]["qkv"]["kernel"] = jnp.asarray(np.concatenate(parts, axis=1), jnp.float32)
    tx = make_optimizer(weight_decay=0.0, grad_clip=0.0, optimizer="muon", muon_lr_ratio=1.0)
    update, _ = tx.update(g, tx.init(params), params)
    u = np.asarray(update["block_0"]["attn"]["qkv"]["kernel"]).reshape(D, 3, D)
    for i in range(3):
        s = np.linalg.svd(u[:, i, :], compute_uv=False)
        assert 0.6 < np.median(s) < 1.3 and s.max() < 1.3, (i, np.median(s), s.max())  # ~orthogonal, any scale
    emb = np.asarray(update["embed"])
    assert np.all(emb == 0)  # AdamW's branch: a zero gradient moves nothing


@pytest.mark.parametrize("shape", [choose_shape(300_000, 512), GQA], ids=["own", "gqa"])
@pytest.mark.parametrize("use_8bit,accumulation", [(False, 1), (True, 1), (False, 3), (True, 2)])
def test_state_bytes_equal_the_sizing_formula(shape, use_8bit, accumulation):
    params = jax.eval_shape(lambda: params_of(shape))
    tx = make_optimizer(use_8bit=use_8bit, accumulation=accumulation, optimizer="muon", muon_lr_ratio=2.0)
    got = state_bytes(jax.eval_shape(tx.init, params))
    assert got == optimizer_state_bytes(shape, use_8bit, accumulation, optimizer="muon")
    assert got < optimizer_state_bytes(shape, use_8bit, accumulation)  # one momentum instead of two


def test_muon_lr_ratio_scales_only_the_hidden_matrices():
    params = params_of(choose_shape(300_000, 512))
    g = jax.tree.map(lambda x: jnp.full_like(x, 0.01), params)
    u1, _ = (tx := make_optimizer(optimizer="muon", muon_lr_ratio=1.0)).update(g, tx.init(params), params)
    u3, _ = (tx := make_optimizer(optimizer="muon", muon_lr_ratio=3.0)).update(g, tx.init(params), params)
    k1, k3 = u1["block_1"]["mlp"]["down"]["kernel"], u3["block_1"]["mlp"]["down"]["kernel"]
    np.testing.assert_allclose(k3, 3 * k1, rtol=1e-5)
    np.testing.assert_array_equal(u3["embed"], u1["embed"])


@pytest.mark.slow
def test_muon_wsd_run_interrupted_and_resumed_equals_one_run(tmp_path, data_dir, monkeypatch):
    from stop_after import StopAfter
    from train_optimized import Config, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def cfg(out):
        return Config(dataset_id=str(data_dir / "tinyshakespeare.txt"), use_streaming=True, target_params=150_000,
                      seq_len=64, batch_size=8, max_examples=200, shuffle_buffer_size=50, eval_tokens=2048,
                      log_every=1, eval_every=10**6, checkpoint_every=10**6, max_steps=24, seed=1,
                      optimizer="muon", schedule="wsd", warmup_steps=4, use_8bit_optimizer=True, output_dir=str(out))

    quiet = lambda *_: None  # noqa: E731
    whole = train(cfg(tmp_path / "whole"), log=quiet)
    out = tmp_path / "cut"
    train(cfg(out), log=quiet, callbacks=[StopAfter(11)])
    final = train(Config(resume=str(out)), log=quiet)
    assert final["steps"] == 24 and final["data_digest"] == whole["data_digest"]
    def rows(run):
        return {r["step"]: r for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r}

    a, b = rows(tmp_path / "whole"), rows(out)
    assert sorted(a) == sorted(b) == list(range(1, 25))
    assert max(abs(a[k]["loss"] - b[k]["loss"]) for k in a) <= 1e-6
    assert max(abs(a[k]["lr"] - b[k]["lr"]) for k in a) <= 1e-9
    assert a[24]["lr"] < a[22]["lr"] < a[10]["lr"] == pytest.approx(a[5]["lr"])  # stable, then decaying
    assert final["eval_loss"] == pytest.approx(whole["eval_loss"], abs=1e-6) and whole["eval_loss"] < a[1]["loss"] - 1


GROUPED_VS_OPTAX = """
import jax
jax.config.update("jax_num_cpu_devices", 2)
import jax.numpy as jnp, numpy as np, optax
from slm.model.sizing import ModelShape, choose_shape
from slm.model.transformer import Transformer, init_params
from slm.optim.muon import muon_direction, split_view

mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
gqa = ModelShape(vocab_size=300, n_layers=3, d_model=64, n_heads=4, d_ff=96, n_kv_heads=2)
for shape in (choose_shape(300_000, 512), gqa):  # 3 layers: odd stacks, padded; gqa: qkv taken whole
    params = split_view(init_params(Transformer(shape), 0, 8))
    hidden = {k: v for k, v in params.items() if k.startswith("block_")}
    hidden = {b: {m: {n: {"kernel": leaf["kernel"]} for n, leaf in mod.items() if "kernel" in leaf and n in
              ("qkv", "o", "gate_up", "down")} for m, mod in blk.items() if m in ("attn", "mlp")}
              for b, blk in hidden.items()}
    hidden = jax.device_put(hidden, whole)
    for mu_dtype in (None, jnp.bfloat16):
        ref, ours = (muon_direction(2.0, 0.1, mu_dtype, shard_over=m) for m in (None, mesh))
        s_ref, s_ours = ref.init(hidden), ours.init(hidden)
        assert jax.tree.structure(s_ref) == jax.tree.structure(s_ours)  # checkpoints restore either way
        assert [(x.shape, x.dtype) for x in jax.tree.leaves(s_ref)] == [(x.shape, x.dtype) for x in jax.tree.leaves(s_ours)]
        rng = np.random.default_rng(0)
        worst = 0.0
        for _ in range(3):
            g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), hidden)
            u_ref, s_ref = jax.jit(ref.update)(g, s_ref, hidden)
            u_ours, s_ours = jax.jit(ours.update)(g, s_ours, hidden)
            worst = max(worst, max(float(jnp.max(jnp.abs(a - b))) for a, b in
                                   zip(jax.tree.leaves((u_ref, s_ref)), jax.tree.leaves((u_ours, s_ours)))))
        assert worst < 1e-5, (shape, mu_dtype, worst)
print("ok")
"""


def _run_script(script: str) -> str:
    """Run `script` in a fresh interpreter (it sets up its own host devices); its stripped stdout."""
    import subprocess
    import sys

    from helpers import ROOT

    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


@pytest.mark.slow
def test_grouped_newton_schulz_over_two_devices_equals_optax_muon(tmp_path):
    """Sharing the orthogonalisation out over a 2-device mesh gives optax's updates and state, same layout."""
    assert _run_script(GROUPED_VS_OPTAX) == "ok"


STEP_COLLECTIVES = """
import collections, re
from slm.train.devices import configure_cpu_devices
configure_cpu_devices(2)
from slm.model.sizing import choose_shape
from slm.train import builder

spec = builder.StepSpec(choose_shape(300_000, 512), seq_len=32, batch_size=4, optimizer="muon")
compiled = builder.compile_step(builder.build(spec, builder.training_mesh(4, False)))[0]
ops = re.findall(r" (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?[(]",
                 compiled.as_text())
print(sorted(collections.Counter(ops).items()))
"""


def test_the_trainers_muon_step_on_two_host_devices_has_one_gather_after_the_gradient_all_reduce():
    """The shared orthogonalisation adds exactly one collective to the step's two all-reduces (the scored-token
    count, then the gradients), after them in data order. With sharding constraints XLA spread it into 9
    gathers, 15 all-to-alls and 3 more all-reduces, some inside a conditional, and two host devices then
    sometimes waited in different collectives of one step until XLA's rendezvous timeout aborted the process."""
    assert _run_script(STEP_COLLECTIVES).splitlines()[-1] == "[('all-gather', 1), ('all-reduce', 2)]"
