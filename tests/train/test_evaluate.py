"""The eval sample on a CPU run over several host devices decodes on one of them, from the params already there."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from slm.model.generate import generate_ids
from slm.model.sizing import ModelShape
from slm.model.transformer import Transformer, init_params
from slm.train.evaluate import one_cpu_device

mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
model = Transformer(ModelShape(vocab_size=64, n_layers=1, d_model=32, n_heads=2, d_ff=64))
host = jax.tree.map(np.asarray, init_params(model, 0, 8))
replicated = jax.device_put(host, NamedSharding(mesh, P()))
one = one_cpu_device(replicated)
for r, o in zip(jax.tree.leaves(replicated), jax.tree.leaves(one)):
    assert len(o.sharding.device_set) == 1 and o.unsafe_buffer_pointer() in [s.data.unsafe_buffer_pointer() for s in r.addressable_shards]
split = jax.device_put(host["embed"], NamedSharding(mesh, P("data")))
assert one_cpu_device({"embed": split})["embed"] is split  # split over the devices (FSDP): left as it is
args = dict(temperature=0.8, top_k=8, key=jax.random.PRNGKey(3))
a = generate_ids(model, one, [1, 2], 6, **args)
b = generate_ids(model, jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), host), [1, 2], 6, **args)
assert np.array_equal(np.asarray(a), np.asarray(b)), (a, b)
print("ok")
"""


def test_replicated_params_decode_on_one_device_without_a_copy():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
