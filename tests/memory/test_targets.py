"""--plan-for's targets: the names, the devices each names and the memory jax gives a program there (pure Python)."""

import json

import pytest

from slm.errors import ConfigError
from slm.memory.targets import SPECS, known_targets, load_target

ISSUE_NAMES = ("a10g-24gb", "l4-24gb", "rtx4090-24gb", "a100-40gb", "a100-80gb", "h100-80gb", "v5e-1", "v5e-4", "v5e-8",
               "v4-8", "v5p-8", "v6e-8")


def test_every_target_the_issue_names_is_known_and_cites_its_source():
    assert set(ISSUE_NAMES) <= set(known_targets())
    for name in known_targets():
        with open(f"{SPECS}/{name}.json") as f:
            facts = json.load(f)
        assert facts["name"] == name and facts["source"], name


def test_an_unknown_name_is_refused_in_one_line_listing_the_known_ones():
    with pytest.raises(ConfigError) as e:
        load_target("a10-24gb")
    assert "\n" not in str(e.value) and "a10g-24gb" in str(e.value) and "v5e-8" in str(e.value)


@pytest.mark.parametrize("name, platform, count", [("a10g-24gb", "gpu", 1), ("a100-80gbx8", "gpu", 8),
                                                   ("h200-141gb", "gpu", 1), ("v5e-1", "tpu", 1), ("v5e-8", "tpu", 8),
                                                   ("v4-8", "tpu", 4), ("v5p-8", "tpu", 4)])
def test_devices_per_target(name, platform, count):
    # v4-8 and v5p-8 are 4 chips of 2 TensorCores each, one megacore device per chip (Cloud TPU docs)
    t = load_target(name)
    assert (t.platform, t.count) == (platform, count)


def test_a_tpu_slice_takes_no_xn():
    with pytest.raises(ConfigError, match="slice's size is in its name"):
        load_target("v5e-8x2")


def test_usable_memory_is_jax_preallocation_on_a_gpu_and_libtpus_offer_on_a_tpu():
    a10g = load_target("a10g-24gb")
    assert a10g.usable_mb({})[0] == pytest.approx(0.75 * 23028)  # jax's documented default: 75% of the card
    assert a10g.usable_mb({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"})[0] == pytest.approx(0.9 * 23028)
    assert a10g.usable_mb({"XLA_CLIENT_MEM_FRACTION": ".5", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"})[0] == \
        pytest.approx(0.5 * 23028)  # the current name wins over the deprecated one
    # a TPU's: what libtpu's compiler offers a program (tests/train/test_tpu_hbm.py checks it against libtpu), whatever
    # the GPU fraction says
    assert load_target("v5e-4").usable_mb({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"})[0] == 15.75 * 1024
    # NVIDIA's "141 GB" of HBM3e is 141 GiB (XLA's h200.txtpb: 151,397,597,184 bytes)
    assert load_target("h200-141gb").usable_mb({})[0] == pytest.approx(0.75 * 141 * 1024, rel=1e-3)
    with pytest.raises(ConfigError, match="XLA_CLIENT_MEM_FRACTION"):
        a10g.usable_mb({"XLA_CLIENT_MEM_FRACTION": "lots"})
