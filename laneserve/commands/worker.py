"""`laneserve worker`: one engine process connected to the broker (gpu_worker/worker.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import select
import sys
import time
from typing import TYPE_CHECKING

from laneserve.contracts import defaults
from laneserve.contracts import env as lsenv
from laneserve.gpu_worker.config import (
    EngineConfig,
    EngineConfigError,
    add_engine_arguments,
    config_from_args,
    lane_profile,
)
from laneserve.gpu_worker.openmp import apply_openmp_policy

if TYPE_CHECKING:
    from laneserve.gpu_worker.engine_protocol import Engine

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("worker", help="run one engine worker connected to the broker")
    parser.add_argument(
        "--broker",
        default=None,
        help="broker back endpoint (default: ipc under $LANESERVE_HOME/run)",
    )
    parser.add_argument("--worker-id", default=None, help="default: HOST-PID")
    parser.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="requests held at once (default: 2 x max-num-seqs: batch fills the engine, interactive can still get in)",
    )
    parser.add_argument(
        "--heartbeat-interval", type=float, default=defaults.HEARTBEAT_INTERVAL_S, help="seconds"
    )
    parser.add_argument("--liveness", type=int, default=defaults.LIVENESS)
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process is gone"
    )
    parser.add_argument(
        "--standby",
        action="store_true",
        help="a spare (laneserve/supervisor.py): do the slow imports, then wait for a line on "
        "stdin before starting (exit 0 at end of file)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=defaults.DRAIN_TIMEOUT_S,
        help="seconds to finish work on SIGTERM",
    )
    curve = parser.add_argument_group("CurveZMQ (a broker on another host)")
    curve.add_argument(
        "--curve-server-public", default=None, help="the broker's public key file (server.key)"
    )
    curve.add_argument(
        "--curve-client-key", default=None, help="this worker's key pair (NAME.key_secret)"
    )
    engine = parser.add_argument_group("engine (gpu_worker/config.py)")
    engine.add_argument(
        "--engine-config",
        type=_engine_config_json,
        default=None,
        help="all engine options as one JSON object (what `laneserve up` passes); the flags "
        "below override its fields",
    )
    add_engine_arguments(engine)
    synth = parser.add_argument_group("synthetic engine (tests, benchmarks)")
    synth.add_argument("--synthetic", action="store_true", help="fake tokens, no model")
    synth.add_argument("--synthetic-step-ms", type=float, default=10.0, help="ms per engine step")
    synth.add_argument(
        "--synthetic-stamp",
        action="store_true",
        help="token text carries its emission time (bench)",
    )
    synth.add_argument("--synthetic-fail-on", default=None, help="prompts containing this fail")
    synth.add_argument(
        "--synthetic-cost-scale",
        type=float,
        default=1.0,
        help="multiply the synthetic step cost (2: a machine twice as slow)",
    )
    parser.set_defaults(func=run)


def _engine_config_json(text: str) -> EngineConfig:
    try:
        return EngineConfig.from_json(text)
    except EngineConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The worker's engine options: ``--engine-config``, then the flags, then the lane profile
    for this worker's lanes and device (`gpu_worker.config.lane_profile`). SLO control is on
    unless ``--no-slo-control`` (or the synthetic engine, which has no scheduler).

    Raises:
        EngineConfigError: an option out of range.
    """
    config = config_from_args(args, args.engine_config)
    if config.slo_control is None:  # a worker sizes its steps from SLO targets by default
        config = dataclasses.replace(config, slo_control=not args.synthetic)
    on_gpu = _on_gpu(config.device, args.synthetic)
    return config.with_profile(lane_profile(config.lanes, on_gpu, config.slo_control))


def _on_gpu(device: str | None, synthetic: bool) -> bool:
    if device is not None or synthetic:
        return (device or "").startswith("cuda")
    import torch  # after the OpenMP policy (run) is in the environment

    return torch.cuda.is_available()


