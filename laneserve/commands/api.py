"""`laneserve api`: the OpenAI-compatible HTTP gateway (laneserve/api/), served by uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from laneserve.commands import add_tool_parser_argument, port_number
from laneserve.contracts import env
from laneserve.contracts.openai.requests import LANES

logger = logging.getLogger(__name__)

API_KEY_ENV = "LANESERVE_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("api", help="run the OpenAI-compatible HTTP gateway")
    parser.add_argument(
        "--broker", default=None, help="broker front endpoint (default: ipc under $LANESERVE_HOME)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    parser.add_argument("--port", type=port_number, default=8000, help="(default: %(default)s)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None, help=f"required key (default: ${API_KEY_ENV})")
    keys.add_argument("--api-key-file", default=None, help="file holding the key (one line)")
    parser.add_argument(
        "--db", default=None, help="database URL for files and batches (default: laneserve's)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model whose tokenizer checks prompt lengths (alias, .gguf or HF dir); "
        "default: none (names come from the workers)",
    )
    parser.add_argument("--served-model-name", default=None, help="name clients use for --model")
    parser.add_argument("--max-model-len", type=int, default=None, help="tokens (default: model's)")
    add_tool_parser_argument(parser)
    parser.add_argument("--max-body-bytes", type=int, default=None, help="JSON body limit")
    parser.add_argument("--max-file-bytes", type=int, default=None, help="upload limit")
    parser.add_argument("--max-n", type=int, default=None, help="most choices per request")
    parser.add_argument("--max-tokens-limit", type=int, default=None, help="cap on max_tokens")
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process is gone"
    )
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        help="also serve /metrics, /health and /ready here without the API key "
        "(default: off; /metrics on --port needs the key)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="bind host of --metrics-port (default: %(default)s)",
    )
    parser.add_argument(
        "--no-stack-gauges",
        dest="stack_gauges",
        action="store_false",
        help="do not export the worker, broker-queue and bulk-job gauges: pass it to every "
        "gateway on a broker but one, so each gauge is exported once (docs/metrics.md)",
    )
    parser.add_argument(
        "--ready-lanes",
        default=",".join(LANES),
        help="lanes that need a live worker for /ready to answer 200 (default: %(default)s)",
    )
    parser.add_argument(
        "--background-lease-timeout",
        dest="background_lease_s",
        type=_positive_seconds,
        default=None,
        help="seconds after this gateway's last heartbeat at which another gateway sharing the "
        "database runs its background responses again (default: 10; the same on every gateway)",
    )
    parser.set_defaults(func=run)


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file:
        key = Path(args.api_key_file).read_text().strip()
        if not key:
            raise ValueError(f"{args.api_key_file} is empty")
        return key
    return args.api_key or env.get(API_KEY_ENV)


def _lanes(spec: str) -> tuple[str, ...]:
    """``--ready-lanes``: comma-separated lanes. Raises ValueError for an unknown or no lane."""
    lanes = tuple(x.strip() for x in spec.split(",") if x.strip())
    if not lanes or any(lane not in LANES for lane in lanes):
        raise ValueError(f"--ready-lanes needs lanes from {list(LANES)}, got {spec!r}")
    return lanes


def build_config(args: argparse.Namespace):
    from laneserve.api.config import ApiConfig
    from laneserve.broker.addresses import default_front

    extra = {
        name: getattr(args, name)
        for name in (
            "max_body_bytes",
            "max_file_bytes",
            "max_n",
            "max_tokens_limit",
            "background_lease_s",
        )
        if getattr(args, name) is not None
    }
    return ApiConfig(
        broker=args.broker or default_front(),
        api_key=_api_key(args),
        model=args.model,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        db_url=args.db,
        parent_pid=args.parent_pid,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        stack_gauges=args.stack_gauges,
        ready_lanes=_lanes(args.ready_lanes),
        tool_call_parser=args.tool_call_parser,
        **extra,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from laneserve.api.app import create_app

    try:
        config = build_config(args)
    except (OSError, ValueError) as exc:
        print(f"laneserve api: {exc}", file=sys.stderr)
        return 2
    app = create_app(config)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop" if sys.platform != "win32" else "asyncio",
        http="httptools",
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m laneserve.commands.api``: this command alone (faster start)."""
    from laneserve.cli import run_single

    return run_single("api", register, argv)


if __name__ == "__main__":
    raise SystemExit(main())
