"""Data parallelism over host CPU devices: same losses as one device; the mesh divides the batch."""

import json
import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from slm.train.devices import configure_cpu_devices, data_mesh, needs_step_sync, shardings
    configure_cpu_devices(2)
    from slm.model.transformer import Transformer, init_params
    from slm.model.sizing import ModelShape
    from slm.optim.optimizer import make_optimizer
    from slm.train.step import init_state, make_train_step

    shape = ModelShape(vocab_size=64, n_layers=2, d_model=32, n_heads=1, d_ff=96)
    model, tx = Transformer(shape), make_optimizer(accumulation=2)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (8, 6, 17)).astype(np.int32)
    out = {{"devices": len(jax.devices())}}
    for k in (1, 2):
        mesh = data_mesh(6, max_devices=k)
        rep, dat = shardings(mesh)
        state = jax.device_put(init_state(init_params(model, 0, 16), tx), rep)
        step, losses = make_train_step(model, tx), []
        for b in ids:
            batch = jax.device_put({{"input_ids": b[:, :-1], "targets": b[:, 1:]}}, dat)
            state, m = step(state, batch, np.float32(1e-2))
            if needs_step_sync(mesh):
                m["loss"].block_until_ready()
            losses.append(float(m["loss"]))
        out[k] = losses
        out[f"mesh{{k}}"] = int(mesh.devices.size)
    out["odd_batch_mesh"] = int(data_mesh(7).devices.size)
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_two_host_devices_match_one_device_loss_curve():
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format()], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 2 and out["mesh1"] == 1 and out["mesh2"] == 2
    assert out["odd_batch_mesh"] == 1  # 7 sequences cannot be split over 2 devices: fall back to 1
    for a, b in zip(out["1"], out["2"]):
        assert abs(a - b) < 1e-5, (out["1"], out["2"])
    assert out["2"][-1] < out["2"][0]


STAGING = textwrap.dedent("""
    import json, sys
    import slm.train.devices as d
    d.NVIDIA_FILES = tuple(sys.argv[1:])  # an NVIDIA driver's files, or none
    d.configure_cpu_devices(2, start=False)  # the trainer's first call, before the backend starts
    import jax
    print(json.dumps(jax.config.jax_pjrt_client_create_options))
""")


@pytest.mark.parametrize("nvidia,env,expect", [
    (True, {}, {"should_stage_host_to_device_transfers": False}),
    (True, {"JAX_PJRT_CLIENT_CREATE_OPTIONS": "foo:bar"}, "foo:bar"),  # the user's own options win
    (True, {"JAX_PLATFORMS": "cpu"}, None),  # a CPU run on a GPU machine starts no CUDA client
    (False, {}, None),  # no driver: nothing changes
])
def test_gpu_transfers_skip_the_pinned_staging_pool_only_on_an_nvidia_machine(tmp_path, nvidia, env, expect):
    """On an H100 the staging pool kept every byte the weights' load staged (+1,062 MB of host RSS for a
    971 MB load, 6 MB unstaged): the option must reach jax before its CUDA client starts, and only there."""
    import os

    driver = tmp_path / "nvidiactl"
    driver.write_text("")
    clean = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PJRT_CLIENT_CREATE_OPTIONS")}
    proc = subprocess.run([sys.executable, "-c", STAGING, *([str(driver)] if nvidia else [])], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**clean, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expect


FROZEN = textwrap.dedent("""
    import gc, json
    from slm.train.devices import configure_cpu_devices, data_mesh, put_frozen
    configure_cpu_devices(2)
    import jax, ml_dtypes, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

    mesh = data_mesh(2)
    replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    out = {}
    for name, dtype in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        x = np.random.default_rng(0).standard_normal((64, 257)).astype(dtype)[1:]  # a view at an odd offset
        a = put_frozen(x, replicated)
        ptrs = {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
        y = np.array(x, copy=True)
        del x; gc.collect()  # the source goes: the devices' buffer must not
        same = jax.jit(lambda v: (v.astype(np.float32) * 2).sum(axis=0), out_shardings=replicated)
        out[name] = {"buffers": len(ptrs), "shards": len(a.addressable_shards), "sharding": a.sharding == replicated,
                     "equal": bool(np.array_equal(np.asarray(a), y)),
                     "step_equal": bool(np.array_equal(np.asarray(same(a)), np.asarray(same(jax.device_put(y, replicated)))))}
    s = put_frozen(np.arange(8, dtype=np.float32), split)  # split over the devices: an ordinary placement
    out["split"] = [np.asarray(t.data).tolist() for t in sorted(s.addressable_shards, key=lambda t: t.device.id)]
    big = np.ones(64 * 2**20 // 4, np.float32)  # 64 MiB, touched
    before = rss_mb(); kept = put_frozen(big, replicated); out["frozen_mb"] = rss_mb() - before
    before = rss_mb(); copied = jax.device_put(big, replicated); copied.block_until_ready()
    out["device_put_mb"] = rss_mb() - before
    print(json.dumps(out))
""")


def test_a_frozen_base_replicated_over_host_devices_is_one_host_buffer():
    """put_frozen: both host devices alias one buffer (one pointer, RSS grows by one copy where jax.device_put
    grows by two), whose values and step results equal an ordinary placement's, outliving its source array."""
    proc = subprocess.run([sys.executable, "-c", FROZEN], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("float32", "bfloat16"):
        assert out[name] == {"buffers": 1, "shards": 2, "sharding": True, "equal": True, "step_equal": True}, out
    assert out["split"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert 48 < out["frozen_mb"] < 96 and out["device_put_mb"] > 112, out  # 64 MiB once vs twice
