"""`laneserve worker`: one engine process connected to the broker (gpu_worker/worker.py)."""

from __future__ import annotations

import argparse
import logging
import os

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("worker", help="run one engine worker connected to the broker")
    parser.add_argument(
        "--broker",
        default=None,
        help="broker back endpoint (default: ipc under $LANESERVE_HOME/run)",
    )
    parser.add_argument(
        "--lanes",
        default="interactive,batch",
        help="lanes served, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--worker-id", default=None, help="default: HOST-PID")
    parser.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="requests held at once (default: 2 x max-num-seqs: batch fills the engine, interactive can still get in)",
    )
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--liveness", type=int, default=3)
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process is gone"
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish work on SIGTERM"
    )
    curve = parser.add_argument_group("CurveZMQ (a broker on another host)")
    curve.add_argument(
        "--curve-server-public", default=None, help="the broker's public key file (server.key)"
    )
    curve.add_argument(
        "--curve-client-key", default=None, help="this worker's key pair (NAME.key_secret)"
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", default="smollm2-135m")
    engine.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32")
    engine.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "none", "int8", "int4"),
        help="weight-only kernels: auto = a GGUF's own Q4/Q8 formats on CPU; none = dequantized",
    )
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per engine step (default: the lane profile, see lane_profile)",
    )
    engine.add_argument(
        "--batch-token-budget",
        type=int,
        default=None,
        help="batch-lane tokens per step even without interactive traffic (default: none; "
        "DESIGN gives batch the whole budget then)",
    )
    engine.add_argument(
        "--interactive-batch-token-cap",
        type=int,
        default=None,
        help="batch-lane tokens per step while interactive requests run (default: lane profile)",
    )
    engine.add_argument(
        "--kv-cache-memory", default=None, help="KV pool size, e.g. 2GiB (default: engine's)"
    )
    engine.add_argument("--device", default=None)
    synth = parser.add_argument_group("synthetic engine (tests, benchmarks)")
    synth.add_argument("--synthetic", action="store_true", help="fake tokens, no model")
    synth.add_argument("--synthetic-step-ms", type=float, default=10.0, help="ms per engine step")
    synth.add_argument(
        "--synthetic-stamp",
        action="store_true",
        help="token text carries its emission time (bench)",
    )
    synth.add_argument("--synthetic-fail-on", default=None, help="prompts containing this fail")
    parser.set_defaults(func=run)


# Lane profile of a CPU worker that serves interactive traffic. A new request only enters the
# engine between steps, so the running step bounds TTFT, and every batch token in a step that
# also decodes an interactive request lengthens its TPOT. Measured on a 2-core EPYC, bf16
# SmolLM2-135M, one torch thread (what `laneserve up` gives a worker on 2 cores), ms per step:
# decode batch 1 / 8 / 32 / 48 / 64 = 25 / 37 / 81 / ~110 / 165; prefill 64 / 128 tokens ~60 / 105.
# - budget 48: the step an arriving interactive request waits for stays near 110 ms, while
#   batch decodes stay near their best tokens/s (batch 32-48); longer interactive prompts
#   prefill in 48-token chunks, which costs them little (prefill is compute-bound from ~64 tokens);
# - 8 batch tokens beside interactive requests: ~1.5x their idle TPOT.
# Without interactive traffic batch gets the whole budget (DESIGN.md "Lanes inside one worker").
CPU_INTERACTIVE_BUDGET = 48
CPU_INTERACTIVE_BATCH_CAP = 8
DEFAULT_BUDGET = 2048
DEFAULT_INTERACTIVE_BATCH_CAP = 512


def lane_profile(lanes: list[str], device: str | None) -> dict[str, int | None]:
    """Engine step knobs for this worker (DESIGN.md "Lanes"): `max_num_batched_tokens` and
    `interactive_batch_token_cap` (`batch_token_budget` is left to the operator).

    A CPU worker serving interactive traffic keeps steps short and batch tokens beside
    interactive ones few; batch-only and GPU workers take the large budget.
    """
    import torch

    on_gpu = (device or "").startswith("cuda") or (device is None and torch.cuda.is_available())
    if "interactive" in lanes and not on_gpu:
        return {
            "max_num_batched_tokens": CPU_INTERACTIVE_BUDGET,
            "batch_token_budget": None,
            "interactive_batch_token_cap": CPU_INTERACTIVE_BATCH_CAP,
        }
    return {
        "max_num_batched_tokens": DEFAULT_BUDGET,
        "batch_token_budget": None,
        "interactive_batch_token_cap": DEFAULT_INTERACTIVE_BATCH_CAP,
    }


def build_engine(args: argparse.Namespace, lanes: list[str]):
    """The engine for these options: SyntheticEngine with --synthetic, else LLMEngine."""
    from gpu_worker.worker import parse_bytes

    if args.synthetic:
        from gpu_worker.synthetic import SyntheticEngine

        return SyntheticEngine(
            step_s=args.synthetic_step_ms / 1000.0,
            max_num_seqs=args.max_num_seqs,
            block_size=args.block_size,
            fail_on=args.synthetic_fail_on,
            stamp=args.synthetic_stamp,
        )
    from gpu_worker.engine import LLMEngine  # the real engine (issue 3)

    profile = lane_profile(lanes, args.device)

    return LLMEngine.from_args(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or profile["max_num_batched_tokens"],
        batch_token_budget=args.batch_token_budget or profile["batch_token_budget"],
        interactive_batch_token_cap=(
            args.interactive_batch_token_cap or profile["interactive_batch_token_cap"]
        ),
        kv_cache_memory_bytes=parse_bytes(args.kv_cache_memory),
        lanes=lanes,
    )


def run(args: argparse.Namespace) -> int:
    from broker.addresses import default_back
    from gpu_worker.worker import Worker

    lanes = [lane.strip() for lane in args.lanes.split(",") if lane.strip()]
    if bool(args.curve_server_public) != bool(args.curve_client_key):
        raise SystemExit("--curve-server-public and --curve-client-key go together")
    engine = build_engine(args, lanes)
    worker = Worker(
        engine,
        broker_addr=args.broker or default_back(),
        lanes=lanes,
        capacity=args.capacity or 2 * args.max_num_seqs,
        model="synthetic" if args.synthetic else getattr(engine, "model_name", args.model),
        worker_id=args.worker_id,
        heartbeat_interval_s=args.heartbeat_interval,
        liveness=args.liveness,
        parent_pid=args.parent_pid,
        drain_timeout_s=args.drain_timeout,
        info={"pid": os.getpid(), "synthetic": bool(args.synthetic)},
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
