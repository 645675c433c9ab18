"""The README and docs/ are kept true: their Python blocks run, their links resolve, the README stays short,
and the "Coming from" flag map (docs/config.md) names real flags.

Convention for fenced blocks in README.md and docs/*.md: a block whose info string is ``python`` (or ``py``/``python3``)
is executed; one whose info string carries the extra word ``no-test`` (```` ```python no-test ````) is
shown but not executed, for code that needs something the tests do not install or have (e.g. torch and a
trained run for the transformers snippet; tests/io/test_hf_export.py covers that path). GitHub highlights
both the same way, since it reads only the first word. Blocks of other languages (bash, yaml, plain
output) are never executed.

The executed blocks of one file run in order in one namespace, as a reader pasting them into one notebook
would, in a subprocess whose working directory is the repository root (the README's relative data paths,
``../shared/data/...``, are relative to it) with TMPDIR pointed at pytest's tmp_path so the examples'
``tempfile.mkdtemp()`` run folders are cleaned up, and with the hub offline.
"""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PYTHON_LANGS = {"python", "py", "python3"}
SKIP_WORD = "no-test"
FENCE = re.compile(r"^(`{3,})(.*)$")


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """(info string, code, 1-based line of the opening fence) of every backtick-fenced block, in order.

    As in CommonMark, a block closes at a line of only backticks at least as long as its opening fence.
    """
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        i += 1
        if not m:
            continue
        fence, info, start = m.group(1), m.group(2).strip(), i
        body = []
        while i < len(lines) and not re.fullmatch(r"`{%d,}\s*" % len(fence), lines[i]):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"README.md:{start}: unclosed code fence"
        i += 1  # the closing fence
        blocks.append((info, "\n".join(body) + "\n", start))
    return blocks


def python_blocks(text: str) -> tuple[list[tuple[str, int]], list[int]]:
    """(blocks to execute as (code, line), lines of the python blocks marked no-test)."""
    run, skipped = [], []
    for info, code, line in fenced_blocks(text):
        words = info.split()
        if not words or words[0].lower() not in PYTHON_LANGS:
            continue
        if SKIP_WORD in words[1:]:
            skipped.append(line)
        else:
            run.append((code, line))
    return run, skipped


DRIVER = r"""
import json, sys, traceback
name, blocks = json.load(sys.stdin)
namespace = {"__name__": "__readme__"}
for code, line in blocks:
    try:
        exec(compile(code, f"{name}:{line}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"README BLOCK FAILED at {name}:{line}", flush=True)
        sys.exit(1)
    print(f"README BLOCK OK {line}", flush=True)
"""


def test_fence_parser_and_skip_convention():
    text = ("intro\n```python\nx = 1\n```\n```python no-test\nimport torch\n```\n"
            "```bash\nls\n```\n````python\nprint('```')\n````\n```\nplain\n```\n")
    run, skipped = python_blocks(text)
    assert [code for code, _ in run] == ["x = 1\n", "print('```')\n"]
    assert skipped == [5]


def shown_outputs(code: str) -> list[str]:
    """What a block says its prints show: the comment after each print(...) line, with the comment lines that
    follow it; "..." (elided) and a trailing "(...)" remark after the figures are not part of it."""
    lines, shown = code.splitlines(), []
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("print("):
            continue
        text = [line.split("#", 1)[1]] if "#" in line.split("print(", 1)[1] else []
        j = i + 1
        while j < len(lines) and lines[j].lstrip().startswith("#"):
            text.append(lines[j].lstrip()[1:])
            j += 1
        said = " ".join(text).replace("...", " ").strip()
        said = re.sub(r"(?<=\S)\s+\([^()]*\)\s*$", "", said)  # "3 4.49 (3 steps: barely trained)" -> "3 4.49"
        if said:
            shown.append(said)
    return shown


TOKEN = re.compile(r"[A-Za-z_][A-Za-z_0-9]*|-?\d[\d,]*(?:\.\d+)?%?")
SHOWN_TOLERANCE = 0.05  # figures that move a little between hosts (a loss after 3 steps); a stale one moves more


def _number(token: str) -> float | None:
    try:
        return float(token.replace(",", "").rstrip("%"))
    except ValueError:
        return None


def shows(said: str, printed: str) -> bool:
    """Whether `printed` holds the tokens of `said` in order (numbers within SHOWN_TOLERANCE, words exactly)."""
    out = TOKEN.findall(printed)
    k = 0
    for want in TOKEN.findall(said):
        w = _number(want)
        while k < len(out):
            got = _number(out[k])
            k += 1
            if (w is None and out[k - 1] == want) or (w is not None and got is not None and
                                                    abs(got - w) <= SHOWN_TOLERANCE * max(abs(w), 1e-9)):
                break
        else:
            return False
    return True


def test_shown_outputs_parser():
    code = "x = 1\nprint(x)  # 3 4.49 (3 steps: barely trained)\nprint(t)\n# ... a_mb 19.0, b_mb 38.1,\n#     c 1,818.8\n"
    assert shown_outputs(code) == ["3 4.49", "a_mb 19.0, b_mb 38.1,      c 1,818.8"]
    assert shows("a_mb 19.0, c 1,818.8", "a_mb   19.0\nb_mb 38.1\nc   1,820.0")
    assert not shows("b_mb 38.1", "a_mb 19.0\nb_mb 20.8")  # the stale README figure issue 41 found
    assert shows("(32, 128) int32", "(32, 128) int32") and not shows("88.38%", "80.00%")


