"""The CLI's HTTP client: every `laneserve submit | jobs | chat | status` call goes through it.

The CLI never reads the stack's database or files: it talks to the HTTP API (`/v1/files`,
`/v1/batches`, the laneserve routes of `laneserve/api/inspection.py`), the same way for a stack on
this host and one elsewhere. Where the API is (`resolve_target`):

1. `--url` on the command line, else `$LANESERVE_URL`;
2. else the running stack's `api_url` in `$LANESERVE_HOME/stack.json` (DESIGN.md "Stack
   discovery").

The key is `--api-key`, else `$LANESERVE_API_KEY` (sent as `Authorization: Bearer KEY`).

Every failure is a `StackError` with one line to print and the exit code to use: 2 when the API
cannot be used at all (no stack, unreachable, wrong key), 1 when it answered with an error
(unknown job, conflict).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from laneserve.contracts import env

logger = logging.getLogger(__name__)

EXIT_API_ERROR = 1  # the API answered with an error (404, 409, 400, 5xx)
EXIT_NO_API = 2  # no stack, unreachable, or the key was refused
DEFAULT_TIMEOUT_S = 30.0  # per request; uploads and downloads stream, so this bounds a stall


class StackError(RuntimeError):
    """A CLI call to the API failed: `str(exc)` is one line for stderr; `exit_code` (1 or 2);
    `status` the HTTP status (None when there was no answer); `code` laneserve's error code;
    `sent` False when the request never reached the API (safe to send again)."""

    def __init__(
        self,
        message: str,
        exit_code: int = EXIT_API_ERROR,
        status: int | None = None,
        code: str | None = None,
        sent: bool = True,
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.status = status
        self.code = code
        self.sent = sent  # False: the request never reached the API (connection refused)


@dataclass(frozen=True, slots=True)
class Target:
    """Where the CLI sends requests: `base_url` without `/v1` (`http://host:port`), the key
    (None: none sent), and `local` (True when found through stack.json)."""

    base_url: str
    api_key: str | None
    local: bool


def resolve_target(url: str | None = None, api_key: str | None = None) -> Target:
    """The API to talk to (module docstring for the order).

    Raises:
        StackError: no URL given and no stack running under `$LANESERVE_HOME` (exit code 2).
    """
    from laneserve.stack import StackNotRunningError, require_stack

    key = api_key or env.get("LANESERVE_API_KEY")
    explicit = url or env.get("LANESERVE_URL")
    if explicit:
        return Target(_strip_v1(explicit), key, local=False)
    try:
        info = require_stack()
    except StackNotRunningError as exc:
        raise StackError(f"{exc}, or give --url / $LANESERVE_URL", EXIT_NO_API) from None
    return Target(_strip_v1(info["api_url"]), key, local=True)


def _strip_v1(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url.removesuffix("/v1")


def _error_message(response: httpx.Response) -> tuple[str, str | None]:
    """The OpenAI error body's message and code, or the status line when the body is not one."""
    try:
        err = response.json().get("error") or {}
        return str(err.get("message") or response.reason_phrase), err.get("code")
    except (ValueError, AttributeError):
        return f"HTTP {response.status_code} {response.reason_phrase}", None


