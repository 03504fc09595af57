"""The `Engine` protocol the worker drives: both engines (and the fault wrapper) implement it with
the same signatures, a worker process serves with each, the engine config it was given is what it
announces, the engine's step reads no environment variable, and the test-only step fault fails
that step's requests through the engine's own recovery."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from laneserve.commands.status import kv_pool_text
from laneserve.gpu_worker.config import EngineConfig
from laneserve.gpu_worker.engine import LLMEngine
from laneserve.gpu_worker.engine_protocol import Engine
from laneserve.gpu_worker.faults import FaultInjectingEngine, FaultPlan, with_faults
from laneserve.gpu_worker.sampling_params import SamplingParams
from laneserve.gpu_worker.synthetic import SyntheticEngine

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("add_request", "add", "step", "abort_request", "has_unfinished_requests", "stats")


def _params(func) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values()]


@pytest.mark.parametrize("cls", [LLMEngine, SyntheticEngine, FaultInjectingEngine])
def test_engine_classes_have_the_protocol_signatures(cls):
    for name in METHODS:
        assert _params(getattr(cls, name)) == _params(getattr(Engine, name)), (cls, name)


def test_instances_satisfy_the_protocol(base_llm):
    synthetic = SyntheticEngine(step_s=0)
    assert isinstance(synthetic, Engine) and synthetic.model_name == "synthetic"
    assert isinstance(base_llm.engine, Engine) and base_llm.engine.model_name
    assert with_faults(synthetic, FaultPlan()) is synthetic  # nothing to inject: no wrapper
    wrapped = with_faults(synthetic, FaultPlan(crash_marker="X"))
    assert isinstance(wrapped, Engine) and wrapped.model_name == "synthetic"


class _TracingEnviron(dict):
    """os.environ stand-in that records every variable looked up, with the reading file."""

    def __init__(self, data):
        super().__init__(data)
        self.reads: list[tuple[str, str]] = []

    def _record(self, key):
        frame = sys._getframe(2)
        skip = (os.path.normpath(os.__file__), str(ROOT / "contracts" / "env.py"))
        while frame is not None and os.path.normpath(frame.f_code.co_filename) in skip:
            frame = frame.f_back
        self.reads.append((str(key), frame.f_code.co_filename if frame else "?"))

    def get(self, key, default=None):
        self._record(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._record(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._record(key)
        return super().__contains__(key)


def test_engine_step_reads_no_environment(base_llm, monkeypatch):
    """Only the kernels' documented per-op backend override is looked up during steps."""
    engine = base_llm.engine
    tracing = _TracingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", tracing)
    engine.add_request(
        "env", prompt_token_ids=list(range(200, 240)), sampling_params={"max_tokens": 4}
    )
    while engine.has_unfinished_requests():
        engine.step()
    kernels_init = str(ROOT / "kernels" / "__init__.py")
    others = {(name, path) for name, path in tracing.reads if path != kernels_init}
    assert others == set(), others
    assert {name for name, _ in tracing.reads} <= {"LANESERVE_ATTENTION_BACKEND"}


def test_step_fault_fails_that_step_through_the_engines_recovery(make_llm):
    llm = make_llm(num_blocks=64)
    engine = with_faults(llm.engine, FaultPlan(step_marker="POISON"))
    # greedy: an unseeded sampled request may draw EOS inside 4 tokens (CI saw 'stop' once)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("bad", engine.prompts.encode("a POISON prompt"), params)
    engine.add_request("good", engine.prompts.encode("a fine prompt"), params)
    finals = {}
    for _ in range(50):
        for d in engine.step():
            if d.finished:
                finals[d.request_id] = d
        if not engine.has_unfinished_requests():
            break
    # both shared the first step: both fail there (the semantics of a forward that raises)
    assert finals["bad"].finish_reason == "error" and "injected fault" in finals["bad"].error
    assert finals["good"].finish_reason == "error"
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    engine.add_request("after", engine.prompts.encode("a fine prompt"), params)
    out = []
    while engine.has_unfinished_requests():
        out += [d for d in engine.step() if d.finished]
    assert [d.finish_reason for d in out] == ["length"]
    llm.check_integrity()


