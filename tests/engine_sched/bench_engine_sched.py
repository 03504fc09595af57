"""Scheduler + block-manager overhead per engine step, without a model; prints JSON.

    python tests/engine_sched/bench_engine_sched.py [--running 256] [--steps 200]

Figures: ms per decode step with `--running` requests decoding (schedule + update_after_step +
appending one fake token each), and ms per step while `--running` requests sharing a 512-token
preamble are admitted under a 2048-token budget (prefix-cache lookups, chunked prefill).
"""

from __future__ import annotations

import argparse
import json
import time

from laneserve.gpu_worker.block_manager import BlockManager
from laneserve.gpu_worker.request import Request, RequestStatus
from laneserve.gpu_worker.scheduler import Scheduler
from laneserve.gpu_worker.scheduler_config import SchedulerConfig


def one_step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update_after_step(out)
    for e in out.scheduled:
        if e.samples:
            e.request.append_output_token_ids(1)
            if e.request.num_output_tokens >= e.request.sampling_params:
                sched.finish_request(e.request, RequestStatus.FINISHED_LENGTH)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    bm = BlockManager(num_blocks=40_000, block_size=16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=args.running, max_model_len=4096), bm)
    preamble = [7] * 512
    for i in range(args.running):
        sched.add_request(Request(f"r{i}", preamble + [i + 10] * 64, 10**6))
    t0 = time.perf_counter()
    prefill_steps = 0
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        one_step(sched)
        prefill_steps += 1
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        one_step(sched)
    decode_s = time.perf_counter() - t0
    bm.check_integrity()
    print(
        json.dumps(
            {
                "running": args.running,
                "admission_steps": prefill_steps,
                "admission_ms_per_step": round(prefill_s / prefill_steps * 1e3, 3),
                "decode_ms_per_step": round(decode_s / args.steps * 1e3, 3),
                "decode_us_per_request": round(decode_s / args.steps / args.running * 1e6, 2),
                "prefix_cache_hit_rate": round(
                    bm.prefix_cache_hits / max(bm.prefix_cache_queries, 1), 3
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
