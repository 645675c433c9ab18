"""The package's architecture holds: nothing imports upward, no import cycles, the data layer and the memory
arithmetic never load jax, and the size limits (functions <= 100 lines, modules <= 500) are kept."""

import ast
import subprocess
import sys

import pytest
from helpers import ROOT

# Lowest first; a module may import its own layer and the ones before it (slm/__init__.py explains them).
LAYERS = ["errors", "data", "model", "optim", "memory", "io", "train", "cli"]
PACKAGE = ROOT / "slm"


def modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT).with_suffix("")).replace("/", "."): ast.parse(p.read_text())
            for p in sorted(PACKAGE.rglob("*.py"))}


def slm_imports(tree: ast.Module) -> set[str]:
    """Every slm.* module named in an import, at any depth (lazy imports inside functions count too)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("slm.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slm."):
            out.add(node.module)
    return out


def layer(module: str) -> int:
    part = module.split(".")[1] if module.count(".") else ""
    return LAYERS.index(part) if part in LAYERS else -1  # slm/__init__.py: below everything


def test_nothing_imports_upward():
    upward = [f"{m} imports {i}" for m, tree in modules().items() for i in slm_imports(tree)
              if layer(i) > layer(m)]
    assert not upward, upward


def test_no_import_cycles_between_modules():
    graph = {m: {i for i in slm_imports(t)} for m, t in modules().items()}
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            assert state.get(m) != 1, f"import cycle: {' -> '.join(path + [m])}"
            if m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])


def test_model_and_optim_know_no_files_or_flags():
    for m, tree in modules().items():
        if layer(m) in (LAYERS.index("model"), LAYERS.index("optim")):
            names = {a.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                     for a in node.names} | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
            assert not names & {"argparse", "os", "shutil", "json", "orbax", "orbax.checkpoint"}, (m, names)


@pytest.mark.parametrize("module", ["slm.data.stream", "slm.data.heldout", "slm.memory.estimate",
                                    "slm.memory.preflight", "slm.memory.monitor", "slm.memory.gpu_host", "slm.model.sizing",
                                    "streaming_data_loader", "model_sizing", "hf_dataset_loader"])
def test_data_and_memory_arithmetic_import_no_jax(module):
    code = f"import sys, {module}; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_size_limits():
    long = []
    for p in PACKAGE.rglob("*.py"):
        text = p.read_text()
        assert len(text.splitlines()) <= 500, f"{p}: {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                long.append(f"{p.name}:{node.lineno} {node.name}")
    assert not long, long


@pytest.mark.parametrize("name", ["train_optimized.py", "streaming_data_loader.py", "model_sizing.py",
                                  "hf_dataset_loader.py", "generate.py", "export_hf.py"])
def test_top_level_entry_points_stay_thin(name):
    assert len((ROOT / name).read_text().splitlines()) <= 60