def test_slowdown_fault_stretches_every_model_call(make_llm, monkeypatch):
    """LANESERVE_FAULT_SLOWDOWN=3: each model call takes 3x its own time (the SLO adaptation
    benchmark's machine three times slower); a factor below 1 is refused."""
    monkeypatch.setenv("LANESERVE_FAULT_SLOWDOWN", "3")
    plan = FaultPlan.from_env()
    assert plan.slowdown == 3.0 and plan.enabled
    for bad in (0.5, float("inf")):
        with pytest.raises(ValueError, match="LANESERVE_FAULT_SLOWDOWN"):
            FaultPlan(slowdown=bad)
    llm = make_llm(num_blocks=64)
    inner: list[float] = []
    real = llm.engine.execute_model

    def timed(out):
        started = time.perf_counter()
        try:
            return real(out)
        finally:
            inner.append(time.perf_counter() - started)

    llm.engine.execute_model = timed
    engine = with_faults(llm.engine, plan)
    params = SamplingParams(max_tokens=4, ignore_eos=True)  # 4 model calls, whatever it samples
    engine.add_request("r", engine.prompts.encode("a prompt"), params)
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        n = len(inner)
        engine.step()
        if len(inner) > n:
            assert time.perf_counter() - started >= 3 * inner[-1] * 0.95
    assert len(inner) >= 4
    llm.check_integrity()


# ----------------------------------------------------------------- a worker process with each


class _Processes:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.front, self.back = f"ipc://{tmp}/f.sock", f"ipc://{tmp}/b.sock"
        self.procs: list[subprocess.Popen] = []

    def spawn(self, name: str, module: str, *args: str) -> None:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *args], stdout=log, stderr=log, env=env, cwd=ROOT
            )
        )
        log.close()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in self.tmp.glob("*.log"))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def procs(tmp_path_factory) -> Iterator[_Processes]:
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="lsp", dir="/tmp"))  # short ipc paths
    stack = _Processes(tmp)
    stack.spawn("broker", "laneserve.commands.broker", "--front", stack.front, "--back", stack.back)
    try:
        yield stack
    finally:
        stack.stop()


def _wait_worker(stack: _Processes, timeout_s: float) -> dict:
    from laneserve.broker.client import broker_status

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            workers = broker_status(stack.front, timeout_s=1.0)["workers"]
        except TimeoutError:
            workers = []
        if workers:
            return workers[0]
        time.sleep(0.2)
    raise AssertionError(f"no worker registered:\n{stack.logs()}")


async def _generate(front: str, max_tokens: int) -> tuple[list[str], str, dict]:
    from laneserve.broker.client import BrokerClient

    async with BrokerClient(front) as client:
        stream = client.submit(
            lane="interactive",
            prompt="Name a color.",
            sampling_params={"max_tokens": max_tokens, "ignore_eos": True},
        )
        kinds, last = [], None
        async for item in stream:
            kinds.append(type(item).__name__)
            last = item
    return kinds, getattr(last, "finish_reason", repr(last)), getattr(last, "usage", {})


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["synthetic", "real"])
def test_worker_serves_with_each_engine_and_announces_its_config(engine, procs, smollm2_dir):
    config = EngineConfig(
        model=str(smollm2_dir), dtype="float32", block_size=32, max_num_seqs=5,
        max_num_batched_tokens=40, kv_cache_memory_bytes=32 * 2**20,
        interactive_batch_token_cap=6, batch_token_budget=24, lanes=("interactive",),
    )  # fmt: skip
    args = ["--broker", procs.back, "--worker-id", "w", "--engine-config", config.to_json()]
    procs.spawn("worker", "laneserve.commands.worker", *args, "--max-num-seqs", "6",
                *(["--synthetic"] if engine == "synthetic" else []))  # fmt: skip
    worker = _wait_worker(procs, timeout_s=120)
    announced = worker["info"]["engine"]
    # the flag overrides the JSON; the worker resolves slo_control (on for a real engine)
    assert announced == {**config.to_dict(), "max_num_seqs": 6, "slo_control": engine == "real"}
    assert worker["lanes"] == ["interactive"] and worker["capacity"] == 12
    pool = worker["info"]["kv_pool"]  # the chosen KV numbers, as `laneserve status` shows them
    assert pool["block_size"] == 32 and pool["num_tokens"] == pool["num_blocks"] * 32
    assert kv_pool_text(pool).startswith(f"{pool['num_blocks']} x 32 = {pool['num_tokens']} tok")
    if engine == "real":
        per_block = pool["kv_cache_bytes"] // pool["num_blocks"]
        assert 32 * 2**20 - per_block < pool["kv_cache_bytes"] <= 32 * 2**20, pool
        assert pool["dtype"] == "float32" and pool["activation_bytes"] is None, pool  # CPU
        assert "GiB float32" in kv_pool_text(pool)
    assert (worker["model"] == "synthetic") == (engine == "synthetic") and worker["model"]
    kinds, reason, usage = asyncio.run(asyncio.wait_for(_generate(procs.front, 5), 120))
    assert kinds[-1] == "Final" and reason == "length", (kinds, reason, procs.logs())
    assert usage["completion_tokens"] == 5


