"""slm.cli.flags: --help documents every flag with its default; docs/flags.md is generated from Config and
current; the parser returns exactly the flags given."""

import dataclasses

import pytest
from helpers import ROOT

from slm.cli.flags import build_parser, flags_markdown, parse_flags
from slm.errors import ConfigError
from slm.train.config import Config, flag_name, validate


def test_docs_flags_page_is_generated_and_current():
    page = (ROOT / "docs" / "flags.md").read_text()
    assert page == flags_markdown(), "docs/flags.md is stale: run python -m slm.cli.flags > docs/flags.md"
    for f in dataclasses.fields(Config):
        assert f"| `{flag_name(f.name)}` |" in page
    assert "| `--learning-rate` | auto |" in page and "| `--target-params` | 1,000,000 | parameters |" in page


def test_help_documents_every_flag_with_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(Config):
        assert flag_name(f.name) in text
    assert "(default: 1000000)" in text and "--no-use-streaming" in text and "--config FILE" in text


def test_only_given_flags_are_explicit_and_resume_may_be_bare():
    values, explicit, _ = parse_flags(["--use-streaming", "--seq-len", "64", "--resume"])
    assert explicit == {"use_streaming", "seq_len", "resume"}
    assert values["resume"] == "latest" and values["seq_len"] == 64 and values["batch_size"] == 32
    with pytest.raises(ConfigError, match="--seq-len"):
        parse_flags(["--seq-len", "many"])


@pytest.mark.parametrize("flags,message", [(["--dropout", "1"], "--dropout 1.0: must be in"),
                                           (["--loss-chunk", "-5"], "--loss-chunk -5: must be >= 0")])
def test_dropout_and_loss_chunk_out_of_range_are_one_line_errors(flags, message):
    values, _, _ = parse_flags(flags)
    with pytest.raises(ConfigError, match=message):
        validate(Config(**values))


def test_dropout_a_one_epoch_run_never_reaches_is_refused_in_one_line():
    """Issue 41: --dropout starts at --dropout-from-epoch (1), so a one-epoch run (no --max-steps/--max-time)
    trained without it while config.json recorded it. Refused, naming the fix; with the fix it validates."""
    values, _, _ = parse_flags(["--dropout", "0.1", "--dataset-id", "x.txt"])
    with pytest.raises(ConfigError, match=r"^--dropout 0.1: it starts at --dropout-from-epoch 1, which a run of 1 "
                                          r"epoch\(s\) never reaches; add --dropout-from-epoch 0, or --epochs 2$"):
        validate(Config(**values))
    for fix in (["--dropout-from-epoch", "0"], ["--epochs", "2"], ["--max-steps", "100"], ["--max-time", "60"]):
        values, _, _ = parse_flags(["--dropout", "0.1", "--dataset-id", "x.txt", *fix])
        validate(Config(**values))
