"""export_hf: the exported folder loads in transformers (torch CPU) and gives this model's logits and ids.

Needs torch and transformers (CPU wheels, requirements-dev.txt), which export_hf itself does not import.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # noqa: E402
import transformers  # noqa: E402, F401  (the export is checked against it)
from helpers import ROOT

from slm.cli.export import main as export_main
from slm.data.tokenizer import SpecialIds
from slm.io.hf_export import hf_state_dict, write_export
from slm.model.sizing import ModelShape
from slm.model.transformer import Transformer, init_params

TOL = 1e-4  # max abs logit difference (float32 on both sides; observed <= 1.4e-5 here, ~4e-7 for the run)
SHAPE = ModelShape(vocab_size=96, n_layers=2, d_model=64, n_heads=4, d_ff=96)


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _random_params(shape: ModelShape, seed: int = 0):
    """Init params rescaled so nothing is near-trivial: kernels with std 1/sqrt(fan_in) (attention far from
    uniform), an embedding with std 0.5 (logits up to ~20, rounding differences ~1e-5), and RMSNorm
    scales in [0.25, 1.75], each element different, so a swapped, untransposed or misplaced tensor
    moves the logits far past TOL."""
    params = init_params(Transformer(shape), seed, 16)
    rng = np.random.default_rng(seed)

    def rescale(path, x):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return jnp.asarray(1.0 + 0.75 * rng.uniform(-1, 1, x.shape), jnp.float32)
        std = 0.5 if "embed" in name else x.shape[0] ** -0.5
        return jnp.asarray(rng.standard_normal(x.shape) * std, jnp.float32)

    return jax.tree_util.tree_map_with_path(rescale, params)


def _hf_model(out_dir):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(out_dir), attn_implementation="eager",
                                                       output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing/unexpected/mismatched keys
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied on load
    return model.eval()


def _compare_batch(hf_model, model: Transformer, params, prompts: list[list[int]], pad: int) -> float:
    """Max abs difference over the real positions of right-padded prompts of different lengths.

    Right padding keeps every real token at positions 0..n-1 and, under the causal mask, unaffected by
    the pads after it, so both models' real positions are comparable in one batch."""
    L = max(map(len, prompts))
    ids = np.full((len(prompts), L), pad, dtype=np.int64)
    mask = np.zeros((len(prompts), L), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)], mask[i, :len(p)] = p, 1
    ours = np.asarray(model.apply({"params": params}, jnp.asarray(ids, jnp.int32)))
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert ours.shape == theirs.shape
    return max(float(np.abs(ours[i, :len(p)] - theirs[i, :len(p)]).max()) for i, p in enumerate(prompts))


def test_random_model_logits_match_and_a_wrong_mapping_does_not(tmp_path):
    params = _random_params(SHAPE)
    out = tmp_path / "hf"
    write_export(str(out), params, SHAPE, max_positions=64, special=SpecialIds(0, None, "test"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert (config["num_key_value_heads"], config["head_dim"], config["rms_norm_eps"]) == (4, 16, 1e-6)
    hf = _hf_model(out)
    assert hf.config.rope_parameters["rope_theta"] == 10000.0 and hf.config.head_dim == 16

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, SHAPE.vocab_size, n).tolist() for n in (1, 7, 23, 40)]
    model = Transformer(SHAPE)
    assert _compare_batch(hf, model, params, prompts, pad=0) < TOL
    for p in prompts[1:3]:  # one by one, no padding or mask at all
        assert _compare_batch(hf, model, params, [p], pad=0) < TOL

    # The test has teeth: each of these mapping mistakes moves the logits far past TOL.
    good = {k: torch.tensor(v) for k, v in hf_state_dict(params, SHAPE).items()}
    layer = "model.layers.1"
    mistakes = {
        "gate/up swapped": {f"{layer}.mlp.gate_proj.weight": good[f"{layer}.mlp.up_proj.weight"],
                            f"{layer}.mlp.up_proj.weight": good[f"{layer}.mlp.gate_proj.weight"]},
        "q/k swapped": {f"{layer}.self_attn.q_proj.weight": good[f"{layer}.self_attn.k_proj.weight"],
                        f"{layer}.self_attn.k_proj.weight": good[f"{layer}.self_attn.q_proj.weight"]},
        "o not transposed": {f"{layer}.self_attn.o_proj.weight": good[f"{layer}.self_attn.o_proj.weight"].T},
        "norms swapped": {f"{layer}.input_layernorm.weight": good[f"{layer}.post_attention_layernorm.weight"],
                          f"{layer}.post_attention_layernorm.weight": good[f"{layer}.input_layernorm.weight"]},
        "final norm at 1": {"model.norm.weight": torch.ones(SHAPE.d_model)},
    }
    for what, change in mistakes.items():
        hf.load_state_dict({**good, **change}, strict=False)
        assert _compare_batch(hf, model, params, prompts, pad=0) > 1e-2, what
    hf.load_state_dict(good, strict=False)
    assert _compare_batch(hf, model, params, prompts, pad=0) < TOL


