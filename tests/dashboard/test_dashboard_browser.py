"""A real headless Chromium loads the running dashboard (`laneserve dashboard`, a subprocess) and
the rendered DOM and a screenshot show the charts.

Chromium is driven over the Chrome DevTools Protocol (a websocket, `websockets` package):
navigate, poll the DOM until the Vega-Lite charts have drawn, capture a full-page PNG.
Screenshots (first paint, load, after 15 s, the job view) are kept under pytest's tmp dir, or in
the folder LANESERVE_DASHBOARD_SCREENSHOT names.
"""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import matplotlib.image
import numpy as np
import openai
import pytest
from dashboard_data import Profile, make_records, make_snapshots, store
from websockets.sync.client import connect

from laneserve.contracts import env
from laneserve.dashboard.queries import PHASES
from tests.harness import API_KEY, Stack

pytestmark = [pytest.mark.slow, pytest.mark.chromium]

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--window-size=1400,1000",
]
WIDTH, HEIGHT = 1400, 4800  # px: the whole page of the filled dashboard
JOB = {"status": "in_progress", "endpoint": "/v1/chat/completions", "model": "smollm2-135m",
       "request_total": 500, "request_completed": 120, "request_failed": 3}  # fmt: skip
INTERACTIVE_RGB = (0x1F, 0x77, 0xB4)  # dashboard.charts.LANE_SCALE for "interactive"
MODEL = "smollm2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        with contextlib.suppress(Exception):
            if value := pred():
                return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@contextlib.contextmanager
