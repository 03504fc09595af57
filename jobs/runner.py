"""The jobs runner (`laneserve jobs-runner`): runs bulk jobs from SQL through the batch lane.

One asyncio loop, one broker client (lane `batch`, `stream=False`):

- polls `jobs` every `poll_interval_s` for work: validates `validating` jobs (in a thread,
  one at a time; `jobs.store.validate_job`), feeds `in_progress` ones, ends `cancelling` and
  expired ones, finishes `finalizing` ones;
- feeds lines through a bounded window: at most `max_in_flight` lines in flight in total and
  `window` per job, taken round-robin between jobs, read from SQL a page at a time, so memory
  does not grow with the file (the rest waits in SQL, DESIGN.md "Lanes");
- writes results in small batched transactions that only fill unfinished lines
  (`jobs.store.write_outcomes`), so a replay after a crash never duplicates a line;
- retries: a broker restart reaches its lines only as latency (`broker.client` resubmits what had
  not finished, docs/reliability.md); a `worker_lost` error still marked retryable, or
  `overloaded`, is resubmitted with the same request id without counting an attempt;
  the broker's final `worker_lost` (after its 3 dispatches) goes to the error file with the
  attempt count;
- cancel (`cancelling`): in-flight lines are aborted, finished results kept, the rest get
  `batch_cancelled` error lines, status `cancelled`; expiry alike with `batch_expired`;
- when every line of a job has a result: `finalizing`, output + error files, `completed`;
- several runners share one database through expiring leases (`jobs.leases`, kept by the
  runner's `LeaseKeeper`, `jobs.runner_leases`): a runner
  validates, ends or finalizes a job only while it holds the job's control lease, and feeds only
  the line ranges it has claimed; it renews its leases every `lease_s / 3`, abandons the lines of
  a lease it lost, releases them all when it stops, and takes over the lapsed leases of a
  runner that died (after `lease_s`);
- with `retention_s` > 0, a pruning pass (`jobs.retention.prune`) at start and every
  `retention_interval_s`, on the SQL thread, logged as one line with its counts.

The runner holds three collaborators, each given what it uses: `lease_keeper`
(`jobs.runner_leases.LeaseKeeper`: the leases), `outage_keeper` (`jobs.runner_outage.OutageKeeper`:
polling and writing through a database outage) and `map_reducer` (`jobs.map_reduce.MapReducer`:
documents longer than the context).

A runner killed at any point resumes on restart: a half-validated job is validated again, the
unfinished lines of running jobs are resubmitted with their ids, finalization is redone. A
restart with the same `runner_id` reclaims its own leases at once; another id waits `lease_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from laneserve.broker import protocol as p
from laneserve.broker.client import BrokerClient
from laneserve.contracts import defaults
from laneserve.contracts.engine_io import EngineRequest, TextRequest
from laneserve.contracts.openai import ServedModel
from laneserve.contracts.procs import parent_gone
from laneserve.db.availability import Outage
from laneserve.jobs import leases, results, retention, store
from laneserve.jobs.map_reduce import MapReducer
from laneserve.jobs.runner_leases import LeaseKeeper
from laneserve.jobs.runner_outage import OutageKeeper

logger = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT = 256  # lines in flight over all jobs (the broker's batch queue is 20k)
LINE_PAGE = 128  # lines read from SQL at a time per job
FLUSH_MAX = 256  # results are written every 0.1 s (runner_outage) or when this many wait
RETRY_BACKOFF_S = (0.2, 5.0)  # first and max sleep before resubmitting a retryable error
RETRYABLE = ("worker_lost", "overloaded", "no_worker")
MAX_VALIDATION_ATTEMPTS = 3  # a job whose validation raises this often fails (`_maybe_validate`)
VALIDATION_RETRY_S = 2.0  # between two validations of a job whose validation raised


@dataclass
class ActiveJob:
    """Runner-side state of one in_progress job."""

    info: store.JobInfo
    cursor: str = ""  # last request id read from SQL, inside `lease`
    lease: leases.Lease | None = None  # the claimed line range being read
    buffer: deque[store.PendingLine] = field(default_factory=deque)
    exhausted: bool = False  # no line range left to claim (until the next poll)
    idle: bool = False  # every claimable line is done; others' lines are open (until next poll)
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)


class JobsRunner:
    """Runs jobs until `stop()`. `counter` is the served model (`contracts.openai.ServedModel`:
    names, tokenizer; None skips model-name and prompt-length checks); `default_model` names
    the model of lines that give none."""

    def __init__(
        self,
        engine: Engine,
        broker_addr: str,
        *,
        counter=None,
        default_model: str | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        window: int | None = None,
        poll_interval_s: float = 0.5,
        parent_pid: int | None = None,
        client_liveness_s: float = defaults.CLIENT_LIVENESS_S,
        retention_s: float = 0.0,
        retention_interval_s: float = retention.DEFAULT_INTERVAL_S,
        runner_id: str | None = None,
        lease_s: float = leases.DEFAULT_LEASE_S,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        self.engine = engine
        self.broker_addr = broker_addr
        self.counter = counter
        self.default_model = default_model
        self.max_in_flight = max_in_flight
        self.window = window or max_in_flight
        self.poll_interval_s = poll_interval_s
        self.parent_pid = parent_pid
        self.client_liveness_s = client_liveness_s
        self.retention_s = retention_s  # 0: keep everything
        self.retention_interval_s = retention_interval_s
        self.runner_id = runner_id or f"{socket.gethostname()}-{os.getpid()}"
        self.lease_s = lease_s
        self.active: dict[str, ActiveJob] = {}
        self.counters: dict[str, int] = {
            "lines_sent": 0,
            "resubmitted": 0,
            "results": 0,
            "flushes": 0,
            "ranges_claimed": 0,
            "ranges_taken_over": 0,
            "leases_lost": 0,
        }
        self.client: BrokerClient | None = None
        self._validating: asyncio.Task | None = None
        self._validating_id: str | None = None
        self._validation_failures: Counter[str] = Counter()
        self._validation_retry_at: dict[str, float] = {}  # monotonic s, per job id
        self._pruning: asyncio.Task | None = None
        self._outcomes: list[store.Outcome] = []
        self._flush_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._rr = 0
        # One thread (so one pooled connection, one SQLite page cache, one malloc arena) for
        # every SQL call of the loop: memory stays flat and the runner never contends with
        # itself for SQLite's write lock. Validation runs in its own thread.
        self._db = ThreadPoolExecutor(1, thread_name_prefix="jobs-db")
        self.lease_keeper = LeaseKeeper(
            self._sql, self.runner_id, lease_s, self.active, self.counters, self._flush
        )
        self.outage_keeper = OutageKeeper(
            Outage("jobs paused; lines in flight finish, results wait in memory", logger),
            poll_interval_s,
            poll=self._poll,
            flush=self._flush,
            advance=self._advance,
            drop_lapsed=self.lease_keeper.drop_lapsed,
            unwritten=lambda: len(self._outcomes),
        )
        self.map_reducer = MapReducer(counter, self._call, self._outcome)

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Ask `run()` to return (safe from a signal handler on the loop's thread)."""
        self._stop.set()
        self._wake.set()

    async def _sql(self, fn, *args):
        """Run a `jobs.store` function on the SQL thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._db, functools.partial(fn, self.engine, *args))

    @property
    def in_flight(self) -> int:
        return sum(len(aj.tasks) for aj in self.active.values())

    async def run(self) -> None:
        """Serve until `stop()` or the parent process dies. Unfinished lines stay in SQL."""
        self.client = BrokerClient(self.broker_addr, liveness_s=self.client_liveness_s)
        await self.client.start()
        writer = asyncio.create_task(self.outage_keeper.writer_loop(), name="jobs-writer")
        renewer = asyncio.create_task(self.lease_keeper.renew_loop(), name="jobs-leases")
        next_poll = next_prune = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if self.retention_s > 0 and now >= next_prune:  # in the background
                    if self._pruning is None or self._pruning.done():
                        self._pruning = asyncio.create_task(self.prune_once(), name="retention")
                    next_prune = now + self.retention_interval_s
                if now >= next_poll:
                    if self._parent_gone():
                        logger.warning("parent %s is gone: exiting", self.parent_pid)
                        break
                    next_poll = await self.outage_keeper.step()
                elif not self.outage_keeper.down:
                    await self.outage_keeper.work()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    timeout = max(0.0, next_poll - time.monotonic())
                    await asyncio.wait_for(self._wake.wait(), timeout)
        finally:
            tasks = [t for aj in self.active.values() for t in aj.tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for bg in (writer, renewer):
                bg.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await bg
            await self.outage_keeper.flush_before_exit()
            await self.lease_keeper.release_all()
            if self._validating is not None:
                with contextlib.suppress(Exception):
                    await self._validating
            if self._pruning is not None:
                await self._pruning  # prune_once logs its own errors
            await self.client.close()
            self._db.shutdown(wait=True)

    async def prune_once(self) -> retention.PruneCounts | None:
        """One retention pass over data older than `retention_s` (on the SQL thread); logs its
        counts. None when it failed (logged; the next pass retries)."""
        try:
            counts = await self._sql(retention.prune, self.retention_s)
        except Exception:
            logger.exception("retention pass failed")
            return None
        days = self.retention_s / 86400
        logger.info("retention pass (older than %g days): %s", days, counts.describe())
        return counts

    def _parent_gone(self) -> bool:
        return parent_gone(self.parent_pid)

    # ------------------------------------------------------------------ polling

    async def _poll(self) -> None:
        now = time.time()
        to_validate = []
        infos = await self._sql(store.active_jobs)
        for info in infos:
            if info.status == "validating":
                to_validate.append(info.id)
            elif info.status == "in_progress":
                if info.expires_at is not None and now > info.expires_at:
                    await self._end_early(info, "expired")
                elif info.id not in self.active:
                    self.active[info.id] = ActiveJob(info)
                    logger.info("job %s: running", info.id)
                else:  # look again for line ranges freed or lapsed since
                    self.active[info.id].exhausted = self.active[info.id].idle = False
            elif info.status == "cancelling" and info.id != self._validating_id:
                await self._end_early(info, "cancelled")
            elif info.status == "finalizing":
                await self._finish(info.id)
        if to_validate:
            self._maybe_validate(to_validate)
        running = {info.id for info in infos if info.status == "in_progress"}
        for job_id in [j for j in self.active if j not in running]:
            await self._forget(job_id)  # ended by another runner

    async def _forget(self, job_id: str) -> None:
        """Drop a job this runner no longer runs: its lines stop, its leases go back."""
        aj = self.active.pop(job_id)
        tasks = list(aj.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.lease_keeper.release_job(job_id)

    def _maybe_validate(self, job_ids: list[str]) -> None:
        """Validate the first of `job_ids` (oldest first, jobs whose validation raised after
        the others) whose control this runner can claim. A job whose validation raises is
        tried again after `VALIDATION_RETRY_S`, and after `MAX_VALIDATION_ATTEMPTS` failures it
        fails with that error and without lines (a database error is retried, not counted):
        one file the validator could not handle once held every later job in `validating` for
        as long as it stayed."""
        if self._validating is not None and not self._validating.done():
            return
        if self._validating is not None and self._validating.exception() is not None:
            logger.error("validation failed: %r", self._validating.exception())
        now = time.monotonic()
        job_ids = [j for j in job_ids if self._validation_retry_at.get(j, 0.0) <= now]
        job_ids.sort(key=lambda j: self._validation_failures[j])  # stable: oldest first
        if not job_ids:
            return

        async def validate() -> None:
            for job_id in job_ids:
                self._validating_id = job_id  # set first: a poll meanwhile must not end it
                if await self.lease_keeper.claim_control(job_id):
                    break
            else:
                self._validating_id = None
                return  # other runners validate them
            try:
                served = await self._served_model()
                await asyncio.to_thread(
                    store.validate_job, self.engine, job_id, served, self.default_model
                )
            except OperationalError:
                raise  # the database's trouble, not the job's: tried again, not counted
            except Exception as exc:
                self._validation_failures[job_id] += 1
                self._validation_retry_at[job_id] = time.monotonic() + VALIDATION_RETRY_S
                if self._validation_failures[job_id] >= MAX_VALIDATION_ATTEMPTS:
                    msg = f"validation failed {MAX_VALIDATION_ATTEMPTS} times: {exc!r}"
                    logger.error("job %s: %s", job_id, msg)
                    error = {"code": "validation_error", "message": msg[:2000], "line": None}
                    await self._sql(store.fail_validation, job_id, [error])
                raise
            finally:
                self._validating_id = None
                await self.lease_keeper.release_control(job_id)
                self._wake.set()

        self._validating = asyncio.create_task(validate(), name="validate")

    async def _served_model(self) -> ServedModel | None:
        """The counter with the models the broker's workers report as further names (the
        gateway accepts those too) and their largest KV pool (a line that fits none is an error
        line, as the gateway's 400)."""
        if self.counter is None:
            return None
        assert self.client is not None
        try:
            reply = await self.client.status(timeout_s=2.0)
        except TimeoutError:
            return self.counter
        return self.counter.with_workers(reply.workers)

    # ------------------------------------------------------------------ feeding

    async def _feed(self) -> None:
        jobs = list(self.active.values())
        if not jobs:
            return
        self._rr = (self._rr + 1) % len(jobs)
        jobs = jobs[self._rr :] + jobs[: self._rr]
        progress = True
        while progress and self.in_flight < self.max_in_flight:
            progress = False
            for aj in jobs:
                if self.in_flight >= self.max_in_flight:
                    break
                if len(aj.tasks) >= self.window:
                    continue
                if not aj.buffer and not aj.exhausted:
                    await self._refill(aj)
                if aj.buffer:
                    self._start_line(aj, aj.buffer.popleft())
                    progress = True

    async def _refill(self, aj: ActiveJob) -> None:
        """Read the next page of the line range being read, claiming a new range when it is
        read out; `exhausted` when no range is left to claim."""
        job_id = aj.info.id
        while not aj.buffer:
            if aj.lease is None:
                lease = await self.lease_keeper.claim_range(job_id)
                if lease is None:
                    aj.exhausted = True
                    return
                aj.lease, aj.cursor = lease, store.request_id(job_id, lease.first_line - 1)
            lines = await self._sql(
                store.pending_lines, job_id, aj.cursor, LINE_PAGE, aj.lease.last_rid
            )
            if len(lines) < LINE_PAGE:
                aj.lease = None  # read out; `settle_ranges` ends it once its lines are done
            if lines:
                aj.cursor = lines[-1].rid
            aj.buffer.extend(pl for pl in lines if pl.rid not in aj.tasks)

    def _start_line(self, aj: ActiveJob, line: store.PendingLine) -> None:
        task = asyncio.create_task(self._run_line(aj.info, line), name=line.rid)
        aj.tasks[line.rid] = task
        self.counters["lines_sent"] += 1

        def done(_t: asyncio.Task, rid: str = line.rid) -> None:
            aj.tasks.pop(rid, None)
            self._wake.set()

        task.add_done_callback(done)

    async def _advance(self) -> None:
        """Feed, settle ranges, finish jobs (the work of a step, `OutageKeeper.step`)."""
        await self._feed()
        await self.lease_keeper.settle_ranges()
        await self._check_done()

    async def _check_done(self) -> None:
        for aj in list(self.active.values()):
            if not aj.exhausted or aj.idle or aj.buffer or aj.tasks:
                continue
            if self.lease_keeper.holds_ranges(aj.info.id):
                continue  # `settle_ranges` has not ended them yet
            await self._flush()
            total, completed, failed = await self._sql(store.counts, aj.info.id)
            if completed + failed < total:
                unfinished, rows = await self._sql(store.recount, aj.info.id)
                if unfinished:  # lines of other runners' ranges: look again at the next poll
                    aj.idle = True
                    continue
                logger.error(
                    "job %s: counters disagreed with its %d rows; recounted", aj.info.id, rows
                )
            self.active.pop(aj.info.id, None)
            await self._finish(aj.info.id)

    # ------------------------------------------------------------------ one line

    async def _run_line(self, info: store.JobInfo, line: store.PendingLine) -> None:
        request = line.request
        try:
            if request.get("map_reduce"):
                outcome = await self.map_reducer.summarize(info, line)
            else:  # one call per choice (n > 1, several prompts), as the gateway fans out
                model, calls = results.choice_requests(line.rid, request)
                answers = await asyncio.gather(
                    *(
                        self._call(call, model, *((info.id, line.custom_id) if k == 0 else ()))
                        for k, call in enumerate(calls)
                    )
                )
                error = next((e for f, e in answers if f is None), None)
                finals = None if error is not None else [f for f, _ in answers]
                outcome = self._outcome(info, line, finals, error)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not kill the runner: the line fails, named
            logger.exception("line %s failed in the runner", line.rid)
            outcome = store.Outcome(
                info.id, line.rid, results.error_response("internal", f"runner error: {exc}")
            )
        self._outcomes.append(outcome)
        self.counters["results"] += 1
        if len(self._outcomes) >= FLUSH_MAX:
            self._wake.set()

    def _outcome(
        self,
        info: store.JobInfo,
        line: store.PendingLine,
        final: p.Final | list[p.Final] | None,
        error: dict | None,
        extra: dict | None = None,
    ) -> store.Outcome:
        if final is None:
            return store.Outcome(info.id, line.rid, error)
        finals = final if isinstance(final, list) else [final]
        model = line.request["body"].get("model") or info.model
        token_text = None
        sampling = line.request.get("sampling_params") or {}
        if "logprobs" in sampling or "prompt_logprobs" in sampling:
            token_text = self.counter.token_text if self.counter else ServedModel().token_text
        n = int(line.request["body"].get("n") or 1)
        response = results.success_response(
            line.rid,
            line.request["url"],
            model,
            finals,
            extra,
            n=n,
            token_text=token_text,
            body=line.request["body"],
            served=self.counter,
        )
        usage = response["body"]["usage"]
        return store.Outcome(
            info.id,
            line.rid,
            response,
            prompt_tokens=usage.get("prompt_tokens", usage.get("input_tokens")) or None,
            completion_tokens=usage.get("completion_tokens", usage.get("output_tokens", 0)),
            finish_reason=finals[0].finish_reason,
        )

    async def _call(
        self,
        request: EngineRequest | TextRequest,
        model: str | None,
        job_id: str | None = None,
        custom_id: str | None = None,
    ) -> tuple[p.Final | None, dict | None]:
        """One request through the batch lane until a final answer: (Final, None) or
        (None, error response). Retryable errors are resubmitted under the same id."""
        rid = request.request_id
        assert self.client is not None
        backoff = RETRY_BACKOFF_S[0]
        while True:
            last = None
            try:
                stream = self.client.submit_request(
                    request,
                    stream=False,
                    model=model,
                    job_id=job_id,
                    custom_id=custom_id,
                    arrival_time=time.time(),
                )
            except p.ProtocolError as exc:
                return None, results.error_response("invalid_request", str(exc))
            async for msg in stream:
                last = msg
            if type(last) is p.Final:
                return last, None
            assert type(last) is p.Error, last
            if last.code in RETRYABLE and last.retryable:
                self.counters["resubmitted"] += 1
                logger.info("%s: %s (%s); resubmitting", rid, last.code, last.message)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_BACKOFF_S[1])
                continue
            attempts = last.attempts if last.code == "worker_lost" else None
            return None, results.error_response(last.code, last.message, attempts)

    # ------------------------------------------------------------------ writing and ending

    async def _flush(self) -> None:
        async with self._flush_lock:
            if not self._outcomes:
                return
            batch, self._outcomes = self._outcomes, []
            try:
                await self._sql(store.write_outcomes, batch)
            except BaseException:
                self._outcomes[:0] = batch
                raise
            self.counters["flushes"] += 1

    async def _finish(self, job_id: str) -> None:
        """in_progress/finalizing -> finalizing -> files -> completed, under the job's control
        lease (another runner holding it finishes the job instead)."""
        if not await self.lease_keeper.claim_control(job_id):
            return
        try:
            if not await self._sql(store.begin_finalizing, job_id):
                return
            file_ids = await self._sql(store.write_result_files, job_id)
            status = await self._sql(store.end_job, job_id, "completed", ("finalizing",), file_ids)
            logger.info("job %s: %s", job_id, status)
        finally:
            await self.lease_keeper.release_control(job_id)

    async def _end_early(self, info: store.JobInfo, status: str) -> None:
        """Cancel or expire a job: abort its lines, keep finished results, error lines for the
        rest (`batch_cancelled` / `batch_expired`), files, terminal status."""
        if info.id in self.active:
            await self._forget(info.id)
        await self._flush()
        if not await self.lease_keeper.claim_control(info.id):
            return  # the runner holding the job's control ends it
        try:
            code = "batch_cancelled" if status == "cancelled" else "batch_expired"
            message = "the batch was cancelled" if status == "cancelled" else "the batch expired"
            n = await self._sql(store.fail_unfinished, info.id, code, message, status)
            file_ids = await self._sql(store.write_result_files, info.id)
            from_statuses = (
                ("cancelling",) if status == "cancelled" else ("in_progress", "validating")
            )
            final = await self._sql(store.end_job, info.id, status, from_statuses, file_ids)
            logger.info("job %s: %s (%d unfinished lines)", info.id, final, n)
        finally:
            await self.lease_keeper.release_control(info.id)
