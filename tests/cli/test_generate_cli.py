"""generate.py (slm.cli.generate) on a real run: streamed greedy text equals the decoder's, samples differ,
multi-byte characters print whole, bad input is one line with exit 2."""

import shutil

import pytest

import slm.cli.generate as generate
from slm.data.tokenizer import TextStream, eot_id
from slm.model.generate import generate_ids
from slm.model.transformer import Transformer
from slm.train.builder import load_run

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("small_run")]  # they read one real run (conftest)


@pytest.fixture()
def tiny_run(small_run):
    return small_run


def test_cli_streams_the_greedy_text_and_reports_speed(tiny_run, capsys):

    prompt, n_new = "ROMEO: wherefore", 72  # 72 new tokens run past the trained --seq-len 64
    code = generate.main(["--run", str(tiny_run), "--prompt", prompt, "--max-new-tokens", str(n_new),
                          "--temperature", "0", "--ignore-eot"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    err_lines = captured.err.strip().splitlines()
    assert err_lines[-1].startswith("[generate] step 4 | prefill ") and "tokens/s" in err_lines[-1]
    assert "ms to first token" in err_lines[-1] and f"decode {n_new - 1} tokens" in err_lines[-1]
    assert any(line.startswith("warning: ") and "--seq-len 64" in line for line in err_lines)
    assert "Traceback" not in captured.err

    run = load_run(str(tiny_run))
    tok = run.tokenizer
    prompt_ids = [eot_id(tok)] + tok.encode(prompt, add_special_tokens=False).ids
    ids = generate_ids(Transformer(run.shape), run.params, prompt_ids, n_new, temperature=0.0)
    assert captured.out == prompt + tok.decode(ids[0].tolist()) + "\n"
    assert len(captured.out) > len(prompt) + 5


def test_cli_num_samples_differ(tiny_run, capsys):
    assert generate.main(["--run", str(tiny_run), "--max-new-tokens", "12", "--temperature", "1.0",
                          "--top-p", "0.95", "--ignore-eot", "--num-samples", "2", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- sample 1/2 ---\n") and "\n--- sample 2/2 ---\n" in out
    first, second = out[len("--- sample 1/2 ---"):].split("--- sample 2/2 ---")
    assert first.strip() and second.strip() and first.strip() != second.strip()


def test_text_stream_prints_multibyte_characters_whole(tiny_run):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_run / "tokenizer.json"))
    text = " héllo wörld — ü ∑ 日本"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.split())  # some characters span several byte tokens
    context = tok.encode("ROMEO:", add_special_tokens=False).ids
    stream = TextStream(tok, context)
    deltas = [stream.push(i) for i in ids]
    assert "".join(deltas) + stream.flush() == text
    assert not any("\ufffd" in d for d in deltas)


def _error_line(capsys, argv):
    code = generate.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_cli_bad_input_is_one_line_exit_2(tiny_run, tmp_path, capsys):
    run = str(tiny_run)
    no_ckpt = tmp_path / "no-checkpoint"
    no_ckpt.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_run / name, no_ckpt / name)
    (no_ckpt / "checkpoints").mkdir()
    cases = [
        (["--run", str(tmp_path / "missing")], "--run"),
        (["--run", str(tmp_path)], "config.json"),
        (["--run", str(no_ckpt)], "no complete checkpoint"),
        (["--run", run, "--step", "3"], "--step 3"),
        (["--run", run, "--top-p", "1.5"], "--top-p"),
        (["--run", run, "--top-p", "0"], "--top-p"),
        (["--run", run, "--temperature", "-0.1"], "--temperature"),
        (["--run", run, "--temperature", "nan"], "--temperature"),
        (["--run", run, "--top-k", "-1"], "--top-k"),
        (["--run", run, "--top-k", "x"], "--top-k"),
        (["--run", run, "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--run", run, "--num-samples", "0"], "--num-samples"),
        (["--prompt", "hi"], "--run"),
    ]
    for argv, needle in cases:
        assert needle in _error_line(capsys, argv), argv
