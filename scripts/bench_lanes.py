#!/usr/bin/env python
"""Lanes: interactive latency alone, under a bulk job with lanes, and under the same job as FIFO.

One stack, one worker serving both lanes. Interactive requests (`--input-tokens` random prompt
ids, `--output-tokens` tokens with `ignore_eos`) are sent at a steady `--rate` straight to the
broker (`broker.client.BrokerClient`, the client is the edge: TTFT at the first delta carrying
text, TPOT = (total - TTFT) / (tokens - 1)) in three phases:

1. idle: nothing else runs;
2. lanes: a summarization job of `--bulk-lines` real documents (the jobs runner feeds the batch
   lane) saturates the worker; the requests go on the interactive lane;
3. FIFO: the same kind of job again, and the requests go on the **batch** lane, so they wait in
   one first-in-first-out queue with the bulk lines (the single-lane contrast).

4. batch alone: the same kind of job with no interactive traffic, for as long as phase 2 sent
   requests: the batch lane's throughput (output tokens per second: the engines' generated
   tokens minus the interactive requests') to compare phase 2's with. Beside it, the batch
   lane's work per second (`batch_total_tok_s`: prompt positions computed plus output tokens,
   the interactive requests' own taken out) and its ratio: a window shorter than a bulk job's
   wave of prefills and decodes sees a different mix of the two in each phase, and the
   output-token ratio counts the decodes only (the verdict still uses it).

Each bulk phase starts measuring (and sending) once its job has completed
`--batch-warmup-lines` lines: a job's first seconds are the prefill of every prompt the worker
admits, with no output tokens, and a 32 s window that includes them measured the ramp-up more
than the lane (twice as much on a machine twice as slow).

A job is cancelled after its phase and the stack drains before the next one. Targets (issue 19,
no engine flags): with lanes, TTFT P99 under load <= 2x idle TTFT P50, TPOT P99 under load <=
1.5x idle TPOT P50, and batch throughput beside the interactive traffic >= 70 % of batch alone.
`--variants 'slo=;fixed=--no-slo-control'` runs the same phases on each stack in turn and prints
them side by side; `--slowdown 2` makes every model call of the worker take twice as long (a
machine twice as slow, `LANESERVE_FAULT_SLOWDOWN`; its start-up profile and cached step costs
stay the real machine's, so the controller must adapt online). `--rounds N` runs everything N
times, each time on a fresh stack (variants round-robin), and reports each ratio's median over
the rounds beside every round's own (`ratios_per_round`, `rounds_met`): a bulk job's output comes
in waves (its prompts are admitted, prefilled and finished together), so one 32 s window's batch
throughput swings by tens of percent on the same code. Prints JSON and writes a PNG to `--out`.

    python scripts/bench_lanes.py --rate 0.5 --interactive 8 --bulk-lines 64 --max-num-seqs 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from benchlib import (  # noqa: E402
    RequestResult,
    add_stack_args,
    bench_stack,
    client_figures,
    log,
    machine,
    random_prompt,
    server_figures,
    server_rows,
    variants,
)

PER_REQUEST = ("queue_ms", "prefill_ms", "ttft_ms", "tpot_ms", "preemptions", "prefill_chunks")


async def one_request(bc, lane: str, ids: list[int], max_tokens: int) -> RequestResult:
    from laneserve.broker import protocol as p

    res = RequestResult(sent=time.perf_counter())
    stream = bc.submit(
        lane=lane,
        prompt_token_ids=ids,
        sampling_params={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
    )
    res.request_id = stream.request_id
    async for msg in stream:
        now = time.perf_counter()
        if isinstance(msg, p.Delta):
            if msg.text:
                res.chunk_times.append(now)
                if res.ttft_s is None:
                    res.ttft_s = now - res.sent
        elif isinstance(msg, p.Final):
            res.tokens = (msg.usage or {}).get("completion_tokens") or 0
            res.total_s = now - res.sent
        else:  # Error
            res.error = f"{msg.code}: {msg.message}"
    return res


async def steady(front: str, lane: str, args, rng: random.Random) -> tuple[list, float]:
    """`args.interactive` requests, one every 1/rate s, on `lane`; wait for all (bounded)."""
    from laneserve.broker.client import BrokerClient

    async with BrokerClient(front, liveness_s=60.0) as bc:
        tasks = []
        start = time.perf_counter()
        for _ in range(args.interactive):
            ids = random_prompt(rng, args.input_tokens)
            tasks.append(asyncio.create_task(one_request(bc, lane, ids, args.output_tokens)))
            await asyncio.sleep(1.0 / args.rate)
        done, pending = await asyncio.wait(tasks, timeout=args.timeout)
        for t in pending:
            t.cancel()
        results = [t.result() for t in done]
        for _ in pending:
            results.append(RequestResult(error=f"no answer within {args.timeout}s"))
        return results, time.perf_counter() - start


def submit_bulk(engine, args, phase: str) -> str:
    import io

    from laneserve.demo_corpus import build_corpus
    from laneserve.jobs import service

    corpus = build_corpus(args.bulk_lines, 0, strict=False).documents
    if not corpus:
        raise SystemExit("the standard library gave no documents for the bulk job")
    # Every line starts with its phase and copy number (documents are cycled when more lines are
    # asked for than the standard library gives), so no phase finds another's prompts, or a
    # copy its original's, in the prefix cache: each line costs a full prefill.
    docs = [
        (f"{i}#{n // len(corpus)}", f"({phase} {n // len(corpus)}) {t}")
        for n in range(args.bulk_lines)
        for i, t in [corpus[n % len(corpus)]]
    ]
    data = "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs).encode()
    file = service.create_file(engine, io.BytesIO(data), "bulk.jsonl")
    job = service.create_batch(
        engine, file.id, "/v1/chat/completions", task="summarize",
        task_options={"max_tokens": args.bulk_tokens},
    )  # fmt: skip
    return job.id


def wait_busy(front: str, min_in_flight: int, timeout_s: float = 120.0) -> dict:
    from laneserve.broker.client import broker_status

    deadline = time.monotonic() + timeout_s
    st = {}
    while time.monotonic() < deadline:
        try:
            st = broker_status(front, timeout_s=5.0)
        except TimeoutError:  # a busy machine: ask again
            continue
        if st["queues"].get("in_flight", 0) >= min_in_flight:
            return st
        time.sleep(0.5)
    raise RuntimeError(f"worker not saturated after {timeout_s}s: {st.get('queues')}")


def wait_idle(front: str, timeout_s: float = 180.0) -> None:
    from laneserve.broker.client import broker_status

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            q = broker_status(front, timeout_s=5.0)["queues"]
        except TimeoutError:  # a busy machine: ask again
            continue
        if q.get("in_flight", 0) == 0 and q.get("batch", 0) == 0 and q.get("interactive", 0) == 0:
            return
        time.sleep(0.5)
    log("warning: the stack did not drain; the next phase starts anyway")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=0.5, help="interactive requests/s")
    parser.add_argument("--interactive", type=int, default=8, help="requests per phase")
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--bulk-lines", type=int, default=64)
    parser.add_argument("--bulk-tokens", type=int, default=48)
    parser.add_argument("--timeout", type=float, default=300.0, help="s to wait for a phase")
    parser.add_argument(
        "--batch-warmup-lines",
        type=int,
        default=32,
        help="a bulk phase measures from when its job completed this many lines (steady state; "
        "at most half of --bulk-lines)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the phases this many times, each on a fresh stack (variants round-robin); "
        "the ratios become the medians of each round's own ratios",
    )
    parser.add_argument(
        "--phases",
        default="idle,lanes,fifo,batch_alone",
        help="phases to run, in this order (idle and lanes are needed for the ratios; fifo "
        "takes longest: its requests queue behind the whole job)",
    )
    add_stack_args(parser)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    names = [name for name, _ in variants(args)]
    if len(set(names)) != len(names):
        parser.error(f"--variants names must differ, got {names}")
    report = {
        "benchmark": "lanes",
        "machine": machine(),
        "config": {
            k: getattr(args, k)
            for k in (
                "rate",
                "interactive",
                "input_tokens",
                "output_tokens",
                "bulk_lines",
                "bulk_tokens",
                "dtype",
                "max_num_seqs",
                "slowdown",
                "batch_warmup_lines",
                "rounds",
            )
        },  # fmt: skip
        "variants": {},
    }
    named = variants(args)
    rounds: dict[str, list[dict]] = {name: [] for name, _ in named}
    for k in range(args.rounds):  # round-robin: each variant once per round, on a fresh stack
        for name, extra in named:
            log(f"round {k + 1}/{args.rounds}, variant {name}: laneserve up "
                f"{' '.join(extra) or '(no extra flags)'}")  # fmt: skip
            phases = run_phases(args, extra, random.Random(k))
            rounds[name].append({"phases": phases, **verdict(phases)})
    for name, extra in named:
        report["variants"][name] = {"up_args": extra, **merge_rounds(rounds[name])}
    first = next(iter(report["variants"].values()))
    report["phases"] = first["phases"]
    report["target"] = (
        "with lanes: TTFT P99 <= 2x idle P50, TPOT P99 <= 1.5x idle P50, batch throughput "
        ">= 70% of batch alone"
    )
    report["side_by_side"] = {
        name: {
            k: v[k] for k in ("ratios", "target_met", "ratios_per_round", "rounds_met") if k in v
        }
        for name, v in report["variants"].items()
    }
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "bench_lanes.png"
    plot(report["phases"], png)
    report["plot"] = str(png)
    print(json.dumps(report, indent=2))
    return 0


def run_phases(args, extra: list[str], rng: random.Random) -> dict:
    """The four phases (module docstring) on one fresh stack (`laneserve up` + `extra`)."""
    phases: dict = {}
    with bench_stack(args, extra) as info:
        from laneserve.db.session import make_engine
        from laneserve.jobs import service

        front = info["broker_front"]
        engine = make_engine(info["db_url"])
        saturated = (args.max_num_seqs or 16) // 2
        asyncio.run(steady(front, "interactive", argparse.Namespace(**{**vars(args),
                    "interactive": 1}), rng))  # fmt: skip  # warm-up
        wanted = args.phases.split(",")
        for phase, lane, bulk in (
            ("idle", "interactive", False),
            ("lanes", "interactive", True),
            ("fifo", "batch", True),
            ("batch_alone", None, True),
        ):
            if phase not in wanted:
                continue
            job_id = None
            if bulk:
                job_id = submit_bulk(engine, args, phase)
                st = wait_busy(front, saturated)
                log(f"{phase}: bulk job {job_id} running, queues {st['queues']}")
                warmup = min(args.batch_warmup_lines, args.bulk_lines // 2)
                if not _wait_lines(service, engine, job_id, warmup, args.timeout):
                    log(f"warning: {warmup} lines not completed in {args.timeout} s; measuring")
                tokens0, prefill0, t0 = _generated(front)
                done0 = _completed(service, engine, job_id)
            if lane is None:  # batch alone, as long as the interactive phases send
                time.sleep(args.interactive / args.rate)
                results, wall = [], 0.0
            else:
                log(f"{phase}: {args.interactive} requests at {args.rate}/s on the {lane} lane")
                results, wall = asyncio.run(steady(front, lane, args, rng))
            entry: dict = {"lane": lane}
            if results:
                rows = server_rows(info["db_url"], [r.request_id for r in results if r.request_id])
                entry |= {
                    "client": client_figures(results, wall),
                    "server": server_figures(info["db_url"], results),
                    # per request, to see where the time goes (ms, from SQL)
                    "requests": [
                        {k: rows.get(r.request_id, {}).get(k) for k in PER_REQUEST}
                        | {"client_ttft_ms": round(r.ttft_s * 1000, 1) if r.ttft_s else None}
                        for r in results
                    ],
                }
                c, srv = entry["client"], entry["server"]
                log(f"  TTFT {c['ttft_ms']}, TPOT {c['tpot_ms']}, errors {c['errors']}")
                log(f"  server queue {srv['queue_ms']}, prefill {srv['prefill_ms']}")
            if job_id:
                tokens1, prefill1, t1 = _generated(front)
                span = t1 - t0
                lines = _completed(service, engine, job_id) - done0
                # engine output tokens minus the interactive requests' own
                tokens = tokens1 - tokens0 - sum(r.tokens or 0 for r in results)
                # prompt positions computed minus the interactive prompts' (random ids: no
                # prefix-cache hits; counted once each, so an interactive request that failed
                # before its prefill or was preempted and prefilled again shifts this by its
                # prompt)
                prefill = prefill1 - prefill0 - args.input_tokens * len(results)
                entry["batch_lines_per_s"] = round(lines / span, 3)
                entry["batch_tok_s"] = round(tokens / span, 1)
                entry["batch_total_tok_s"] = round((tokens + prefill) / span, 1)
                log(
                    f"  batch lane: {entry['batch_tok_s']} output tok/s, "
                    f"{entry['batch_total_tok_s']} prompt + output tok/s, {lines / span:.2f} lines/s"
                )
                row = service.get_batch(engine, job_id)
                entry["bulk_job"] = {"id": job_id, "status": row.status, **row.request_counts}
                if not service.is_terminal(row.status):
                    service.cancel_batch(engine, job_id)
                wait_idle(front)
            phases[phase] = entry
        engine.dispose()
    return phases


def _generated(front: str, fresh_s: float = 2.5) -> tuple[int, int, float]:
    """(output tokens the workers generated so far, prompt positions they computed so far (their
    engines' cumulative `num_generated_tokens`, `num_prefill_tokens`), the `time.perf_counter()`
    they held at). The counts ride on the workers' heartbeats (one a second by default), so a
    plain read can be a second old: at the end of a short window on a slow machine that
    undercounted the window's tokens, even below the interactive requests' own (a negative batch
    figure). So wait for the counts to move (the next heartbeat) and take the time then; counts
    that do not move in `fresh_s` (nothing running) held at the first read. With several workers
    the sums move at the first one's heartbeat (the bench runs one); a status read that times out
    while waiting counts as no change."""
    from laneserve.broker.client import broker_status

    def count(timeout_s: float = 30.0) -> tuple[int, int]:
        workers = broker_status(front, timeout_s=timeout_s)["workers"]
        loads = [w.get("load") or {} for w in workers]
        return (
            sum(int(load.get("num_generated_tokens") or 0) for load in loads),
            sum(int(load.get("num_prefill_tokens") or 0) for load in loads),
        )

    first, t_first = count(), time.perf_counter()
    while time.perf_counter() < t_first + fresh_s:
        time.sleep(0.05)
        try:
            now = count(timeout_s=1.0)
        except TimeoutError:
            continue
        if now != first:
            return *now, time.perf_counter()
    return *first, t_first


def _completed(service, engine, job_id: str) -> int:
    return int(service.get_batch(engine, job_id).request_counts.get("completed", 0))


def _wait_lines(service, engine, job_id: str, lines: int, timeout_s: float) -> bool:
    """Until the job completed `lines` lines (True), past its ramp-up (the first seconds of a
    job are the prefill of every prompt the worker admits, with no output tokens yet), or
    `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while _completed(service, engine, job_id) < lines:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def verdict(phases: dict) -> dict:
    """The issue's ratios and whether they meet its targets."""
    idle, lanes = (phases[k]["client"] for k in ("idle", "lanes"))
    fifo = phases["fifo"]["client"] if "fifo" in phases else None

    def ratio(a, b):
        return round(a / b, 2) if a is not None and b else None

    r = {
        "lanes_ttft_p99_over_idle_p50": ratio(lanes["ttft_ms"]["p99"], idle["ttft_ms"]["p50"]),
        "lanes_tpot_p99_over_idle_p50": ratio(lanes["tpot_ms"]["p99"], idle["tpot_ms"]["p50"]),
        "fifo_ttft_p99_over_idle_p50": fifo
        and ratio(fifo["ttft_ms"]["p99"], idle["ttft_ms"]["p50"]),
        "fifo_tpot_p99_over_idle_p50": fifo
        and ratio(fifo["tpot_ms"]["p99"], idle["tpot_ms"]["p50"]),
        "batch_with_interactive_over_alone": ratio(
            phases["lanes"]["batch_tok_s"], phases.get("batch_alone", {}).get("batch_tok_s")
        ),
        # the same by work done: prompt positions computed + output tokens (reported beside)
        "batch_total_with_interactive_over_alone": ratio(
            phases["lanes"].get("batch_total_tok_s"),
            phases.get("batch_alone", {}).get("batch_total_tok_s"),
        ),
    }
    return {"ratios": r, "target_met": targets_met(r)}


def targets_met(r: dict) -> bool:
    """Issue 19's targets on a `verdict` ratios dict: TTFT P99 <= 2x and TPOT P99 <= 1.5x the
    idle P50, batch beside interactive >= 0.7x batch alone."""
    return bool(
        all(
            v is not None and v <= bound
            for v, bound in ((r["lanes_ttft_p99_over_idle_p50"], 2.0),
                             (r["lanes_tpot_p99_over_idle_p50"], 1.5))
        ) and (r["batch_with_interactive_over_alone"] or 0) >= 0.7
    )  # fmt: skip


def merge_rounds(rounds: list[dict]) -> dict:
    """One variant's rounds (each ``{"phases", "ratios", "target_met"}``) -> its report entry.
    One round: that round as it is. Several: ``phases`` of the first round (the plot),
    ``ratios`` the median of each ratio over the rounds that have it (the machine drifts and a
    bulk job's throughput comes in waves of prefill and decode, so one 32 s window's batch ratio
    can land 0.15 either side of its mean), ``target_met`` judged on those medians,
    ``ratios_per_round`` (None where a round lacks the ratio), ``rounds_met`` (rounds meeting
    every target on their own ratios) and every round's phases under ``per_round``. Each median
    may come from a different round, so the medians can meet every target with ``rounds_met``
    0; a round without a ratio (a phase that failed) counts against ``rounds_met`` only."""
    if len(rounds) == 1:
        return dict(rounds[0])
    keys = list(rounds[0]["ratios"])
    per_round = {k: [r["ratios"].get(k) for r in rounds] for k in keys}
    medians = {
        k: round(statistics.median(known), 2) if (known := [v for v in vals if v is not None])
        else None
        for k, vals in per_round.items()
    }  # fmt: skip
    return {
        "phases": rounds[0]["phases"],
        "ratios": medians,
        "target_met": targets_met(medians),
        "ratios_per_round": per_round,
        "rounds_met": sum(bool(r["target_met"]) for r in rounds),
        "per_round": [r["phases"] for r in rounds],
    }


def plot(phases: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = {k: v for k, v in phases.items() if "client" in v}
    names = list(phases)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [phases[n]["client"][key]["p50"] or 0 for n in names], 0.4,
               label="P50")  # fmt: skip
        ax.bar([i + 0.2 for i in x], [phases[n]["client"][key]["p99"] or 0 for n in names], 0.4,
               label="P99")  # fmt: skip
        ax.set_xticks(list(x), names)
        ax.set(ylabel="ms", title=f"interactive {title}", yscale="log")
        ax.legend()
    fig.suptitle("interactive lane: idle, under a bulk job with lanes, and as one FIFO lane")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