def run_blocks(name: str, run: list, tmp_path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TMPDIR": str(tmp_path),
           "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps([name, run]), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    ok = [int(m) for m in re.findall(r"^README BLOCK OK (\d+)$", proc.stdout, re.M)]
    assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-5000:])
    assert ok == [line for _, line in run], proc.stdout[-3000:]
    printed = re.split(r"^README BLOCK OK \d+$", proc.stdout, flags=re.M)  # each block's own output
    for (code, line), out in zip(run, printed):
        for said in shown_outputs(code):  # the outputs the page shows are what the code prints today
            assert shows(said, out), f"{name}:{line} shows {said!r}, but the block printed:\n{out[-2000:]}"
    assert not list(ROOT.glob("runs/notebook*")), f"an example in {name} wrote into the repository"


def test_readme_python_blocks_run_in_order(tmp_path):
    run, skipped = python_blocks(README.read_text())
    assert len(run) >= 5, "expected the Notebook API examples to be executable python blocks"
    joined = "".join(code for code, _ in run)
    for needed in ("StreamingDataLoader(", "estimate_memory_usage(", "choose_shape(", "describe(", "train(Config("):
        assert needed in joined, f"the README's executed examples no longer show {needed}"
    run_blocks("README.md", run, tmp_path)


def test_docs_python_blocks_run(tmp_path):
    ran = 0
    for page in DOCS:
        run, _ = python_blocks(page.read_text())
        if run:
            run_blocks(f"docs/{page.name}", run, tmp_path)
            ran += len(run)
    assert ran >= 3, "expected the memory and 8-bit examples in docs/ to be executable"


def test_readme_is_short_and_every_local_link_resolves():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
    assert {p.name for p in DOCS} >= {"data.md", "memory.md", "resume.md", "scaling.md", "export.md", "flags.md",
                                      "design.md"}


def test_performance_page_is_short_and_bench_is_curated():
    """docs/performance.md stays a page of standings (the per-sitting record lives in performance-log.md), and
    bench/ keeps at most 18 scripts at its top level (12 after issue 34's curation; then issue 40's sweep of
    the arithmetic against XLA for GPU/TPU targets, its trainer run on a lent GPU and its LoRA fit for a GPU,
    and issue 42's attention alone, step profile and malloc setting), each listed in bench/README.md's table
    and each listed script present."""
    assert len((ROOT / "docs" / "performance.md").read_text().splitlines()) <= 400
    scripts = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    assert len(scripts) <= 18, scripts
    listed = re.findall(r"^\| `([a-z0-9_]+\.py)` \|", (ROOT / "bench" / "README.md").read_text(), re.M)
    assert sorted(listed) == scripts, (listed, scripts)


def coming_from_flags(text: str) -> list[str]:
    """Every --flag inside a backticked span of the "Coming from" section (its tables and prose)."""
    start = text.index("\n## Coming from")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else None]
    flags = []
    for span in re.findall(r"`([^`]+)`", section):
        flags += re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", span)
    return flags


def known_flags() -> set[str]:
    """Every flag the trainer's parser accepts: one per Config field, --no-... for booleans, --config."""
    import dataclasses

    from slm.train.config import Config, flag_name

    names = {flag_name(f.name) for f in dataclasses.fields(Config)}
    negated = {flag_name("no_" + f.name) for f in dataclasses.fields(Config) if isinstance(f.default, bool)}
    return names | negated | {"--config", "--help"}


def test_coming_from_table_flags_exist():
    known = known_flags()
    flags = coming_from_flags((ROOT / "docs" / "config.md").read_text())
    assert len(set(flags)) >= 25, sorted(set(flags))
    missing = sorted({f for f in flags if f not in known})
    assert not missing, f"flags in docs/config.md's Coming from tables that train_optimized.py does not have: {missing}"


@pytest.mark.slow  # a short run, then generate, two exports and a resume (~2 min on 2 cores)
def test_the_commands_after_the_main_job_work_on_the_run_it_made(tmp_path):
    """Issue 41: the README's follow-ups (--chat, --format peft) failed on the run the main job makes. Each
    command of the block after the main job runs here on a short run of the same kind (from scratch, stopped by
    --max-time), with runs/<run> and the outputs pointed into tmp_path and the resume's 5000 steps made 3 more
    than the run has: every one exits 0."""
    text = README.read_text()
    block = next(code for info, code, _ in fenced_blocks(text) if info == "bash" and "--resume runs/<run>" in code)
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "MPLBACKEND": "Agg"}
    main = [sys.executable, "train_optimized.py", "--use-streaming", "--dataset-id",
            str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"), "--target-params", "150000", "--seq-len", "64",
            "--eval-tokens", "2048", "--max-time", "12", "--output-dir", str(run)]
    assert subprocess.run(main, cwd=ROOT, env=env, capture_output=True, timeout=300).returncode == 0
    steps = json.loads((run / "summary.json").read_text())["steps"]
    for line in block.splitlines():
        command = line.split("#", 1)[0].strip()
        if not command.startswith(".venv/bin/python"):
            continue
        command = (command.replace(".venv/bin/python", sys.executable).replace("runs/<run>", str(run))
                   .replace("--out hf_model", f"--out {tmp_path / 'hf_model'}")
                   .replace("--out model.gguf", f"--out {tmp_path / 'model.gguf'}")
                   .replace("--max-steps 5000", f"--max-steps {steps + 3}"))
        done = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{line}\n{done.stderr[-2000:]}"
    assert json.loads((run / "summary.json").read_text())["steps"] == steps + 3
