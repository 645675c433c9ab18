"""Code-health figures for a tree of Python files: longest functions, largest modules, import cycles.

    python tools/code_stats.py [PATH ...]      (default: every tracked .py file outside tests/ and bench/)

Prints the 5 longest functions (lines, def to last line), the 5 largest modules (lines) and whether the
import graph between the given modules has a cycle. Pure stdlib (ast).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


def functions(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [(node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}")
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def module_name(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """Known modules that `path` imports (absolute and relative imports, at any depth of the file)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != me:
                out.add(n)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def main(argv: list[str]) -> None:
    if argv:
        paths = [Path(p) for p in argv]
    else:
        tracked = subprocess.run(["git", "ls-files", "*.py"], capture_output=True, text=True, check=True).stdout
        paths = [Path(p) for p in tracked.split() if not p.startswith(("tests/", "bench/", "tools/"))]
    funcs = sorted((f for p in paths for f in functions(p)), reverse=True)
    sizes = sorted(((len(p.read_text().splitlines()), str(p)) for p in paths), reverse=True)
    known = {module_name(p) for p in paths}
    graph = {module_name(p): imports(p, known) for p in paths}
    print("longest functions:", "; ".join(f"{n} lines {name}" for n, name in funcs[:5]))
    print("largest modules:", "; ".join(f"{n} lines {name}" for n, name in sizes[:5]))
    print(f"functions over 80 lines: {sum(n > 80 for n, _ in funcs)}, over 100: {sum(n > 100 for n, _ in funcs)}")
    cycle = find_cycle(graph)
    print("import cycle:", " -> ".join(cycle) if cycle else "none")


if __name__ == "__main__":
    main(sys.argv[1:])