class StackClient:
    """Typed calls to one stack's HTTP API; raise `StackError` on any failure.

    Use as a context manager (or call `close`). `timeout_s` bounds each request's connect and
    each read (seconds)."""

    def __init__(self, target: Target, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.target = target
        for name in ("httpx", "httpcore"):  # one INFO line per request would drown the output
            logging.getLogger(name).setLevel(logging.WARNING)
        headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
        self._http = httpx.Client(base_url=target.base_url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> StackClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    @property
    def base_url(self) -> str:
        return self.target.base_url

    # ------------------------------------------------------------------ transport

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; connection failures and 401 become StackError (exit code 2)."""
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        self._check(response, errors=False)
        return response

    def _unreachable(self, exc: httpx.HTTPError) -> StackError:
        if isinstance(exc, httpx.TimeoutException):
            return StackError(
                f"the laneserve API at {self.base_url} did not answer in time", EXIT_NO_API
            )
        return StackError(
            f"cannot reach the laneserve API at {self.base_url} ({_reason(exc)})",
            EXIT_NO_API,
            sent=not isinstance(exc, httpx.ConnectError),
        )

    def _check(self, response: httpx.Response, errors: bool = True) -> None:
        """Raise StackError for a 401 (exit code 2) and, with `errors`, any other 4xx/5xx
        (exit code 1, the API's own message). A streamed response must have been read."""
        if response.status_code == 401:
            hint = "wrong API key" if self.target.api_key else "it needs an API key"
            raise StackError(
                f"the laneserve API at {self.base_url} refused the request ({hint}; "
                "give --api-key or set $LANESERVE_API_KEY)",
                EXIT_NO_API,
                401,
                "unauthorized",
            )
        if errors and response.status_code >= 400:
            message, code = _error_message(response)
            raise StackError(message, EXIT_API_ERROR, response.status_code, code)

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._send(method, path, **kwargs)
        self._check(response)
        try:
            return response.json()
        except ValueError:
            raise StackError(
                f"{method} {path} at {self.base_url} did not answer JSON; is this a laneserve API?",
                EXIT_NO_API,
                response.status_code,
            ) from None

    # ------------------------------------------------------------------ files

    def upload_file(self, data: bytes | BinaryIO, filename: str, purpose: str = "batch") -> dict:
        """`POST /v1/files` (multipart): the OpenAI `file` object."""
        files = {"file": (filename, data, "application/jsonl")}
        return self._json("POST", "/v1/files", files=files, data={"purpose": purpose})

    def delete_file(self, file_id: str) -> dict:
        """`DELETE /v1/files/{id}`: the OpenAI deletion object."""
        return self._json("DELETE", f"/v1/files/{file_id}")

    def head_lines(self, file_id: str, num_lines: int) -> list[bytes]:
        """The first `num_lines` lines of a file's content (`GET /v1/files/{id}/content`,
        read only as far as they reach)."""
        lines: list[bytes] = []
        buf = b""
        try:
            with self._http.stream("GET", f"/v1/files/{file_id}/content") as response:
                if response.status_code >= 400:
                    response.read()
                    self._check(response)
                for chunk in response.iter_bytes():
                    *done, buf = (buf + chunk).split(b"\n")
                    lines += done
                    if len(lines) >= num_lines:
                        break
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        return (lines + ([buf] if buf.strip() else []))[:num_lines]

    def download_file(self, file_id: str, dest: Path | BinaryIO) -> int:
        """Stream `GET /v1/files/{id}/content` into `dest`, a path (replaced only when
        complete) or an open binary stream (stdout); return the bytes written.

        Raises:
            StackError: the API failed, or `dest` cannot be written (exit code 1).
        """
        tmp = dest.with_name(f".{dest.name}.part") if isinstance(dest, Path) else None
        n = 0
        try:
            with self._http.stream("GET", f"/v1/files/{file_id}/content") as response:
                if response.status_code >= 400:
                    response.read()
                    self._check(response)
                with tmp.open("wb") if tmp else contextlib.nullcontext(dest) as f:
                    for chunk in response.iter_bytes():
                        f.write(chunk)
                        n += len(chunk)
            if tmp:
                tmp.replace(dest)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        except OSError as exc:
            raise StackError(f"cannot write {dest}: {exc.strerror or exc}") from None
        finally:
            if tmp:
                tmp.unlink(missing_ok=True)
        return n

    # ------------------------------------------------------------------ batches

    def create_batch(self, body: dict[str, Any]) -> dict:
        """`POST /v1/batches`: the OpenAI `batch` object (laneserve also takes `task`,
        `task_options`, `model`)."""
        return self._json("POST", "/v1/batches", json=body)

    def get_batch(self, batch_id: str) -> dict:
        return self._json("GET", f"/v1/batches/{batch_id}")

    def list_batches(self, limit: int = 20, after: str | None = None) -> list[dict]:
        """`GET /v1/batches`, newest first (one page of at most `limit`, 1..100)."""
        params: dict[str, Any] = {"limit": limit}
        if after:
            params["after"] = after
        return self._json("GET", "/v1/batches", params=params)["data"]

    def cancel_batch(self, batch_id: str) -> dict:
        return self._json("POST", f"/v1/batches/{batch_id}/cancel")

    def batch_stats(self, batch_id: str, latency: bool = True) -> dict | None:
        """`GET /v1/batches/{id}/stats` (laneserve): tokens, throughput, latency percentiles
        (left out without `latency`), ETA, files; None when the stack has no such route (an
        older laneserve)."""
        params = None if latency else {"latency": "0"}
        try:
            return self._json("GET", f"/v1/batches/{batch_id}/stats", params=params)
        except StackError as exc:
            if exc.status == 404 and str(exc).startswith("no route"):  # the route, not the batch
                return None
            raise

    def find_batch(self, batch_id: str) -> dict:
        """The batch named by `batch_id`, by a unique prefix of its id (of at least 10
        characters, as a narrow `jobs list` may show it) or by a unique tail of at least 8 (as
        `laneserve demo` shows it) among the newest 100.

        Raises:
            StackError: no such batch, or the prefix names several.
        """
        try:
            return self.get_batch(batch_id)
        except StackError as exc:
            if exc.status != 404:
                raise
        prefix = batch_id.rstrip("…. ")
        batches = self.list_batches(limit=100)
        matches = [b for b in batches if b["id"].startswith(prefix)]
        if len(prefix) >= 10 and len(matches) == 1:  # "batch_" + a few hex digits
            return matches[0]
        if not matches and len(prefix) >= 8:  # the id's tail, as `laneserve demo` shows it
            matches = [b for b in batches if b["id"].endswith(prefix)]
            if len(matches) == 1:
                return matches[0]
        if len(matches) > 1:
            raise StackError(f"{batch_id!r} matches {len(matches)} batches; give more of the id")
        raise StackError(f"no batch {batch_id!r} at {self.base_url}", EXIT_API_ERROR, 404)

    # ------------------------------------------------------------------ health

    def probe(self, path: str) -> tuple[int, Any]:
        """`GET path` without raising on HTTP errors: (status, JSON body or None)."""
        response = self._send("GET", path)
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, None


def _reason(exc: httpx.HTTPError) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def add_api_arguments(parser) -> None:
    """`--url` and `--api-key` (every command that talks to the API takes both)."""
    parser.add_argument(
        "--url", default=None, help="the stack's API (default: $LANESERVE_URL, else stack.json)"
    )
    parser.add_argument("--api-key", default=None, help="default: $LANESERVE_API_KEY")


def client_for(args, timeout_s: float = DEFAULT_TIMEOUT_S) -> StackClient:
    """A `StackClient` for the parsed `--url` / `--api-key`. Raises StackError (no stack)."""
    return StackClient(resolve_target(args.url, args.api_key), timeout_s)
