"""A real headless Chromium loads the running dashboard (`laneserve dashboard`, a subprocess) and
the rendered DOM and a screenshot show the charts.

Chromium is driven over the Chrome DevTools Protocol (a websocket, `websockets` package):
navigate, poll the DOM until the Vega-Lite charts have drawn, capture a full-page PNG.
Set LANESERVE_DASHBOARD_SCREENSHOT=path to keep the screenshot.
"""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import matplotlib.image
import numpy as np
import pytest
from dashboard_data import Profile, make_records, make_snapshots, store
from websockets.sync.client import connect

from dashboard.queries import PHASES

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
INTERACTIVE_RGB = (0x1F, 0x77, 0xB4)  # dashboard.charts.LANE_COLORS for "interactive"


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
# canvas or SVG, and elements Streamlit marks stale (faded while a rerun is in flight).
DOM_PROBE = """JSON.stringify((() => {
  const charts = [...document.querySelectorAll('[data-testid="stVegaLiteChart"]')];
  const drawn = charts.filter(c => [...c.querySelectorAll('canvas, svg.marks')]
      .some(g => g.getBoundingClientRect().width > 50 && g.getBoundingClientRect().height > 50));
  return {
    headings: [...document.querySelectorAll('h1, h2, h3')].map(h => h.innerText.trim()),
    charts: charts.length,
    drawn: drawn.length,
    stale: document.querySelectorAll('[data-stale="true"]').length,
    text: document.body.innerText.slice(0, 20000),
  };
})())"""


def _fill(db_engine) -> None:
    now = time.time()
    rng = np.random.default_rng(11)
    recs = make_records(rng, 200, now - 3000, now - 1, "interactive")
    recs += make_records(rng, 100, now - 3000, now - 1, "batch", Profile(prefill=300, tpot=30))
    snaps = make_snapshots("w0", "interactive", now - 900, now, every_s=15, kv_usage=0.55)
    snaps += make_snapshots("w1", "batch", now - 900, now, every_s=15, kv_usage=0.8, running=20)
    job = dict(JOB, id="batch_demo", created_at=now - 200, in_progress_at=now - 180)
    store(db_engine, records=recs, snapshots=snaps, jobs=[job])


def test_chromium_renders_dashboard_charts(chromium_path, db_url, db_engine, tmp_path):
    _fill(db_engine)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    dash_cmd = [sys.executable, "-m", "laneserve.cli", "dashboard", "--port", str(port),
                "--db", db_url]  # fmt: skip
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
        tools.call("Page.navigate", url=base)

        def rendered():
            dom = json.loads(tools.evaluate(DOM_PROBE) or "null")
            ready = dom and dom["drawn"] >= 2 * len(PHASES) + 5 and dom["stale"] == 0
            # panels render independently: under load the job panel may land after the charts
            ready = ready and "batch_demo" in dom["text"]
            return dom if ready else None

        dom = _wait(rendered, 90, "the charts to draw", dash)
        shot = tools.call("Page.captureScreenshot", format="png")
        # Live refresh: a job stored now shows up without reloading the page.
        store(db_engine, jobs=[dict(JOB, id="batch_live", created_at=time.time())])
        text = "document.body.innerText.includes('batch_live')"
        _wait(lambda: tools.evaluate(text), 60, "the live refresh to show a new job", dash)

    png = base64.b64decode(shot["data"])
    (tmp_path / "dashboard.png").write_bytes(png)
    if keep := os.environ.get("LANESERVE_DASHBOARD_SCREENSHOT"):
        shutil.copy(tmp_path / "dashboard.png", keep)

    for label in (
        "Diagnosis",
        *PHASES,
        "Throughput and load",
        "Workers",
        "Jobs",
        "Slowest requests",
    ):
        assert label in dom["headings"], (label, dom["headings"])
    assert dom["charts"] >= 2 * len(PHASES) + 5
    assert "batch_demo" in dom["text"] and "120/500 completed" in dom["text"]

    image = matplotlib.image.imread(io.BytesIO(png), format="png")  # (H, W, 3|4) float in [0, 1]
    assert image.shape[:2] == (HEIGHT, WIDTH)
    rgb = (image[..., :3] * 255).round().astype(np.int16)
    blue = np.abs(rgb - np.array(INTERACTIVE_RGB)).max(axis=-1) <= 12
    # the interactive lane's lines and bars are drawn: thousands of its pixels on the page
    assert blue.sum() > 2000, blue.sum()
