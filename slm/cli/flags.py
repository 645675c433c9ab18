"""The trainer's command line, generated from Config's field declarations (slm.train.config).

Every field is a flag (`--seq-len` for seq_len; booleans also take `--no-...`), plus `--config FILE`.
The parser's defaults are suppressed, so what it returns is exactly the flags given on the command line:
those win over a config file's keys, which win over Config's defaults, and both count as explicit
(so --preset and --resume leave them alone).
"""

from __future__ import annotations

import argparse
import dataclasses

from slm.cli.common import Parser
from slm.cli.config_file import field_kinds, load_config_file
from slm.train.config import Config, flag_name

CONFIG_HELP = ("YAML or JSON file of flag: value (dashes or underscores); flags on the command line win. "
               "A run's config.json repeats that run")


def default_text(f: dataclasses.Field, thousands: bool = False) -> str:
    """A field's default as the docs show it (1,000,000 with `thousands`), "off"/"auto" for unset ones."""
    d = f.default
    if d is None or isinstance(d, bool):
        return "off" if d is False else "on" if d is True else f.metadata["unset"] or "auto"
    return f"{d:,}" if thousands and type(d) is int else str(d)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description="Train a small decoder-only language model on a streamed dataset (JAX/Flax).",
               argument_default=argparse.SUPPRESS)
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    kinds = field_kinds(Config)
    for f in dataclasses.fields(Config):
        meta = f.metadata
        units = f" [{meta['units']}]" if meta["units"] else ""
        help_text = f"{meta['help']}{units} (default: {default_text(f)})".replace("%", "%%")
        kind = kinds[f.name][0][0]
        if kind is bool:
            p.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, help=help_text)
            continue
        extra = {"nargs": "?", "const": meta["optional_value"]} if meta["optional_value"] else {}
        if meta["repeatable"]:  # --dataset-id a --dataset-id b: a list (one given: the plain value)
            extra["action"] = "append"
        p.add_argument(flag_name(f.name), type=kind, metavar=kind.__name__.upper(), help=help_text, **extra)
    return p


def parse_flags(argv: list[str] | None) -> tuple[dict, set[str], list[str]]:
    """(Config keyword arguments, the names set explicitly, notes to print) for `argv`, honouring --config.

    Raises ConfigError for a bad flag and ConfigFileError for a bad file (both one line, exit 2).
    """
    given = vars(build_parser().parse_args(argv))
    repeatable = {f.name for f in dataclasses.fields(Config) if f.metadata["repeatable"]}
    for name in repeatable & given.keys():  # a repeatable flag given once is its plain value
        if len(given[name]) == 1:
            given[name] = given[name][0]
    path = given.pop("config", None)
    from_file, notes = load_config_file(path, Config) if path else ({}, [])
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    return {**defaults, **from_file, **given}, set(from_file) | set(given), notes


def flags_markdown() -> str:
    """docs/flags.md, generated from Config (`python -m slm.cli.flags > docs/flags.md`; a test keeps it current)."""
    from slm.train.config import flag_table

    intro = """# Flags

Every flag of `train_optimized.py` (and `slm-train`), generated from the declarations in
[slm/train/config.py](../slm/train/config.py) by `python -m slm.cli.flags > docs/flags.md`; a test fails when
this page is stale. Booleans also take `--no-FLAG`. In a notebook the same names are `Config` fields
(`Config(seq_len=256)`).

**On --resume / --config**: *kept* settings are the run's identity (data, tokenizer, model, optimizer,
schedule): `--resume` keeps the run's value and refuses a different one, naming it. *May change* settings
(length, logging, cadence, devices) are kept unless given again. *This launch only* settings (jax.distributed)
are never inherited, and *this run only* ones (output dir, resume, preset, auto-fit) are not repeated from a
run's `config.json`. *Repeated*: a `--config` file, or a run's own `config.json`, sets them; flags on the
command line win over the file, the file over the defaults; a key that is not a flag is an error, except
the facts a run records beside its settings (`model`, `params`, `devices`, ...), which are ignored.

`--config FILE` takes YAML or JSON of `flag: value` (dashes or underscores):

```yaml
dataset_id: ../shared/data/tinystories_train.txt
use_streaming: true
target_params: 5000000
seq_len: 256
max_time: 600
```

"""
    return intro + "\n".join(flag_table()) + "\n"


if __name__ == "__main__":
    print(flags_markdown(), end="")
