"""`laneserve chat "..."`: stream one interactive answer from the running stack in the terminal.

Finds the API like every CLI command (laneserve/http_client.py: `--url` / `$LANESERVE_URL`, else
`$LANESERVE_HOME/stack.json`; `--api-key` / `$LANESERVE_API_KEY`) and talks to it with the
official `openai` client, so this is also the smallest example of the Python SDK. The answer goes to
stdout as it streams; timing (TTFT at the first content token, TPOT = (total - TTFT) /
(tokens - 1), in ms) goes to stderr, and a line there says when `--max-tokens` cut the answer
short (finish_reason "length"). Exit codes: 0 answered, 1 API error, 2 no usable API (no
stack, unreachable, wrong key): one line on stderr.

`laneserve chat -i` is a conversation: it reads one user message per line from stdin (a `> `
prompt on a terminal), sends the whole history (system message, every earlier turn and answer)
with each one, and ends at end of input, `/exit` or Ctrl-C; `/reset` forgets the history. A turn
the API refuses is said on stderr and left out of the history; the conversation goes on. Exit
codes as above (1 when the last turn failed), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, NamedTuple

from laneserve.http_client import StackError, add_api_arguments, resolve_target


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat", help="stream one interactive answer in the terminal (-i: a conversation)"
    )
    parser.add_argument(
        "prompt", nargs="?", default=None, help="the user message ('-' reads stdin; with -i, "
        "optional: the first message)"
    )  # fmt: skip
    parser.add_argument(
        "-i", "--interactive", action="store_true",
        help="a conversation: one message per line from stdin, each sent with the history",
    )  # fmt: skip
    parser.add_argument("--system", default=None, help="system message")
    parser.add_argument("--max-tokens", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--model", default=None, help="default: the first model the API lists")
    add_api_arguments(parser)
    parser.add_argument("--quiet", action="store_true", help="no timing line on stderr")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from laneserve.commands.up import quiet_http_logs

    quiet_http_logs()
    import openai

    if args.interactive:
        prompt = None if args.prompt in (None, "-") else args.prompt
    else:
        prompt = sys.stdin.read() if args.prompt in (None, "-") else args.prompt
        if not prompt.strip():
            print("laneserve chat: empty prompt", file=sys.stderr)
            return 2
    try:
        target = resolve_target(args.url, args.api_key)
    except StackError as exc:
        print(f"laneserve chat: {exc}", file=sys.stderr)
        return exc.exit_code
    base_url = target.base_url + "/v1"
    client = openai.OpenAI(
        base_url=base_url, api_key=target.api_key or "none", max_retries=0, timeout=600.0
    )
    system = [{"role": "system", "content": args.system}] if args.system else []
    if not args.interactive:
        return _turn(client, args, target.api_key, [*system, {"role": "user", "content": prompt}])
    return _conversation(client, args, target.api_key, system, prompt)


def _conversation(
    client: Any, args: argparse.Namespace, api_key: str | None, system: list, first: str | None
) -> int:
    """`-i`: one turn per line of stdin, each sent with the history of the turns answered."""
    history: list[dict] = list(system)
    code = 0
    line = first
    while True:
        if line is None:
            try:
                line = input("> " if sys.stdin.isatty() else "")
            except EOFError:
                return code
            except KeyboardInterrupt:
                print(file=sys.stderr)
                return 130
        text, line = line.strip(), None
        if text == "/exit":
            return code
        if text == "/reset":
            history = list(system)
            continue
        if not text:
            continue
        turn = [*history, {"role": "user", "content": text}]
        answer: list[_Answer] = []
        code = _turn(client, args, api_key, turn, answer)
        if code == 2 or code == 130:  # no usable API, or Ctrl-C in an answer
            return code
        if answer:
            history = [*turn, {"role": "assistant", "content": answer[0].text}]
            print(flush=True)  # a blank line between turns: answers may hold newlines


def _turn(
    client: Any,
    args: argparse.Namespace,
    api_key: str | None,
    messages: list[dict],
    answered: list | None = None,
) -> int:
    """Stream one answer to `messages` and say how it went; the exit code (module docstring).
    The answer is appended to `answered` when there is one."""
    import openai

    base_url = str(client.base_url).rstrip("/")
    try:
        answer = _stream_answer(client, args, messages)
    except openai.APIConnectionError as exc:
        print(
            f"laneserve chat: cannot reach the laneserve API at {base_url} ({exc})", file=sys.stderr
        )
        return 2
    except openai.AuthenticationError:
        hint = "wrong API key" if api_key else "it needs an API key"
        print(
            f"laneserve chat: the laneserve API at {base_url} refused the request ({hint}; "
            "give --api-key or set $LANESERVE_API_KEY)",
            file=sys.stderr,
        )
        return 2
    except openai.APIStatusError as exc:
        print(f"\nlaneserve chat: {_message(exc)}", file=sys.stderr)
        return 1
    except openai.APIError as exc:  # an error event inside the stream (no HTTP status)
        print(f"\nlaneserve chat: {exc.message}", file=sys.stderr)
        return 1
    except IndexError:
        print(f"laneserve chat: the API at {base_url} serves no model", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # leaving the stream closes it; the server aborts the request
        print(file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    sys.stdout.flush()
    _print_footer(args, answer)
    if answered is not None:
        answered.append(answer)
    return 0


class _Answer(NamedTuple):
    """How one streamed answer went: seconds from the request to the first content token (None
    without content) and to the end, the last usage chunk, the last finish reason, the text."""

    ttft: float | None
    total: float
    usage: Any
    finish_reason: str | None
    text: str


def _stream_answer(client: Any, args: argparse.Namespace, messages: list[dict]) -> _Answer:
    """Ask `args.model` (default: the first model the API lists) and write the answer's content
    to stdout as it streams. The openai client's errors, and IndexError when the API lists no
    model, are the caller's to report."""
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
    finish_reason = None
    parts: list[str] = []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            text = choice.delta.content
            if text:
                if ttft is None:
                    ttft = time.perf_counter() - start
                sys.stdout.write(text)
                sys.stdout.flush()
                parts.append(text)
    return _Answer(ttft, time.perf_counter() - start, usage, finish_reason, "".join(parts))


def _print_footer(args: argparse.Namespace, answer: _Answer) -> None:
    """The stderr lines after the answer: a cut at `--max-tokens`, and unless `--quiet` the
    timing (TTFT, tokens, TPOT in ms, total in s)."""
    ttft, total, usage, finish_reason, _ = answer
    if finish_reason == "length":  # said even with --quiet: the answer on stdout is cut short
        print(
            f"laneserve chat: the answer was cut at --max-tokens {args.max_tokens} "
            "(raise it for a longer one)",
            file=sys.stderr,
        )
    if not args.quiet:
        tokens = usage.completion_tokens if usage is not None else None
        parts = [f"TTFT {ttft * 1000:.0f} ms" if ttft is not None else "no content"]
        if tokens:
            parts.append(f"{tokens} tokens")
            if ttft is not None and tokens > 1:
                parts.append(f"TPOT {(total - ttft) * 1000 / (tokens - 1):.1f} ms")
        parts.append(f"total {total:.2f} s")
        print(" · ".join(parts), file=sys.stderr)


def _message(exc) -> str:
    """`STATUS: message` of an API error (the SDK's str() repeats the whole body)."""
    message = exc.body.get("message") if isinstance(exc.body, dict) else None
    return f"{exc.status_code}: {message or exc.message}"
