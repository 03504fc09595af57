"""Report the code's shape as JSON: longest functions and files, oversized ones, and stray environment reads.

Usage: python scripts/code_shape.py [--root DIR] [--top N]

Counts product code only (the packages below), outside kernels/ and the Alembic migrations, which issue 14
exempts. A function's length is its line span (``end_lineno - lineno + 1``, decorators excluded); a file's
is its line count. ``environ_reads`` counts ``os.environ.get``/``os.getenv``/``os.environ[...]`` loads outside
``contracts/env.py`` (the registry), any variable name.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

PACKAGES = ("contracts", "broker", "gpu_worker", "jobs", "db", "dashboard", "laneserve")
EXEMPT = ("db/migrations",)
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500


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


def measure(root: Path, top: int) -> dict:
    functions, files, env_reads = [], [], {}
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        tree = ast.parse(text)
        files.append((len(text.splitlines()), rel))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
        if rel != "contracts/env.py" and (n := _environ_reads(tree)):
            env_reads[rel] = n
    functions.sort(reverse=True)
    files.sort(reverse=True)
    return {
        "files_counted": len(files),
        "longest_functions": [f"{n} {where}" for n, where in functions[:top]],
        "functions_over_limit": sum(1 for n, _ in functions if n > MAX_FUNCTION_LINES),
        "longest_files": [f"{n} {rel}" for n, rel in files[:top]],
        "files_over_limit": sum(1 for n, _ in files if n > MAX_FILE_LINES),
        "limits": {"function_lines": MAX_FUNCTION_LINES, "file_lines": MAX_FILE_LINES},
        "environ_reads_outside_registry": sum(env_reads.values()),
        "environ_reads_by_file": env_reads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    print(json.dumps(measure(args.root, args.top), indent=2))


if __name__ == "__main__":
    main()
