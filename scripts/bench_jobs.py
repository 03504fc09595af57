#!/usr/bin/env python
"""Bulk-job benchmark: wall time, throughput and the jobs runner's peak memory.

Starts a broker, one worker (synthetic by default; `--model PATH` for a real one) and a jobs
runner as processes in a temporary LANESERVE_HOME with SQLite, submits an N-line OpenAI batch
file (chat completions, `--max-tokens` each), and samples the runner's RSS (psutil, every
50 ms) until the job completes. Several sizes (`--lines 2000 20000`) show whether the runner's
memory grows with the file. Prints one JSON object on stdout.

    python scripts/bench_jobs.py --lines 2000 20000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _line(i: int, max_tokens: int) -> str:
    return json.dumps(
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "smollm2-135m",
                "messages": [{"role": "user", "content": f"Write one sentence about item {i}."}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
    )


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        import psutil

        self.proc = psutil.Process(pid)
        self.every_s = every_s
        self.peak = 0
        self.samples: list[int] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                rss = self.proc.memory_info().rss
            except Exception:
                return
            self.peak = max(self.peak, rss)
            self.samples.append(rss)
            time.sleep(self.every_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _completion_tokens(engine, job_id: str) -> int:
    """Output tokens the job's lines really produced (written by the runner per line)."""
    from sqlalchemy import func, select

    from laneserve.db.models import Request
    from laneserve.db.session import read_session

    with read_session(engine) as session:
        total = session.scalar(
            select(func.sum(Request.completion_tokens)).where(Request.job_id == job_id)
        )
    return int(total or 0)


def run_one(n: int, args) -> dict:
    from laneserve.db import migrate
    from laneserve.db.session import make_engine
    from laneserve.jobs import service
    from tests.harness import Stack, wait_job

    home = Path(tempfile.mkdtemp(prefix="lsbench"))
    os.environ["LANESERVE_HOME"] = str(home)
    url = f"sqlite:///{home / 'laneserve.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    stack = Stack.for_jobs(home, url)
    try:
        stack.start_broker()
        worker_args = ["--max-num-seqs", str(args.max_num_seqs)]
        if args.model is None:
            worker_args += ["--synthetic-step-ms", str(args.step_ms)]
        stack.start_worker("w1", *worker_args, model=args.model)
        runner_args = ["--max-in-flight", str(args.max_in_flight)]
        runner = stack.start_jobs_runner(*runner_args, model=args.tokenizer)
        stack.wait_workers(1, timeout_s=300)
        time.sleep(args.settle_s)  # runner start-up (imports, tokenizer) before measuring
        sampler = RssSampler(runner.pid)
        sampler.start()
        rss_idle = sampler.proc.memory_info().rss
        path = home / "bench.jsonl"
        path.write_text("\n".join(_line(i, args.max_tokens) for i in range(n)) + "\n")
        t0 = time.monotonic()
        with path.open("rb") as f:
            file = service.create_file(engine, f, path.name)
        job = service.create_batch(engine, file.id, "/v1/chat/completions")
        job = wait_job(engine, job.id, ("completed", "failed"), stack, timeout_s=args.timeout_s)
        wall = time.monotonic() - t0
        sampler.stop()
        in_progress_s = (job.completed_at or time.time()) - (job.in_progress_at or job.created_at)
        tokens = _completion_tokens(engine, job.id)
        return {
            "lines": n,
            "status": job.status,
            "request_counts": job.request_counts,
            "wall_s": round(wall, 2),
            "validation_s": round((job.in_progress_at or 0) - job.created_at, 2),
            "lines_per_s": round(n / wall, 1),
            "completion_tokens": tokens,
            "output_tokens_per_s": round(tokens / wall, 1),
            "in_progress_to_completed_s": round(in_progress_s, 2),
            "runner_rss_idle_mib": round(rss_idle / 2**20, 1),
            "runner_rss_peak_mib": round(sampler.peak / 2**20, 1),
            "input_file_mib": round(path.stat().st_size / 2**20, 2),
            "runner_rss_mib_deciles": [
                round(sampler.samples[int(q * (len(sampler.samples) - 1))] / 2**20, 1)
                for q in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
            ],
        }
    finally:
        stack.stop()
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[2000])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default=None, help="real worker model (default: synthetic)")
    parser.add_argument("--tokenizer", default=None, help="runner length check with this model")
    parser.add_argument("--step-ms", type=float, default=10.0, help="synthetic engine step")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-in-flight", type=int, default=256)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    runs = [run_one(n, args) for n in args.lines]
    print(
        json.dumps(
            {
                "benchmark": "bulk_jobs",
                "worker": args.model or f"synthetic ({args.step_ms} ms/step)",
                "runner_length_check": args.tokenizer or None,
                "max_tokens": args.max_tokens,
                "max_in_flight": args.max_in_flight,
                "database": "sqlite",
                "cpu_count": os.cpu_count(),
                "runs": runs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
