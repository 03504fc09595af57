"""The demo's interactive lane: streamed chats through the official OpenAI client, measured at
the client (``laneserve demo``, laneserve/commands/demo.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

CHAT_QUESTIONS = (
    "In one sentence, what is Python's {m} module for?",
    "Name one function of Python's {m} module and say what it does.",
    "When would a programmer use the {m} module?",
)
CHAT_MODULES = (
    "json", "csv", "os", "re", "pathlib", "itertools", "collections", "datetime", "random",
    "math", "logging", "asyncio", "threading", "sqlite3", "argparse", "functools", "hashlib",
)  # fmt: skip


@dataclass(slots=True)
class ChatStats:
    """Client-side figures of the demo's interactive requests (seconds)."""

    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    done: int = 0
    sample: tuple[str, str] | None = None
    fatal: str | None = None  # why the chat loop itself stopped (None: it ran to its end)


def run_chats(
    base_url: str,
    api_key: str,
    stop: threading.Event,
    stats: ChatStats,
    max_chats: int,
    concurrency: int,
    max_tokens: int,
    timeout_s: float = 120.0,
) -> None:
    """Send chat requests (streamed, OpenAI client, `timeout_s` seconds each) until `stop` is
    set or `max_chats` sent; the first `concurrency` are sent even when `stop` is already set,
    so the lanes always overlap. A failed chat is counted in `stats.errors`; anything that
    stops the loop itself (no client, no model listed) is recorded in `stats.fatal`."""

    async def main() -> None:
        import openai

        client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s
        )
        model = (await client.models.list()).data[0].id
        counter = iter(range(max_chats))

        async def one_loop() -> None:
            for i in counter:
                if stop.is_set() and i >= concurrency:
                    return
                await _one_chat(client, model, chat_question(i), max_tokens, stats)

        await asyncio.gather(*(one_loop() for _ in range(concurrency)))
        await client.close()

    try:
        asyncio.run(main())
    except Exception as exc:  # reported as the interactive lane's failure, never dropped
        logger.debug("the chat loop stopped", exc_info=True)
        stats.fatal = f"{type(exc).__name__}: {exc}"


def chat_question(i: int) -> str:
    """The demo's `i`-th chat question (cycling through modules and phrasings)."""
    module = CHAT_MODULES[i % len(CHAT_MODULES)]
    return CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)].format(m=module)


async def _one_chat(client, model: str, question: str, max_tokens: int, stats: ChatStats) -> None:
    """One streamed chat; its client-side TTFT/TPOT (s), tokens and outcome go to `stats`."""
    start = time.perf_counter()
    ttft = None
    parts: list[str] = []
    tokens = 0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens,
            temperature=0.7,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    parts.append(choice.delta.content)
    except Exception as exc:  # counted and reported: a failed chat fails the demo
        stats.errors.append(f"{type(exc).__name__}: {exc}")
        return
    total = time.perf_counter() - start
    stats.done += 1
    stats.tokens += tokens
    if ttft is not None:
        stats.ttft_s.append(ttft)
        if tokens > 1:
            stats.tpot_s.append((total - ttft) / (tokens - 1))
    if stats.sample is None and parts:
        stats.sample = (question, "".join(parts).strip())
