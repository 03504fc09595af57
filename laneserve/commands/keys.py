"""`laneserve keys generate`: CurveZMQ keys for workers on other hosts (broker/curve.py).

Writes under ``$LANESERVE_HOME/keys`` (or ``--dir``), directories 0700 and files 0600::

    server.key / server.key_secret   the broker's key pair
    allowed/NAME.key                 each worker's public key (the broker's allow-list)
    clients/NAME.key_secret          each worker's key pair (copy it to that worker's host)

Existing keys are kept, so running it again with a new ``--client`` name adds a worker without
rotating the server key; ``--force`` regenerates everything.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("keys", help="CurveZMQ keys for remote workers")
    sub = parser.add_subparsers(dest="keys_command", required=True)
    gen = sub.add_parser("generate", help="write a server key pair and client key pairs")
    gen.add_argument(
        "--client",
        action="append",
        default=None,
        metavar="NAME",
        help="a worker key pair to create (repeatable; default: one named 'worker')",
    )
    gen.add_argument("--dir", default=None, help="keys directory (default: $LANESERVE_HOME/keys)")
    gen.add_argument("--force", action="store_true", help="regenerate existing keys")
    gen.add_argument("--json", action="store_true", help="print the paths as one JSON object")
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from laneserve.broker.curve import CurveKeyError, generate_keys

    try:
        paths = generate_keys(args.dir, args.client, force=args.force)
    except CurveKeyError as exc:
        raise SystemExit(f"laneserve keys: {exc}") from exc
    if args.json:
        out = {
            "keys_dir": str(paths.keys_dir),
            "server_public": str(paths.server_public),
            "server_secret": str(paths.server_secret),
            "allow_dir": str(paths.allow_dir),
            "clients": {name: str(p) for name, p in paths.clients.items()},
        }
        print(json.dumps(out))
        return 0
    print(f"keys in {paths.keys_dir}")
    print(f"  broker: --curve-server-key {paths.server_secret} --curve-allow {paths.allow_dir}")
    for name, secret in paths.clients.items():
        print(
            f"  worker {name}: --curve-server-public {paths.server_public} "
            f"--curve-client-key {secret}"
        )
    return 0
