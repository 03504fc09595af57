"""`laneserve chat "..."`: stream one interactive answer from the running stack in the terminal.

Finds the API from `$LANESERVE_HOME/stack.json` (or `--url`) and talks to it with the official
`openai` client, so this is also the smallest example of the Python SDK. The answer goes to
stdout as it streams; timing (TTFT at the first content token, TPOT = (total - TTFT) /
(tokens - 1), in ms) goes to stderr. Exit codes: 0 answered, 1 API error, 2 no stack.
"""

from __future__ import annotations

import argparse
import sys
import time

from contracts import env


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chat", help="stream one interactive answer in the terminal")
    parser.add_argument("prompt", help="the user message ('-' reads stdin)")
    parser.add_argument("--system", default=None, help="system message")
    parser.add_argument("--max-tokens", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--model", default=None, help="default: the first model the API lists")
    parser.add_argument("--url", default=None, help="API base URL (default: the running stack's)")
    parser.add_argument("--api-key", default=None, help="default: $LANESERVE_API_KEY")
    parser.add_argument("--quiet", action="store_true", help="no timing line on stderr")
    parser.set_defaults(func=run)


def api_base_url(explicit: str | None) -> str:
    """`explicit`, else the running stack's API URL, as an OpenAI base URL ending in /v1.

    Raises:
        laneserve.stack.StackNotRunningError: no URL given and no stack running.
    """
    from laneserve.stack import require_stack

    url = (explicit or require_stack()["api_url"]).rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def run(args: argparse.Namespace) -> int:
    from laneserve.commands.up import quiet_http_logs

    quiet_http_logs()
    import openai

    from laneserve.stack import StackNotRunningError

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        print("laneserve chat: empty prompt", file=sys.stderr)
        return 2
    try:
        base_url = api_base_url(args.url)
    except StackNotRunningError as exc:
        print(f"laneserve chat: {exc}", file=sys.stderr)
        return 2
    key = args.api_key or env.get("LANESERVE_API_KEY") or "none"
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600.0)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": prompt})
    try:
        model = args.model or client.models.list().data[0].id
        start = time.perf_counter()
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        ttft = None
        usage = None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text = choice.delta.content
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    sys.stdout.write(text)
                    sys.stdout.flush()
        total = time.perf_counter() - start
    except (openai.APIError, IndexError) as exc:
        print(f"\nlaneserve chat: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # leaving the stream closes it; the server aborts the request
        print(file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    if not args.quiet:
        tokens = usage.completion_tokens if usage is not None else None
        parts = [f"TTFT {ttft * 1000:.0f} ms" if ttft is not None else "no content"]
        if tokens:
            parts.append(f"{tokens} tokens")
            if ttft is not None and tokens > 1:
                parts.append(f"TPOT {(total - ttft) * 1000 / (tokens - 1):.1f} ms")
        parts.append(f"total {total:.2f} s")
        print(" · ".join(parts), file=sys.stderr)
    return 0