def _process(cmd: list[str], log: Path, **kw):
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class DevTools:
    """A minimal Chrome DevTools Protocol client over an open websocket to one page target."""

    def __init__(self, ws):
        self.ws = ws
        self.ids = itertools.count(1)

    def call(self, method: str, timeout_s: float = 30.0, **params) -> dict:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == msg_id:
                assert "error" not in reply, reply["error"]
                return reply["result"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


# Counts what the page shows: headings, Vega-Lite charts, charts that have drawn a non-empty
# canvas or SVG, elements Streamlit marks stale (a rerun is in flight), element containers whose
# computed opacity shows the stale fade, and the labels of each time axis (SVG renderer only).
DOM_PROBE = """JSON.stringify((() => {
  const charts = [...document.querySelectorAll('[data-testid="stVegaLiteChart"]')];
  const drawn = charts.filter(c => [...c.querySelectorAll('canvas, svg.marks')]
      .some(g => g.getBoundingClientRect().width > 50 && g.getBoundingClientRect().height > 50));
  return {
    headings: [...document.querySelectorAll('h1, h2, h3')].map(h => h.innerText.trim()),
    charts: charts.length,
    drawn: drawn.length,
    stale: document.querySelectorAll('[data-stale="true"]').length,
    containers: document.querySelectorAll('[data-testid="stElementContainer"]').length,
    faded: [...document.querySelectorAll('[data-testid="stElementContainer"]')]
        .filter(e => parseFloat(getComputedStyle(e).opacity) < 0.99).length,
    title_stale: [...document.querySelectorAll('[data-stale="true"] h1')].length > 0,
    main_opacity: Math.min(...[...document.querySelectorAll(
        '[data-testid="stMain"], [data-testid="stMainBlockContainer"]')]
        .map(e => parseFloat(getComputedStyle(e).opacity)), 1),
    axis_labels: charts.map(c => [...c.querySelectorAll('.role-axis')]
        .filter(a => (a.getAttribute('aria-label') || '').includes('time'))
        .map(a => [...a.querySelectorAll('.role-axis-label text')].map(t => t.textContent)))
        .flat(),
    cut: [...document.querySelectorAll('[data-testid="stMetricLabel"] *, [data-testid="stMetricValue"] *')]
        .filter(e => e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1).map(e => e.innerText),
    text: document.body.innerText.slice(0, 30000),
  };
})())"""


def _fill(db_engine) -> float:
    """Stores the dashboard's data up to now; returns now (unix seconds)."""
    now = time.time()
    rng = np.random.default_rng(11)
    recs = make_records(rng, 200, now - 3000, now - 1, "interactive")
    recs += make_records(rng, 100, now - 3000, now - 1, "batch", Profile(prefill=300, tpot=30))
    snaps = make_snapshots("w0", "interactive", now - 900, now, every_s=15, kv_usage=0.55)
    snaps += make_snapshots("w1", "batch", now - 900, now, every_s=15, kv_usage=0.8, running=20)
    job = dict(JOB, id="batch_demo", created_at=now - 200, in_progress_at=now - 180)
    store(db_engine, records=recs, snapshots=snaps, jobs=[job])
    return now


@contextlib.contextmanager
def _browser(chromium_path: str, db_url: str, tmp_path: Path, api_url: str | None = None):
    """The dashboard (`laneserve dashboard`) and a headless Chromium on one page of it; yields
    (DevTools, base URL, dashboard process)."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    dash_cmd = [sys.executable, "-m", "laneserve.cli", "dashboard", "--port", str(port),
                "--db", db_url, *(["--api-url", api_url] if api_url else [])]  # fmt: skip
    profile = tmp_path / "chromium-profile"
    chromium_cmd = [chromium_path, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"]
    with contextlib.ExitStack() as stack:
        dash = stack.enter_context(_process(dash_cmd, tmp_path / "dashboard.log"))
        chromium = stack.enter_context(_process(chromium_cmd, tmp_path / "chromium.log"))
        _wait(lambda: httpx.get(f"{base}/_stcore/health").text == "ok", 90, "dashboard", dash)
        active = profile / "DevToolsActivePort"
        cdp_port = _wait(lambda: int(active.read_text().split()[0]), 60, "chromium", chromium)
        targets = httpx.get(f"http://127.0.0.1:{cdp_port}/json/list").json()
        page = next(t for t in targets if t["type"] == "page")
        ws = stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=2**26))
        tools = DevTools(ws)
        tools.call("Page.enable")
        # A tall viewport: Streamlit's main area scrolls inside the page, so what is outside the
        # viewport would be neither laid out for the screenshot nor captured.
        tools.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT,
                   deviceScaleFactor=1, mobile=False)  # fmt: skip
        yield tools, base, dash


def _dom(tools: DevTools) -> dict:
    return json.loads(tools.evaluate(DOM_PROBE) or "null") or {}


def _screenshot(tools: DevTools, path: Path) -> bytes:
    png = base64.b64decode(tools.call("Page.captureScreenshot", format="png")["data"])
    path.write_bytes(png)
    return png


def _artifacts(tmp_path: Path) -> Path:
    """Where the screenshots are kept: pytest's tmp dir (the last runs are kept), or the folder
    named by LANESERVE_DASHBOARD_SCREENSHOT."""
    keep = env.get("LANESERVE_DASHBOARD_SCREENSHOT")
    out = Path(keep) if keep else tmp_path / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    return out


# SQLite only: what the browser shows does not depend on the database; the same panels on
# PostgreSQL are checked by test_dashboard_app.py (AppTest) and test_dashboard_queries.py.
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_chromium_renders_dashboard_charts(chromium_path, db_url, db_engine, tmp_path):
    now = _fill(db_engine)
    shots = _artifacts(tmp_path)
    with _browser(chromium_path, db_url, tmp_path) as (tools, base, dash):
        tools.call("Page.navigate", url=base)
        # The skeleton (title, sidebar) is there before the panels have read anything.
        first = _wait(lambda: (d := _dom(tools)) and "laneserve" in d["text"] and d, 60,
                      "the page skeleton", dash)  # fmt: skip
        _screenshot(tools, shots / "first-paint.png")

        def rendered():
            dom = _dom(tools)
            ready = dom and dom["drawn"] >= 2 * len(PHASES) + 6
            # panels render independently: under load the job panel may land after the charts
            title = "batch_demo · chat/completions · input file gone · in_progress"
            ready = ready and f"{title} · 120/500 completed" in dom["text"]
            return dom if ready else None

        dom = _wait(rendered, 90, "the charts to draw", dash)
        png = _screenshot(tools, shots / "load.png")
        # Between and during refreshes, for 15 s (three 5-s refreshes): only the live panels
        # rerun (never the skeleton), and no element shows the grey stale fade.
        samples, deadline = [], time.monotonic() + 15
        while time.monotonic() < deadline:
            samples.append(_dom(tools))
            time.sleep(0.2)
        after = _dom(tools)
        _screenshot(tools, shots / "after-15s.png")
        # Live refresh: a job stored now shows up without reloading the page.
        store(db_engine, jobs=[dict(JOB, id="batch_live", created_at=time.time())])
        text = "document.body.innerText.includes('batch_live')"
        _wait(lambda: tools.evaluate(text), 60, "the live refresh to show a new job", dash)

    assert first["text"].strip(), "blank page at load"
    assert any(d["stale"] for d in samples)  # the sampling saw refreshes in flight ...
    assert not any(d["title_stale"] for d in samples)  # ... of the live panels only
    assert [d["faded"] for d in samples] == [0] * len(samples)
    assert after["faded"] == 0 and after["main_opacity"] == 1.0, after
    for label in ("Diagnosis", *PHASES, "Throughput and load", "Workers", "SLO and step budget",
                  "Speculative decoding", "Jobs", "Slowest requests"):  # fmt: skip
        assert label in dom["headings"], (label, dom["headings"])
    assert dom["charts"] >= 2 * len(PHASES) + 6
    assert "batch_demo" in dom["text"] and "120/500 completed" in dom["text"]
    assert "tok/s · last 30 s" in dom["text"] and "tok/s · window avg" in dom["text"]
    assert dom["cut"] == [], dom["cut"]  # every headline label and figure fits its column
    assert "DESIGN" not in dom["text"]
    # time axis labels are never repeated within a chart, and read on a 24-hour UTC clock:
    # HH:MM ticks fall in the hours the data spans (Vega's default printed 07:31 at 19:31 UTC)
    hours = {
        time.strftime("%H", time.gmtime(t)) for t in range(int(now) - 3700, int(now) + 600, 60)
    }
    for labels in dom["axis_labels"]:
        assert len(labels) == len(set(labels)), labels
        for label in labels:
            assert re.fullmatch(r"\d\d:\d\d|:\d\d|[A-Z][a-z]{2} \d\d", label), labels
            assert not re.fullmatch(r"\d\d:\d\d", label) or label[:2] in hours, (label, hours)

    image = matplotlib.image.imread(io.BytesIO(png), format="png")  # (H, W, 3|4) float in [0, 1]
    assert image.shape[:2] == (HEIGHT, WIDTH)
    rgb = (image[..., :3] * 255).round().astype(np.int16)
    blue = np.abs(rgb - np.array(INTERACTIVE_RGB)).max(axis=-1) <= 12
    # the interactive lane's lines and bars are drawn: thousands of its pixels on the page
    assert blue.sum() > 2000, blue.sum()


def _lines(n: int) -> bytes:
    good = [
        {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"summarize document {i}", "max_tokens": 4}}
        for i in range(n)
    ]  # fmt: skip
    return ("".join(json.dumps(x) + "\n" for x in good) + "not json\n").encode()


@pytest.fixture
def traffic_stack(smollm2_gguf, smollm2_dir):
    """A live stack (broker, recorder, synthetic worker on both lanes, jobs runner, API) after
    real traffic: chats through the official client and one bulk job with an error line."""
    tmp = Path(tempfile.mkdtemp(prefix="lsd", dir="/tmp"))
    stack = Stack.for_api(tmp, tmp / "home")
    try:
        stack.start_broker(recorder=True)
        stack.start_worker("synth", "--synthetic", "--capacity", "8", lanes="interactive,batch")
        stack.start_jobs_runner("--model", str(smollm2_gguf), "--model-name", MODEL,
                                "--no-length-check")  # fmt: skip
        stack.start_api("--model", str(smollm2_gguf), "--served-model-name", MODEL)
        stack.wait_workers({"synth"})
        stack.wait_api()
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key=API_KEY, max_retries=0)
        for i in range(6):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=8
            )
        upload = client.files.create(file=("docs.jsonl", _lines(8)), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        )
        done = _wait(lambda: (b := client.batches.retrieve(batch.id)).status
                     in ("completed", "failed") and b, 120, "the job to end")  # fmt: skip
        assert done.status == "completed", stack.logs()
        yield stack, client, done
    finally:
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_chromium_job_view_of_a_completed_job(chromium_path, traffic_stack, tmp_path):
    stack, client, done = traffic_stack

    def recorded():  # the recorder writes the lines' latency rows shortly after the job ends
        stats = httpx.get(f"{stack.url}/v1/batches/{done.id}/stats",
                          headers={"Authorization": f"Bearer {API_KEY}"}).json()  # fmt: skip
        return stats if stats["latency_ms"]["e2e_ms"]["count"] == 8 else None

    stats = _wait(recorded, 60, "the job lines' latency records")
    e2e = stats["latency_ms"]["e2e_ms"]
    shots = _artifacts(tmp_path)
    with _browser(chromium_path, stack.db_url, tmp_path, api_url=stack.url) as (tools, base, dash):
        tools.call("Page.navigate", url=f"{base}/?job={done.id}")
        # the panels fill in over the fragment's reruns (the latency rows after their heading; the
        # progress line was once missing from a capture that held the rest): wait for every piece
        expect = ("First error lines", "invalid_json", "Latency of its lines", f"{e2e['p50']:,.1f}",
                  "completed · 8/9 completed, 1 failed", f"{stats['lines_per_s']:,.2f} lines/s",
                  f"{stats['output_tokens_per_s']:,.2f} tokens/s",
                  "left in completion window (24h)")  # fmt: skip

        last: dict = {}

        def shown():
            last.update(dom := _dom(tools))
            return dom if dom and all(x in dom["text"] for x in expect) else None

        try:
            dom = _wait(shown, 90, "the job view", dash)
        except AssertionError as e:
            missing = [x for x in expect if x not in last.get("text", "")]
            raise AssertionError(f"{e}; missing {missing} from {last.get('text')!r}") from None
        _screenshot(tools, shots / "job.png")
        links = tools.evaluate("[...document.querySelectorAll('a')].map(a => a.href)")

    text = dom["text"]
    assert f"Job {done.id}" in dom["headings"]
    assert all(x in text for x in expect)
    assert f"{stack.url}/v1/files/{done.output_file_id}/content" in links
    assert f"{stack.url}/v1/files/{done.error_file_id}/content" in links
    # the lines' e2e percentiles, as the stats route computes them
    assert e2e["count"] == 8 and f"{e2e['p50']:,.1f}" in text, (e2e, text)
