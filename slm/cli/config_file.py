"""--config FILE: every flag from a YAML or JSON file; flags on the command line win.

A run's own config.json can be passed back (``--config runs/x/config.json``) to repeat it: its Config
fields hold the resolved values (learning rate, warmup, stride, vocabulary), so the new run trains
the same model the same way. The keys the trainer adds beside the fields (slm.train.config.RunFacts)
are ignored, and so are the fields a run's config.json does not repeat (policy launch or per_run);
any other unknown key is an error, since a misspelt key silently doing nothing is the classic
config-file bug.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing

from slm.errors import ConfigFileError
from slm.train.config import BEFORE_THE_SETTING, DERIVED_KEYS, LAUNCH, PER_RUN, fields_with

# Fields not applied from a resolved config.json: a new run needs its own output dir and starts fresh;
# the preset's and auto-fit's choices are already in the saved batch size, precision and so on.
NOT_REPRODUCED = fields_with(PER_RUN) + fields_with(LAUNCH)


def load_config_file(path: str, config_cls) -> tuple[dict, list[str]]:
    """(field values to apply, notes to print) from a YAML/JSON file, checked against `config_cls`'s fields.

    Keys may use dashes or underscores. Values are checked against the field types: ints are fine
    for float fields, numeric strings for numeric fields (YAML reads 3e-4 as a string), integral
    floats for int fields; anything else, or a string for a bool, is an error. A file with derived
    keys is a resolved config.json: those keys are ignored, NOT_REPRODUCED fields are left out (a
    note says so), vocab_size is dropped when the run used a --tokenizer file (it comes with it), and a
    setting the file predates takes the value that run had (BEFORE_THE_SETTING, as a resume does).
    """
    data = _read(path)
    kinds = field_kinds(config_cls)
    values: dict = {}
    derived = []
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in DERIVED_KEYS:
            derived.append(name)
            continue
        if name not in kinds:
            close = difflib.get_close_matches(name, list(kinds), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; see --help for the flags"
            raise ConfigFileError(f"--config {path}: unknown key {key!r}{hint}")
        if name in values:
            raise ConfigFileError(f"--config {path}: key {name!r} is given twice (with dashes and with underscores)")
        values[name] = _coerce(path, key, value, *kinds[name])
    notes = []
    if derived:
        dropped = [k for k in NOT_REPRODUCED if values.pop(k, None) not in (None, False)]
        if values.get("tokenizer"):
            values.pop("vocab_size", None)
        older = {k: v for k, v in BEFORE_THE_SETTING.items() if k not in values}  # saved before the setting existed
        values.update(older)
        notes.append(f"[config] {path}: a run's resolved config.json; repeating its settings"
                     + (f", without its {', '.join('--' + k.replace('_', '-') for k in dropped)}" if dropped else "")
                     + f" ({len(derived)} derived keys ignored"
                     + (f"; settings it predates as it ran: {', '.join(f'{k}={v}' for k, v in older.items())}"
                        if older else "") + ")")
    return values, notes


class ListOf:
    """The kind of a `list[...]` setting: its item type (argparse and config files parse the items)."""

    def __init__(self, item: type):
        self.item, self.__name__ = item, f"{item.__name__}_list"

    def __call__(self, text: str) -> list:
        """argparse: "0.7,0.3" -> [0.7, 0.3]."""
        return [self.item(v) for v in text.split(",")]


KINDS = {"int": int, "float": float, "str": str, "bool": bool, "list[str]": ListOf(str), "list[float]": ListOf(float)}


def field_kinds(config_cls) -> dict[str, tuple[tuple[type, ...], bool]]:
    """{field name: (accepted base types, None allowed)}, from annotations that may be strings."""
    out = {}
    for f in dataclasses.fields(config_cls):
        t = f.type
        if isinstance(t, str):
            names = [p.strip() for p in t.split("|")]  # "int | None" under `from __future__ import annotations`
        else:
            args = typing.get_args(t) if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union else (t,)
            names = ["None" if a is type(None) else a.__name__ for a in args]
        base = tuple(KINDS[n] for n in names if n != "None")
        out[f.name] = (base, "None" in names)
    return out


def _coerce(path: str, key, value, base: tuple[type, ...], nullable: bool):
    where = f"--config {path}: key {key!r}"
    listed = next((k for k in base if isinstance(k, ListOf)), None)
    if value is not None and listed is not None:
        if isinstance(value, list):  # a list setting given as a list
            return [_coerce(path, key, v, (listed.item,), False) for v in value]
        if not isinstance(base[0], ListOf):  # str | list[str]: one value is the plain value
            return _coerce(path, key, value, base[:1], nullable)
        return [_coerce(path, key, v.strip(), (listed.item,), False) for v in str(value).split(",")]  # "0.7,0.3"
    kind = base[0]
    if value is None:
        if nullable:
            return None
        wanted = "true or false" if kind is bool else _article(kind)
        raise ConfigFileError(f"{where}: null is not allowed here; give {wanted} or leave the key out")
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigFileError(f"{where}: expected true or false, got {value!r}")
    if isinstance(value, bool):
        hint = " (YAML reads yes/no/on/off as booleans: quote it)" if kind is str else ""
        raise ConfigFileError(f"{where}: expected {_article(kind)}, got the boolean {value!r}{hint}")
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int):
            return str(value)
    else:
        number = _number(value)
        if kind is float and number is not None:
            return float(number)
        if kind is int and isinstance(number, int):
            return number
        if kind is int and isinstance(number, float) and math.isfinite(number) and number == int(number):
            return int(number)
    raise ConfigFileError(f"{where}: expected {_article(kind)}{' or null' if nullable else ''}, got {value!r}")


def _number(value) -> int | float | None:
    """An int or float from a number or a numeric string (YAML reads 3e-4 and 1e6 as strings)."""
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        for parse in (int, float):
            try:
                return parse(value)
            except ValueError:
                pass
    return None


def _article(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a string"}[kind]


def _read(path: str) -> dict:
    """The file's top-level mapping; one-line errors for a missing file, bad syntax (with the line), a non-mapping."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigFileError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigFileError(f"--config {path}: not a UTF-8 text file; give a YAML or JSON file") from None
    if path.lower().endswith(".json"):
        try:
            data = json.loads(text, object_pairs_hook=lambda pairs: _no_duplicates(path, pairs))
        except json.JSONDecodeError as e:
            raise ConfigFileError(f"--config {path}: JSON syntax error at line {e.lineno}, column {e.colno}: {e.msg}") from None
    else:
        import yaml

        try:
            data = yaml.load(text, Loader=_strict_loader())
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            kind = "YAML error" if isinstance(e, yaml.constructor.ConstructorError) else "YAML syntax error"
            raise ConfigFileError(f"--config {path}: {kind}{at}: {e.problem or e.context}") from None
        except yaml.YAMLError as e:
            raise ConfigFileError(f"--config {path}: YAML error: {' '.join(str(e).split())}") from None
    if data is None:  # an empty file (or only comments): nothing to set
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: the top level must be a mapping of flag: value, "
                              f"not {type(data).__name__}")
    return data


def _no_duplicates(path: str, pairs: list) -> dict:
    seen: dict = {}
    for k, v in pairs:
        if k in seen:
            raise ConfigFileError(f"--config {path}: key {k!r} is given twice")
        seen[k] = v
    return seen


def _strict_loader():
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """SafeLoader that refuses a key given twice (PyYAML silently keeps the last)."""

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                            key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return StrictLoader
