"""The `laneserve` command line.

Each subcommand lives in its own module under `laneserve/commands/` and exposes
`register(subparsers)`, which adds an argparse parser and sets `func` to a callable
`func(args) -> int | None` (the exit code). Modules are discovered at start-up, so a new
subcommand is a new file and nothing else.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import logging
import pkgutil
import sys
from pathlib import Path

from laneserve import commands

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="laneserve",
        description="LLM inference server with interactive and batch lanes.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    return parser


def setup_logging(verbose: bool = False) -> None:
    """Log lines on stderr (stdout stays free for JSON output)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def foreign_kernels_package() -> str | None:
    """A message when this environment cannot import laneserve's top-level `kernels` package,
    else None: Hugging Face's package of that name is installed (transformers 5.25 and later
    require it; DESIGN.md says never install both: editable, it comes first on sys.path; beside
    a non-editable laneserve, the two share one site-packages folder and overwrite each other's
    files), or another `kernels` comes first on sys.path (a folder in the working directory)."""
    ours = Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    try:
        foreign = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        foreign = None
    if foreign is not None:
        return (
            f"Hugging Face's `kernels` package {foreign.version} is installed in this "
            "environment (transformers 5.25 and later require it) and collides with laneserve's "
            "top-level `kernels` package. Fix: pip install 'transformers<5.25' && pip uninstall "
            "-y kernels, then reinstall laneserve unless it is an editable install (pip install "
            "--force-reinstall --no-deps)"
        )
    spec = importlib.util.find_spec("kernels")
    origin = spec.origin if spec is not None else None
    if origin is not None and Path(origin).resolve() == ours:
        return None
    found = f"loads {origin}" if origin else "finds no package file"
    return (
        f"`import kernels` {found}, not laneserve's kernels package ({ours.parent}): another "
        "`kernels` comes first on sys.path (PYTHONPATH, or a folder of that name in the working "
        "directory), or laneserve's install is incomplete"
    )


def check_install() -> int:
    """0, or 2 after printing why this environment cannot run laneserve."""
    problem = foreign_kernels_package()
    if problem is None:
        return 0
    print(f"laneserve: {problem}", file=sys.stderr)
    return 2


def run_single(name: str, register, argv: list[str] | None = None) -> int:
    """Run one subcommand without discovering the others (`python -m laneserve.commands.X`:
    a faster start for the supervisor and tests)."""
    if code := check_install():
        return code
    parser = argparse.ArgumentParser(prog="laneserve")
    register(parser.add_subparsers())
    args = parser.parse_args([name, *(sys.argv[1:] if argv is None else argv)])
    setup_logging()
    return int(args.func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    if code := check_install():
        return code
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    code = func(args)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
