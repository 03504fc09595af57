"""The `laneserve` command line.

Each subcommand lives in its own module under `laneserve/commands/` and exposes
`register(subparsers)`, which adds an argparse parser and sets `func` to a callable
`func(args) -> int | None` (the exit code). Modules are discovered at start-up, so a new
subcommand is a new file and nothing else.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

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


def run_single(name: str, register, argv: list[str] | None = None) -> int:
    """Run one subcommand without discovering the others (`python -m laneserve.commands.X`:
    a faster start for the supervisor and tests)."""
    parser = argparse.ArgumentParser(prog="laneserve")
    register(parser.add_subparsers())
    args = parser.parse_args([name, *(sys.argv[1:] if argv is None else argv)])
    setup_logging()
    return int(args.func(args) or 0)


def main(argv: list[str] | None = None) -> int:
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
