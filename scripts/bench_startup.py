#!/usr/bin/env python
"""Time from `laneserve up` to the first token through the API, cold and warm; one JSON object.

Each run starts the whole stack (`laneserve up --api-port 0`: broker, recorder, worker, API,
dashboard unless `--no-dashboard`) in a fresh `LANESERVE_HOME` whose `models/` links to this
machine's pulled models (as after `laneserve model pull`), sends one streamed completion
(`max_tokens=1`, the official `openai` client) as soon as `stack.json` says the stack is up, and
records the seconds from process start to that token. Runs:

- ``cold_kernels_unbuilt``: torch's extension cache is empty (`XDG_CACHE_HOME` set to a fresh
  directory), as on a machine where nothing has compiled the C++ CPU kernels: the worker
  builds them in the background and serves its first token on the PyTorch path; the run then
  waits for the build's library to appear (``kernels_built_s``) so no compiler outlives it;
- ``warm``: twice more with the kernels built (the usual start after `laneserve model pull`).

    python scripts/bench_startup.py [--no-dashboard] [--skip-cold] [--timeout 900]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from laneserve.gpu_worker.openmp import apply_openmp_policy  # noqa: E402  # isort: skip

apply_openmp_policy(exclusive=True)  # the offline policy, before torch loads
from benchlib import cpu_info  # noqa: E402  # isort: skip

from laneserve.gpu_worker.model_files import models_dir  # noqa: E402
from laneserve.stack import start_stack_process, stop_stack_process  # noqa: E402


def first_token_s(api_url: str, t0: float) -> float:
    """Seconds from t0 until one streamed completion token arrives."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model, prompt="Hello", max_tokens=1, temperature=0.0, stream=True
    )
    for _ in stream:
        return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def one_run(args, env: dict[str, str], kernel_cache: Path | None = None) -> dict:
    """One start; with `kernel_cache` (an empty extension cache) also the seconds until the
    background build's library appears there."""
    with tempfile.TemporaryDirectory(prefix="ls-startup-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        (home / "models").symlink_to(models_dir(), target_is_directory=True)
        up_args = ["--api-port", "0", "--dashboard-port", "0"]
        if args.no_dashboard:
            up_args.append("--no-dashboard")
        t0 = time.perf_counter()
        proc, info = start_stack_process(home, up_args, timeout_s=args.timeout, env=env)
        try:
            up_s = time.perf_counter() - t0
            ttft = first_token_s(info["api_url"], t0)
            out = {"stack_ready_s": round(up_s, 2), "first_token_s": round(ttft, 2)}
            if kernel_cache is not None:
                out["kernels_built_s"] = wait_for_build(kernel_cache, t0, args.timeout)
            return out
        finally:
            stop_stack_process(proc)


def wait_for_build(cache: Path, t0: float, timeout_s: float) -> float | None:
    """Seconds from t0 until the C++ kernels' library exists under `cache` (None: timed out)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if any(cache.glob("torch_extensions/laneserve_cpu_*/laneserve_cpu_*.so")):
            return round(time.perf_counter() - t0, 2)
        time.sleep(1.0)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-dashboard", action="store_true")
    ap.add_argument("--skip-cold", action="store_true", help="warm runs only")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per stage")
    args = ap.parse_args()
    result: dict = {"cpu": cpu_info(), "runs": {}}
    if not args.skip_cold:
        with tempfile.TemporaryDirectory(prefix="ls-xdg-") as xdg:
            env = dict(os.environ, XDG_CACHE_HOME=xdg)
            result["runs"]["cold_kernels_unbuilt"] = one_run(args, env, Path(xdg))
    result["runs"]["warm"] = [one_run(args, dict(os.environ)) for _ in range(2)]
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
