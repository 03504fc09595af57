#!/usr/bin/env python
"""Broker benchmark: delta messages/s through the broker and the latency added, 64 streams.

Starts a broker and synthetic worker(s) (no model) as real processes, then client processes
that keep ``--streams`` long streaming requests open. Two phases:

1. **throughput**: workers step as fast as they can (``--synthetic-step-ms 0``); reports the
   delta messages/s received by the clients inside the window (``messages_per_s``), the
   messages/s the broker forwarded (``broker_forwarded_per_s``, from its counters) and
   ``messages_per_broker_cpu_s`` (forwarded / broker CPU seconds): what one core given to the
   broker sustains, the figure that does not depend on what else the machine runs.
2. **latency**: workers paced to ``--rate`` messages/s in total; each token's text carries its
   emission time (``time.monotonic_ns()`` in the engine), the client records arrival time; the
   difference is the whole transport hop engine -> worker IO thread -> broker -> client
   (decode included), an upper bound on what the broker itself adds.

Prints one JSON object. Targets (issue 5): >= 20,000 msg/s, P99 added latency <= 2 ms.

    python scripts/bench_broker.py [--streams 64] [--duration 5] [--clients 2] [--workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from laneserve.contracts.latency import percentile  # noqa: E402


def _client_proc(front: str, streams: int, start_at: float, duration: float, queue) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    from laneserve.broker import protocol as p
    from laneserve.broker.client import BrokerClient

    async def main() -> dict:
        count = 0
        lat_ns: list[int] = []
        errors: dict[str, int] = {}
        async with BrokerClient(front) as client:
            while time.time() < start_at:
                await asyncio.sleep(0.005)
            t_end = time.monotonic() + duration
            t_end_ns = time.monotonic_ns() + int(duration * 1e9)

            async def stream(i: int) -> None:
                nonlocal count, errors
                while time.monotonic() < t_end:
                    it = client.submit(
                        prompt=f"bench {i}",
                        lane="interactive",
                        sampling_params={"max_tokens": 8000},
                    )
                    try:
                        async for msg in it:
                            now = time.monotonic_ns()
                            if type(msg) is not p.Delta:
                                if type(msg) is p.Error:
                                    errors[msg.code] = errors.get(msg.code, 0) + 1
                                break
                            if now > t_end_ns:
                                break
                            count += 1
                            if msg.text.startswith(" t"):
                                lat_ns.append(now - int(msg.text[2:]))
                    finally:
                        await it.aclose()

            await asyncio.gather(*(stream(i) for i in range(streams)))
            elapsed = duration  # only messages received inside the window are counted
        return {"count": count, "elapsed": elapsed, "lat_ns": lat_ns, "errors": errors}

    queue.put(asyncio.run(main()))


def _spawn(module: str, args: list[str], log: Path, profile: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    fh = open(log, "wb")  # noqa: SIM115 - lives as long as the child
    pre = ["-m", "cProfile", "-o", profile] if profile else []
    cmd = [sys.executable, *pre, "-m", module, *args]
    return subprocess.Popen(cmd, stdout=fh, stderr=fh, env=env)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_phase(args, tmp: Path, name: str, step_ms: float, stamp: bool) -> dict:
    front, back = f"ipc://{tmp}/{name}-f.sock", f"ipc://{tmp}/{name}-b.sock"
    if args.transport == "tcp":
        base = 25000 + (os.getpid() % 1000) * 4 + (0 if name == "throughput" else 2)
        front, back = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
    procs = [
        _spawn(
            "laneserve.commands.broker",
            ["--front", front, "--back", back],
            tmp / f"{name}-broker.log",
        )
    ]
    per_worker = -(-args.streams // args.workers)
    for i in range(args.workers):
        wargs = [
            "--synthetic",
            "--broker",
            back,
            "--worker-id",
            f"bench{i}",
            "--synthetic-step-ms",
            str(step_ms),
        ]
        wargs += ["--max-num-seqs", str(per_worker), "--capacity", str(per_worker + 8)]
        if stamp:
            wargs.append("--synthetic-stamp")
        procs.append(_spawn("laneserve.commands.worker", wargs, tmp / f"{name}-worker{i}.log"))
    try:
        from laneserve.broker.client import broker_status

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if len(broker_status(front, timeout_s=1.0)["workers"]) == args.workers:
                    break
            except TimeoutError:
                pass
            time.sleep(0.1)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        start_at = time.time() + 2.0
        per_client = [
            args.streams // args.clients + (i < args.streams % args.clients)
            for i in range(args.clients)
        ]
        clients = [
            ctx.Process(target=_client_proc, args=(front, n, start_at, args.duration, queue))
            for n in per_client
        ]
        for c in clients:
            c.start()
        time.sleep(max(0.0, start_at - time.time()))
        cpu0 = [_cpu_s(proc.pid) for proc in procs]
        fwd0 = broker_status(front, timeout_s=5.0)["counters"].get("deltas", 0)
        time.sleep(max(0.0, start_at + args.duration - time.time()))
        cpu1 = [_cpu_s(proc.pid) for proc in procs]
        fwd1 = broker_status(front, timeout_s=5.0)["counters"].get("deltas", 0)
        results = [queue.get(timeout=args.duration + 60) for _ in clients]
        for c in clients:
            c.join(timeout=10)
        status = broker_status(front, timeout_s=3.0)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
    count = sum(r["count"] for r in results)
    elapsed = max(r["elapsed"] for r in results)
    lat = sorted(x / 1e6 for r in results for x in r["lat_ns"])
    forwarded = fwd1 - fwd0
    out = {
        "messages": count,
        "seconds": round(elapsed, 3),
        "messages_per_s": round(count / elapsed, 1),
        "broker_forwarded_per_s": round(forwarded / elapsed, 1),
        "errors": {
            k: sum(r["errors"].get(k, 0) for r in results)
            for k in {k for r in results for k in r["errors"]}
        },
        "broker_counters": status["counters"],
        "invalid_messages": status["counters"].get("invalid_messages", 0),
        "worker_step_ms_setting": step_ms,
        "broker_cpu_s": round(cpu1[0] - cpu0[0], 3),
        "workers_cpu_s": round(sum(cpu1[1:]) - sum(cpu0[1:]), 3),
    }
    if out["broker_cpu_s"] > 0:
        # load-independent: what one core fully given to the broker would forward
        out["messages_per_broker_cpu_s"] = round(forwarded / out["broker_cpu_s"], 1)
    if lat:
        out.update(
            latency_samples=len(lat),
            latency_p50_ms=round(percentile(lat, 50), 3),
            latency_p90_ms=round(percentile(lat, 90), 3),
            latency_p99_ms=round(percentile(lat, 99), 3),
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per phase")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--workers", type=int, default=1, help="synthetic worker processes")
    parser.add_argument("--rate", type=float, default=20_000, help="latency phase: total msg/s")
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    parser.add_argument("--phases", default="throughput,latency")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp dir with logs")
    parser.add_argument(
        "--profile-broker", default=None, help="write cProfile stats to PATH.<phase>"
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lsbench", dir="/tmp"))
    result = {
        "streams": args.streams,
        "clients": args.clients,
        "workers": args.workers,
        "transport": args.transport,
        "cpus": os.cpu_count(),
        "targets": {"messages_per_s": 20000, "latency_p99_ms": 2.0},
    }
    try:
        phases = args.phases.split(",")
        if "throughput" in phases:
            result["throughput"] = run_phase(args, tmp, "throughput", 0.0, stamp=False)
        if "latency" in phases:
            # each worker steps once per step_ms and emits one token per stream it holds
            per_worker = -(-args.streams // args.workers)
            step_ms = 1000.0 * per_worker * args.workers / args.rate
            result["latency"] = run_phase(args, tmp, "latency", step_ms, stamp=True)
            result["latency"]["target_rate"] = args.rate
    finally:
        if not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs in {tmp}", file=sys.stderr)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