def build_engine(args: argparse.Namespace, config: EngineConfig) -> Engine:
    """SyntheticEngine with --synthetic, else LLMEngine, wrapped in the test-only fault
    injection when its variables are set (gpu_worker/faults.py, read once here)."""
    from laneserve.gpu_worker.faults import FaultPlan, with_faults

    if args.synthetic:
        from laneserve.gpu_worker.synthetic import SyntheticEngine

        engine: Engine = SyntheticEngine(
            step_s=args.synthetic_step_ms / 1000.0,
            max_num_seqs=config.max_num_seqs,
            block_size=config.block_size,
            num_blocks=config.num_blocks or 4096,
            fail_on=args.synthetic_fail_on,
            stamp=args.synthetic_stamp,
            cost_scale=args.synthetic_cost_scale,
        )
    else:
        from laneserve.gpu_worker.engine import LLMEngine
        from laneserve.kernels import cpu_ext

        # a fresh machine serves on the PyTorch path while the C++ CPU kernels compile
        cpu_ext.load_or_build_in_background()
        engine = LLMEngine(config)
    return with_faults(engine, FaultPlan.from_env())


STANDBY_PROFILE_WAIT_S = 600.0  # longest a spare waits for the live worker's start-up profile


def wait_as_standby(synthetic: bool) -> bool:
    """A spare's wait: once the live worker has its start-up profile (its restart-profile file
    exists: the spare's imports must not skew that profile), import what a start spends its
    first seconds on (torch, the engine, transformers' tokenizer classes), then block until the
    supervisor sends a line (True: take over now) or closes stdin (False: stop). A spare whose
    imported code changed on disk meanwhile (an upgrade) exits with 3 instead of taking over, so
    the supervisor starts the worker cold on the new code."""
    profile = lsenv.get("LANESERVE_RESTART_PROFILE")
    deadline = time.monotonic() + STANDBY_PROFILE_WAIT_S
    while not synthetic and profile is not None and not profile.exists():
        if time.monotonic() > deadline:
            break
        if select.select([sys.stdin], [], [], 1.0)[0]:  # told to go (or to stop) early
            return bool(sys.stdin.buffer.readline())
    if not synthetic:
        import transformers  # noqa: F401
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

        from laneserve.gpu_worker import engine, model_loader  # noqa: F401
        from laneserve.kernels import cpu_ext  # noqa: F401
    stamp = _code_stamp()
    logger.info("standby: imports done, waiting to take over")
    if not sys.stdin.buffer.readline():
        return False
    if _code_stamp() != stamp:
        logger.warning("standby: the code it imported changed on disk; exiting for a cold start")
        raise SystemExit(3)
    logger.info("standby: taking over")
    return True


def _code_stamp() -> dict[str, float]:
    """Modification times of the files behind the imported laneserve, torch and transformers
    modules."""
    stamp = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and name.partition(".")[0] in ("laneserve", "torch", "transformers"):
            try:
                stamp[path] = os.stat(path).st_mtime
            except OSError:
                stamp[path] = -1.0
    return stamp


def run(args: argparse.Namespace) -> int:
    apply_openmp_policy()  # before anything imports torch (libgomp reads it when it loads)
    if args.standby and not wait_as_standby(args.synthetic):
        return 0
    from laneserve.broker.addresses import default_back
    from laneserve.gpu_worker.worker import Worker

    if bool(args.curve_server_public) != bool(args.curve_client_key):
        raise SystemExit("--curve-server-public and --curve-client-key go together")
    try:
        config = engine_config(args)
    except EngineConfigError as exc:
        raise SystemExit(f"laneserve worker: {exc}") from None
    engine = build_engine(args, config)
    logger.info("KV pool: %s", engine.kv_pool)
    worker = Worker(
        engine,
        broker_addr=args.broker or default_back(),
        lanes=config.lanes,
        capacity=args.capacity or 2 * config.max_num_seqs,
        model=engine.model_name,
        worker_id=args.worker_id,
        heartbeat_interval_s=args.heartbeat_interval,
        liveness=args.liveness,
        parent_pid=args.parent_pid,
        drain_timeout_s=args.drain_timeout,
        info={
            "pid": os.getpid(),
            "synthetic": bool(args.synthetic),
            "engine": config.to_dict(),
            "kv_pool": engine.kv_pool,
        },
        curve_server_public=args.curve_server_public,
        curve_client_key=args.curve_client_key,
    )
    return worker.run()


def main(argv: list[str] | None = None) -> int:
    """``python -m laneserve.commands.worker``: this command alone (faster start)."""
    from laneserve.cli import run_single

    return run_single("worker", register, argv)


if __name__ == "__main__":
    raise SystemExit(main())