def test_synthetic_cost_scale_paces_every_step():
    engine = SyntheticEngine(step_s=0.01, prefill_s=0.002, cost_scale=2.0)
    assert (engine.step_s, engine.prefill_s) == (0.02, 0.004)
    engine.add_request("r", engine.prompts.encode("a b c"), {"max_tokens": 4})
    t0 = time.monotonic()
    while engine.has_unfinished_requests():
        engine.step()
    assert time.monotonic() - t0 >= 3 * 0.02  # paced steps: 4 tokens, 3 waits at least
    with pytest.raises(ValueError):
        SyntheticEngine(cost_scale=0)


async def _submit_text(front: str, prompts: list[dict]) -> list[object]:
    """Each prompt form (``prompt=`` or ``messages=``) sent as text, one at a time: its last
    message (a Final or an Error)."""
    from laneserve.broker.client import BrokerClient

    lasts = []
    async with BrokerClient(front) as client:
        for form in prompts:
            stream = client.submit(lane="interactive", sampling_params={"max_tokens": 2}, **form)
            last = None
            async for last in stream:  # noqa: B007 - the last message is the answer
                pass
            lasts.append(last)
    return lasts


@pytest.mark.slow
def test_the_worker_front_end_tokenizes_text_and_answers_bad_prompts(procs, smollm2_dir):
    """A sender without a tokenizer sends text: the worker's front end (`engine.prompts`, the
    edge's rule) tokenizes it once before the engine, which takes ids only. An empty prompt and
    an over-long one come back as typed errors for that request; the worker keeps serving."""
    from laneserve.broker import protocol as p
    from laneserve.contracts.tokens import PromptTokenizer, prompt_ids

    config = EngineConfig(model=str(smollm2_dir), dtype="float32", max_model_len=64,
                          kv_cache_memory_bytes=8 * 2**20, lanes=("interactive",))  # fmt: skip
    procs.spawn("worker", "laneserve.commands.worker", "--broker", procs.back,
                "--worker-id", "w", "--engine-config", config.to_json())  # fmt: skip
    _wait_worker(procs, timeout_s=120)
    chat = [{"role": "user", "content": "Name a color."}]
    forms = [{"prompt": ""}, {"prompt": "word " * 200}, {"messages": chat}, {"prompt": "Hi"}]
    empty, long, good_chat, good_text = asyncio.run(
        asyncio.wait_for(_submit_text(procs.front, forms), 120)
    )
    assert type(empty) is p.Error and empty.code == "invalid_request", empty
    assert "empty" in empty.message
    assert type(long) is p.Error and long.code == "prompt_too_long", long
    assert "max_model_len=64" in long.message
    expected = prompt_ids(PromptTokenizer.load(smollm2_dir), messages=chat)
    assert type(good_chat) is p.Final and good_chat.finish_reason == "length", procs.logs()
    assert good_chat.usage["prompt_tokens"] == len(expected)  # the edge's rule, at the worker
    assert type(good_text) is p.Final and good_text.usage["completion_tokens"] == 2
    # four prompts templated or tokenized once each, by the worker's front end
    deadline = time.monotonic() + 10
    while (load := _wait_worker(procs, 10).get("load") or {}).get("num_prompts_tokenized") != 4:
        assert time.monotonic() < deadline, (load, procs.logs())
        time.sleep(0.2)
