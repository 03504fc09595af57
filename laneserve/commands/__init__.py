"""Subcommands of the `laneserve` CLI: each module defines register(subparsers)."""

import argparse


def port_number(text: str) -> int:
    """argparse type of a TCP port option: an integer 0..65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not in 0..65535")
    return port


def add_tool_parser_argument(parser: argparse.ArgumentParser) -> None:
    """``--tool-call-parser`` (vLLM's flag and names), shared by `up`, `api` and `jobs-runner`."""
    from laneserve.contracts.openai.tool_parsers import PARSERS

    parser.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="how replies are read for tool calls (default: the one the chat template implies)",
    )
