"""The soak's interactive clients (scripts/soak.py): one thread each, sending chats and
completions to the HTTP API until told to stop, and the summary of what they saw.

A request that gets a 429/503 (or a retryable error in its stream), or meets a connection error,
is sent again after Retry-After (else 0.5 s doubling to 4 s), at most `MAX_ATTEMPTS` times, as the
official `openai` client does. TTFT and TPOT are measured on streams: first content chunk, and
the mean gap between content chunks after it.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time

import httpx

MAX_ATTEMPTS = 5
RETRYABLE = (429, 503)
REQUEST_TIMEOUT_S = 120.0


class Client(threading.Thread):
    """Sends requests back to back until `stop` is set; `records` holds one dict per request:
    t (unix s at its start), kind, stream, code (the last HTTP status, 0: connection error),
    attempts, disconnected (a stream closed on purpose after its first chunk), ttft_ms, tpot_ms."""

    def __init__(self, api: str, model: str, rng: random.Random, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.api, self.model, self.rng, self.max_tokens = api, model, rng, max_tokens
        self.stop = threading.Event()
        self.records: list[dict] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.api, timeout=REQUEST_TIMEOUT_S) as http:
            while not self.stop.is_set():
                self.records.append(self._one(http))

    def _one(self, http: httpx.Client) -> dict:
        kind = self.rng.choice(("chat", "completion"))
        stream = self.rng.random() < 0.5
        record = {"t": time.time(), "kind": kind, "stream": stream, "attempts": 0, "code": 0,
                  "disconnected": stream and self.rng.random() < 0.1}  # fmt: skip
        path, body = self._body(kind, stream)
        delay = 0.5
        while record["attempts"] < MAX_ATTEMPTS and not self.stop.is_set():
            record["attempts"] += 1
            retry_after = self._attempt(http, path, body, record)
            if retry_after is None:
                break
            time.sleep(retry_after or delay)
            delay = min(4.0, delay * 2)
        return record

    def _body(self, kind: str, stream: bool) -> tuple[str, dict]:
        n = self.rng.randrange(1_000_000)
        body = {"model": self.model, "max_tokens": self.rng.randint(4, self.max_tokens),
                "stream": stream, "temperature": 0.7, "seed": n}  # fmt: skip
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": f"Tell me a fact about {n}."}]
            return "/v1/chat/completions", body
        body["prompt"] = f"Fact number {n}:"
        return "/v1/completions", body

    def _attempt(self, http: httpx.Client, path: str, body: dict, record: dict) -> float | None:
        """One try; None when the request is settled, else seconds to wait (0: the default)."""
        try:
            if body["stream"]:
                return self._stream(http, path, body, record)
            resp = http.post(path, json=body)
        except httpx.TransportError:
            record["code"] = 0
            return 0.0
        record["code"] = resp.status_code
        if resp.status_code in RETRYABLE:
            return float(resp.headers.get("retry-after") or 0.0)
        return None

    def _stream(self, http: httpx.Client, path: str, body: dict, record: dict) -> float | None:
        t0 = time.monotonic()
        with http.stream("POST", path, json=body) as resp:
            record["code"] = resp.status_code
            if resp.status_code != 200:
                resp.read()
                retry = resp.headers.get("retry-after")
                return float(retry or 0.0) if resp.status_code in RETRYABLE else None
            times = []
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                try:
                    chunk = json.loads(line[6:])
                except ValueError:  # an event that is not one JSON line: counted, not fatal
                    record["malformed_events"] = record.get("malformed_events", 0) + 1
                    continue
                if "error" in chunk:  # e.g. worker_lost after tokens: retryable
                    record["code"] = 503
                    return 0.0
                if _content(chunk):
                    times.append(time.monotonic())
                    if record["disconnected"]:
                        break  # closing the response drops the connection mid-stream
        if times:
            record["ttft_ms"] = (times[0] - t0) * 1000
            if len(times) > 1:
                record["tpot_ms"] = (times[-1] - times[0]) * 1000 / (len(times) - 1)
        return None


def _content(chunk: dict) -> str:
    choice = (chunk.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    values = sorted(values)
    at = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"n": len(values), "p50": round(statistics.median(values), 1),
            "p90": round(at(0.90), 1), "p99": round(at(0.99), 1)}  # fmt: skip


def _phase(t: float, t0: float, faults: list[dict]) -> str:
    """The window a request started in: before any fault, or after the latest one."""
    name = "before faults"
    for fault in faults:
        if t - t0 >= fault["at_s"]:
            name = f"after {fault['target']}"
    return name


def summarize_requests(records: list[dict], faults: list[dict], t0: float) -> dict:
    """Counts (answered, retried, failed by code, 5xx that are not retryable) and TTFT/TPOT
    percentiles (ms) per phase (`faults`' `at_s` are seconds after `t0`, unix s)."""
    by_code: dict[str, int] = {}
    phases: dict[str, dict[str, list[float]]] = {}
    for r in records:
        if r["code"] != 200:
            by_code[str(r["code"])] = by_code.get(str(r["code"]), 0) + 1
        phase = phases.setdefault(_phase(r["t"], t0, faults), {"ttft_ms": [], "tpot_ms": []})
        for key in ("ttft_ms", "tpot_ms"):
            if key in r:
                phase[key].append(r[key])
    return {
        "sent": len(records),
        "answered": sum(r["code"] == 200 for r in records),
        "retried": sum(r["attempts"] > 1 for r in records),
        "disconnected_mid_stream": sum(r["disconnected"] and r["code"] == 200 for r in records),
        "failed_by_code": by_code,
        "non_retryable_5xx": sum(r["code"] >= 500 and r["code"] not in RETRYABLE for r in records),
        "malformed_events": sum(r.get("malformed_events", 0) for r in records),
        "latency_by_phase": {
            name: {k: _percentiles(v) for k, v in values.items()} for name, values in phases.items()
        },
    }
