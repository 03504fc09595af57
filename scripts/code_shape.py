"""Report the code's shape as JSON: longest functions and files, oversized ones, and stray environment reads.

Usage: python scripts/code_shape.py [--root DIR] [--top N]

Exits 1 when anything is over its limit (a function over 80 lines, a file over 600, an import circle,
an environment read outside the registry), so "clean" is its exit code.

Counts product code only (the packages below), outside kernels/ and the Alembic migrations, which issue 14
exempts. A function's length is its line span (``end_lineno - lineno + 1``, decorators excluded); a file's
is its line count. ``environ_reads`` counts ``os.environ.get``/``os.getenv``/``os.environ[...]`` loads outside
``contracts/env.py`` (the registry), any variable name. ``import_circles`` are the strongly connected
components of the graph of product modules importing each other (``import`` statements anywhere in a
module, function bodies included, except under ``if TYPE_CHECKING:``), each as its sorted files.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

PACKAGES = ("contracts", "broker", "gpu_worker", "jobs", "db", "dashboard", "laneserve")
EXEMPT = ("db/migrations",)
MAX_FUNCTION_LINES = 80  # issue 47: no function over 80 lines, no file over 600
MAX_FILE_LINES = 600


def _files(root: Path) -> list[Path]:
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if not any(rel.startswith(e) for e in EXEMPT):
                out.append(path)
    return out


def _environ_reads(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
            count += 1
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and ast.unparse(node.value) == "os.environ"
        ):
            count += 1
    return count


def _module_name(rel: str) -> str:
    """``gpu_worker/engine.py`` -> ``laneserve.gpu_worker.engine`` (the installed name)."""
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts if parts[0] == "laneserve" else ["laneserve", *parts])


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Modules `tree` imports (absolute names), skipping ``if TYPE_CHECKING:`` blocks."""
    out: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def import_circles(modules: dict[str, set[str]], files: dict[str, str]) -> list[list[str]]:
    """Strongly connected components (Tarjan) of more than one module, as sorted file lists."""
    graph = {m: sorted(d for d in deps if d in modules and d != m) for m, deps in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(files[m] for m in comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(out, key=len, reverse=True)


def measure(root: Path, top: int) -> dict:
    functions, files, env_reads = [], [], {}
    modules: dict[str, set[str]] = {}
    names: dict[str, str] = {}
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        tree = ast.parse(text)
        name = _module_name(rel)
        modules[name] = _imports(tree, name, path.name == "__init__.py")
        names[name] = rel
        files.append((len(text.splitlines()), rel))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append(
                    (node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}")
                )
        if rel != "contracts/env.py" and (n := _environ_reads(tree)):
            env_reads[rel] = n
    functions.sort(reverse=True)
    files.sort(reverse=True)
    circles = import_circles(modules, names)
    return {
        "files_counted": len(files),
        "longest_functions": [f"{n} {where}" for n, where in functions[:top]],
        "functions_over_limit": sum(1 for n, _ in functions if n > MAX_FUNCTION_LINES),
        "longest_files": [f"{n} {rel}" for n, rel in files[:top]],
        "files_over_limit": sum(1 for n, _ in files if n > MAX_FILE_LINES),
        "limits": {"function_lines": MAX_FUNCTION_LINES, "file_lines": MAX_FILE_LINES},
        "environ_reads_outside_registry": sum(env_reads.values()),
        "environ_reads_by_file": env_reads,
        "import_circles": circles,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    report = measure(args.root, args.top)
    print(json.dumps(report, indent=2))
    bad = report["functions_over_limit"] + report["files_over_limit"]
    bad += len(report["import_circles"]) + report["environ_reads_outside_registry"]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
