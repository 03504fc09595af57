"""`/metrics` on the metrics port: no key there while the user routes keep needing one, the
exposition parses with prometheus_client's parser and carries ``model_name``, the stack gauges
come from one gateway only, and every metric the docs' Grafana dashboard queries is exported.

Real processes: broker, one synthetic worker (both lanes), two gateways on that broker (the
second with ``--no-stack-gauges``), the official ``openai`` client.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import API_KEY, ROOT, Stack, free_port, wait_for

pytestmark = pytest.mark.slow

DOCS = ROOT / "docs"
STACK_GAUGES = ("laneserve:kv_cache_usage_perc", "laneserve:num_requests_running")


class TwoGateways:
    def __init__(self, stack: Stack, second: Stack, metrics_port: int, second_port: int):
        self.stack, self.second = stack, second
        self.metrics_url = f"http://127.0.0.1:{metrics_port}"
        self.second_metrics_url = f"http://127.0.0.1:{second_port}"


@pytest.fixture(scope="module")
def gateways() -> Iterator[TwoGateways]:
    tmp = Path(tempfile.mkdtemp(prefix="lsm", dir="/tmp"))
    home = tmp / "home"
    home.mkdir()
    (tmp / "second").mkdir()
    stack = Stack.for_api(tmp, home)
    second = Stack.for_api(tmp / "second", home)  # its own port and logs, the same broker and db
    second.front = stack.front
    mport, mport2 = free_port(), free_port()
    try:
        stack.start_broker()
        stack.start_worker("synth", "--synthetic", "--capacity", "4", "--max-num-seqs", "4")
        stack.start_api("--metrics-port", str(mport))
        second.start_api("--metrics-port", str(mport2), "--no-stack-gauges")
        stack.wait_workers({"synth"})
        stack.wait_api()
        second.wait_api()
        for url in (f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{mport2}"):
            # both gateways have seen the worker (their broker status polls run apart)
            wait_for(lambda u=url: httpx.get(u + "/ready", timeout=5).status_code == 200, 60,
                     f"{url}/ready")  # fmt: skip
        yield TwoGateways(stack, second, mport, mport2)
    finally:
        second.stop()
        stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def scrape(url: str) -> tuple[str, dict]:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    return r.text, families


def exported_names(families: dict) -> set[str]:
    """Every name a PromQL query can use: family names and sample names (``_bucket``...)."""
    names = set(families)
    for fam in families.values():
        names.update(s.name for s in fam.samples)
        if fam.type == "histogram":
            names.update(fam.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        if fam.type == "counter":
            names.add(fam.name + "_total")
    return names


def one_request(stack: Stack) -> str:
    """A streamed chat completion through the key-protected user port; returns the model."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return model


def test_metrics_port_needs_no_key_user_routes_do(gateways) -> None:
    stack = gateways.stack
    for path in ("/metrics", "/v1/models"):
        r = httpx.get(stack.url + path, timeout=10)
        assert r.status_code == 401, (path, r.status_code)
    assert httpx.get(stack.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"},
                     timeout=10).status_code == 200  # fmt: skip
    # the metrics port serves metrics and probes only: no user route there, key or not
    r = httpx.get(gateways.metrics_url + "/v1/models", timeout=10)
    assert r.status_code == 404
    r = httpx.post(gateways.metrics_url + "/v1/chat/completions", json={}, timeout=10)
    assert r.status_code in (404, 405)
    assert httpx.get(gateways.metrics_url + "/health", timeout=10).status_code == 200
    ready = httpx.get(gateways.metrics_url + "/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["ready"] is True, ready.text


def test_metrics_parse_and_carry_model_name(gateways) -> None:
    model = one_request(gateways.stack)
    _, families = scrape(gateways.metrics_url)
    ttft = families["laneserve:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    counts = [s for s in ttft.samples if s.name.endswith("_count")]
    assert counts and all(s.labels["model_name"] == model for s in counts), counts
    assert any(s.labels["lane"] == "interactive" and s.value >= 1 for s in counts)
    for name in STACK_GAUGES:
        samples = families[name].samples
        assert samples, name
        assert all(s.labels.get("model_name") and s.labels.get("worker_id") for s in samples)
    # every labelled series carries model_name, as vLLM's do
    for fam in families.values():
        for s in fam.samples:
            assert "model_name" in s.labels, (fam.name, s)


def test_stack_gauges_exported_by_one_gateway_only(gateways) -> None:
    one_request(gateways.second)
    _, first = scrape(gateways.metrics_url)
    _, second = scrape(gateways.second_metrics_url)
    for name in (*STACK_GAUGES, "laneserve:num_workers", "laneserve:num_requests_queued"):
        assert first[name].samples, name
        assert name not in second, name
    # request metrics are per gateway: the second counts the request it served
    counts = [
        s
        for s in second["laneserve:e2e_request_latency_seconds"].samples
        if s.name.endswith("_count")
    ]
    assert sum(s.value for s in counts) == 1


def test_grafana_dashboard_queries_only_exported_names(gateways) -> None:
    one_request(gateways.stack)
    _, families = scrape(gateways.metrics_url)
    exported = exported_names(families)
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    exprs = []
    for panel in dashboard["panels"]:
        exprs += [t["expr"] for t in panel.get("targets", []) if "expr" in t]
    assert len(exprs) >= 8
    queried = {m for e in exprs for m in re.findall(r"laneserve:[A-Za-z0-9_]+", e)}
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries names /metrics does not export: {missing}"
    for wanted in (
        "laneserve:time_to_first_token_seconds_bucket",
        "laneserve:request_time_per_output_token_seconds_bucket",
        "laneserve:request_queue_time_seconds_bucket",
        "laneserve:e2e_request_latency_seconds_bucket",
        "laneserve:generation_tokens_total",
        "laneserve:kv_cache_usage_perc",
        "laneserve:num_preemptions_total",
    ):
        assert wanted in queried, wanted
    prom = yaml.safe_load((DOCS / "prometheus.yml").read_text())
    job = prom["scrape_configs"][0]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"]


def test_metrics_port_in_use_fails_the_start(tmp_path) -> None:
    """A taken metrics port stops the gateway at start-up with a message naming it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=str(ROOT), LANESERVE_HOME=str(tmp_path))
        env.pop("LANESERVE_DB_URL", None)
        res = subprocess.run(
            [sys.executable, "-m", "laneserve.commands.api", "--broker",
             f"ipc://{tmp_path}/none.sock", "--port", str(free_port()),
             "--db", f"sqlite:///{tmp_path}/db.sqlite", "--metrics-port", str(port)],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert res.returncode != 0
    assert f"cannot listen on the metrics port 127.0.0.1:{port}" in res.stderr, res.stderr[-3000:]
    bad = subprocess.run(
        [sys.executable, "-m", "laneserve.commands.api", "--ready-lanes", "bulk"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--ready-lanes" in bad.stderr, bad.stderr