@pytest.fixture()
def run_dir(small_run):
    return small_run


def _cli(*args: str) -> subprocess.CompletedProcess:
    # Also checks export_hf never imports torch or transformers (pure numpy + safetensors.numpy).
    code = ("import sys, export_hf; rc = export_hf.main(sys.argv[1:]); "
            "assert not {'torch', 'transformers'} & set(sys.modules), 'export_hf imported torch/transformers'; "
            "sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.xdist_group("small_run")
def test_real_run_exports_and_loads_offline(run_dir, tmp_path):
    from transformers import AutoTokenizer

    from slm.train.builder import load_run

    out = tmp_path / "hf"
    proc = _cli("--run", str(run_dir), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors", "generation_config.json",
                                              "tokenizer.json", "tokenizer_config.json"])
    assert (out / "tokenizer.json").read_bytes() == (run_dir / "tokenizer.json").read_bytes()
    loaded = load_run(str(run_dir))
    shape, ours_tok = loaded.shape, loaded.tokenizer
    eot = ours_tok.token_to_id("<|endoftext|>")
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == shape.vocab_size and config["max_position_embeddings"] == 64
    assert config["bos_token_id"] == config["eos_token_id"] == eot

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token == tok.bos_token == "<|endoftext|>" and tok.eos_token_id == eot
    texts = ["First Citizen:\nBefore we proceed any further, hear me speak.", "", "  héllo wörld 😀\n\n\tx",
             "ROMEO: O, she doth teach the torches to burn bright!<|endoftext|>JULIET: ay me"]
    for text in texts:
        ids = ours_tok.encode(text, add_special_tokens=False).ids
        assert tok(text)["input_ids"] == ids, text
        assert tok.decode(ids) == ours_tok.decode(ids, skip_special_tokens=False)

    hf = _hf_model(out)
    prompts = [[eot] + ours_tok.encode(t, add_special_tokens=False).ids for t in texts]
    assert len({len(p) for p in prompts}) == len(prompts)
    assert _compare_batch(hf, Transformer(shape), loaded.params, prompts, pad=eot) < TOL

    generated = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, len(prompts[0]) + 4)  # generation_config.json is usable

    again = _cli("--run", str(run_dir), "--out", str(out), "--force", "--step", "4")
    assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.xdist_group("small_run")
def test_bad_input_is_one_line_exit_2(run_dir, tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "something").write_text("x")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    not_a_run = tmp_path / "not-a-run"
    not_a_run.mkdir()
    cases = [
        (["--run", str(tmp_path / "missing"), "--out", str(tmp_path / "o1")], "no such directory"),
        (["--run", str(run_dir), "--out", str(full)], "not empty"),
        (["--run", str(run_dir), "--out", str(a_file)], "not a directory"),
        (["--run", str(not_a_run), "--out", str(tmp_path / "o2")], "no config.json"),
        (["--run", str(run_dir), "--out", str(tmp_path / "o3"), "--step", "99"], "no such checkpoint"),
        (["--out", str(tmp_path / "o4")], "--run"),
    ]
    proc = _cli(*cases[0][0])  # one in a real process: exit code 2, one line, no traceback
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-2000:]
    for args, needle in cases:  # the rest in this process, through the same main()
        code = export_main(args)
        err = capsys.readouterr().err.strip()
        assert code == 2, (args, err)
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and needle in err, (args, err)
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
    assert os.listdir(full) == ["something"]
