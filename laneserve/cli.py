"""The `laneserve` command line.

Each subcommand lives in its own module under `laneserve/commands/` and exposes
`register(subparsers)`, which adds an argparse parser and sets `func` to a callable
`func(args) -> int | None` (the exit code). Modules are discovered at start-up, so a new
subcommand is a new file and nothing else.
"""

from __future__ import annotations

import argparse
import importlib
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
    """A message when `import kernels` would load another package than laneserve's top-level
    `kernels` (Hugging Face's package of that name, which transformers 5.25 and later require,
    installed in this environment: DESIGN.md says never install both), else None."""
    ours = Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    spec = importlib.util.find_spec("kernels")
    origin = spec.origin if spec is not None else None
    if origin is not None and Path(origin).resolve() == ours:
        return None
    return (
        f"`import kernels` loads {origin}, not laneserve's kernels package ({ours.parent}): "
        "Hugging Face's `kernels` package (which transformers 5.25+ requires) is installed in "
        "this environment and shadows it. Fix: pip install 'transformers<5.25' && "
        "pip uninstall -y kernels"
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
