"""Subcommands of the `laneserve` CLI: each module defines register(subparsers)."""
