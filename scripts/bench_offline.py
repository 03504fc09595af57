#!/usr/bin/env python3
"""Offline throughput: laneserve's engine vs transformers `generate` (and, with --peers, vLLM's
CPU build and llama.cpp), same model, same prompts.

One set of summarization prompts (the project's sample set: module docstrings of the Python
standard library, chat-templated "Summarize ..." requests) goes through

- transformers `generate`: static batching (batch 32, left padding), greedy, forced output length;
- laneserve `LLM.generate`: continuous batching over the paged KV cache, same forced length;

then both run a single stream (batch 1) for the decode-speed comparison. Prints one JSON object:
tokens, seconds, tok/s, the ratios, and how many outputs agree token for token.

    python scripts/bench_offline.py [--num-prompts 64] [--max-tokens 64] [--dtype auto]

With ``--peers hf,vllm,llamacpp`` every engine (laneserve first, then each named peer) runs in its
own process instead, one after another: the vLLM and llama.cpp peers in their own virtual
environments (``scripts/setup_peers.sh``, under ``$LANESERVE_PEERS_DIR``), each started twice
(cold start: the full measured run; warm start: process start to first token again). The JSON then
holds, per engine, offline tok/s, single-stream decode tok/s, cold- and warm-start seconds, the
ratios laneserve/peer, the CPU model and flags, the load average and the versions. A peer that is
not installed, fails or runs past ``--peer-timeout`` is reported as ``"skipped": "reason"``.

    python scripts/bench_offline.py --peers hf,vllm,llamacpp [--num-prompts 64] [--max-tokens 64]

``--family FAMILY --shape SHAPE`` benchmarks a random-weight model of scripts/make_test_model.py
(made once under ``--models-dir``): its F32 GGUF for laneserve and llama.cpp, its bf16 Hugging
Face directory for transformers and vLLM. Every engine then also reports its peak RSS, and the
report the measured read bandwidth and the share of it each single-stream decode uses.

    python scripts/bench_offline.py --family qwen3 --shape 0.6b --peers hf,vllm,llamacpp --rounds 3

``--rounds N`` runs that sequence N times (laneserve, the peers, laneserve, the peers, ...) and
reports each figure's median, and per peer the median of the ratios taken within each round, with
the values of every round beside them: on a shared machine whose speed drifts by tens of percent
over minutes, one round's ratio says little.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# laneserve's offline OpenMP wait policy (the one `LLM` applies: this process and the laneserve
# and transformers workers run torch as its only user), before torch loads (libgomp reads it
# once, at load). The vLLM and llama.cpp peers start without it: their own defaults.
from laneserve.gpu_worker.openmp import POLICY_VARIABLES, apply_openmp_policy  # isort: skip

USER_OPENMP = {name: os.environ.get(name) for name in POLICY_VARIABLES}
apply_openmp_policy(exclusive=True)
import torch  # noqa: E402  # isort: skip
from benchlib import (  # noqa: E402, F401
    LLAMACPP_VENVS,
    VENV_PEERS,
    cpu_info,
    cpu_times,
    model_bytes,
    peer_python,
    read_bandwidth,
    run_transformers,
    sample_documents,
    steal_pct,
    thread_settings,
)


def build_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for doc in sample_documents(n):
        messages = [{"role": "user", "content": f"Summarize in two sentences:\n\n{doc}"}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


# --- --peers: one process per engine -----------------------------------------------------------

PEERS = ("hf", "vllm", "llamacpp")
REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "scripts" / "peers"
LOG_TAIL_CHARS = 1500
VLLM_KV_CACHE_GIB = "1"  # vLLM CPU's default reserves 4 GiB; 1 GiB holds 64 x 2048 tokens here


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return ""


def run_engine_process(
    engine: str, python: str, spec: dict[str, Any], workdir: Path, label: str, timeout_s: float
) -> dict[str, Any]:
    """Run one engine's worker once; returns its result, or ``{"error": ...}``.

    ``start_s`` in the result is process start -> first token (the parent's spawn time to the
    worker's first-token wall clock).
    """
    spec_path, out_path = workdir / f"{label}.spec.json", workdir / f"{label}.out.json"
    log_path = workdir / f"{label}.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    child_env = dict(os.environ)
    if engine in VENV_PEERS:  # the peer's own environment: nothing of the project's on the path
        for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
            child_env.pop(name, None)
        for name, value in USER_OPENMP.items():  # nor laneserve's OpenMP policy
            if value is None:
                child_env.pop(name, None)
        child_env.update(spec.get("environment", {}))
    else:
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), child_env.get("PYTHONPATH", "")) if p
        )
    script = WORKERS / f"{engine}_worker.py"
    cmd = [python, str(script), "--spec", str(spec_path), "--out", str(out_path)]
    print(f"[bench] {label}: starting ({timeout_s:.0f} s limit)", file=sys.stderr, flush=True)
    with open(log_path, "w") as log:
        spawned_at = time.time()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and whatever it started
            proc.wait()
            return {"error": f"timed out after {timeout_s:.0f} s", "log_tail": _tail(log_path)}
    wall_s = time.time() - spawned_at
    try:
        result = json.loads(out_path.read_text())
    except (OSError, ValueError):
        return {"error": f"worker exited {rc} without a result", "log_tail": _tail(log_path)}
    if "error" in result:
        result["log_tail"] = _tail(log_path)
        return result
    result["start_s"] = round(result.pop("first_token_at") - spawned_at, 2)
    result["load_s"] = round(result.pop("loaded_at") - spawned_at, 2)
    result["process_wall_s"] = round(wall_s, 1)
    return result


def bench_engine(
    engine: str, python: str, spec: dict[str, Any], workdir: Path, timeout_s: float
) -> dict[str, Any]:
    """Cold run (full measurement) then warm run (start only) of one engine, as report fields."""
    load_before = [round(x, 2) for x in os.getloadavg()]
    times_before = cpu_times()
    cold = run_engine_process(engine, python, {**spec, "mode": "full"}, workdir, engine, timeout_s)
    cold_steal = steal_pct(times_before, cpu_times())
    if "error" in cold:
        return {"skipped": f"{engine} failed: {cold['error']}", "log_tail": cold.get("log_tail")}
    warm_spec = {**spec, "mode": "start"}
    warm = run_engine_process(engine, python, warm_spec, workdir, f"{engine}-warm", timeout_s)
    out = {
        **cold["engine"],
        "python": cold["python"],
        "offline_tok_s": cold["offline"]["tok_s"],
        "offline_s": cold["offline"]["seconds"],
        "single_stream_decode_tok_s": cold["single_stream_decode"]["tok_s"],
        "single_stream_prefill_s": cold["single_stream_decode"]["prefill_s"],
        "cold_start_s": cold["start_s"],
        "cold_load_s": cold["load_s"],
        "peak_rss_mib": cold.get("peak_rss_mib"),
        "warm_start_s": warm.get("start_s"),
        "load_avg_before": load_before,
        "cpu_steal_pct": cold_steal,  # during the measured (cold) run; see steal_pct
        "first_output_ids": cold["first_output_ids"],
    }
    if "error" in warm:
        out["warm_start_error"] = warm["error"]
    return out


FIGURES = ("offline_tok_s", "single_stream_decode_tok_s", "cold_start_s", "warm_start_s")
# an entry's timed fields: medians over --rounds, but for cold_start_s (merge_rounds)
MEDIAN_FIELDS = (*FIGURES, "offline_s", "single_stream_prefill_s", "cold_load_s", "peak_rss_mib")


def ratios(lane: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """laneserve / peer for every figure: > 1 means laneserve is faster for tok/s, slower for
    start seconds."""

    def ratio(key: str) -> float | None:
        a, b = lane.get(key), peer.get(key)
        return (
            round(a / b, 2)
            if isinstance(a, int | float) and isinstance(b, int | float) and b
            else None
        )

    return {key: ratio(key) for key in FIGURES}


def run_peers(args: argparse.Namespace) -> dict[str, Any]:
    """The --peers benchmark: laneserve and each peer in its own process; returns the report."""
    from transformers import AutoTokenizer

    from laneserve.gpu_worker.model_files import resolve_model_path
    from laneserve.gpu_worker.model_loader import convert_gguf

    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise SystemExit(f"--peers: unknown peer(s) {unknown}; expected a subset of {list(PEERS)}")
    path = resolve_model_path(args.model)
    hf_dir = args.hf_dir or (convert_gguf(path) if path.is_file() else path)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    prompts = build_prompts(tokenizer, args.num_prompts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 2
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    base = {
        # 2048, or a small random model's own max_position_embeddings (vLLM refuses more)
        "max_model_len": min(2048, config.get("max_position_embeddings") or 2048),
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "single_tokens": args.single_tokens,
        "threads": args.threads,
    }
    specs = {
        "laneserve": {**base, "model": args.model, "options": {"dtype": args.dtype}},
        "hf": {
            **base,
            "model": str(hf_dir),
            "options": {"dtype": "auto", "pad_id": pad_id, "batch_size": args.batch_size},
        },
        "vllm": {
            **base,
            "model": str(hf_dir),
            "threads": None,  # vLLM binds its own OpenMP threads (its default)
            "environment": {"VLLM_CPU_KVCACHE_SPACE": VLLM_KV_CACHE_GIB},
        },
        "llamacpp": {**base, "model": str(path), "threads": args.threads or 2},
    }
    if not path.is_file():
        specs["llamacpp"] = None  # llama.cpp needs the GGUF file
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": cpu_info(),
        "threads": thread_settings(),
        "model": {"name": args.model, "gguf": str(path), "hf_dir": str(hf_dir)},
        "workload": {
            "num_prompts": args.num_prompts,
            "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
            "max_tokens": args.max_tokens,
            "single_tokens": args.single_tokens,
            "forced_length": True,
            "greedy": True,
        },
        "engines": {},
    }
    workdir = Path(tempfile.mkdtemp(prefix="laneserve-bench-"))
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        for n in range(args.rounds):
            engines: dict[str, dict[str, Any]] = {}
            for engine in ["laneserve", *peers]:
                python, why = peer_python(engine)
                if specs.get(engine) is None:
                    why = "llama.cpp needs a .gguf model file"
                if why is None and n and "skipped" in rounds[0][engine]:
                    why = rounds[0][engine]["skipped"]  # failed in the first round: not again
                if why is not None:
                    engines[engine] = {"skipped": why}
                    if not n:
                        print(f"[bench] {engine}: skipped: {why}", file=sys.stderr, flush=True)
                    continue
                label = engine if args.rounds == 1 else f"{engine}-r{n + 1}"
                print(f"[bench] round {n + 1}/{args.rounds}: {label}", file=sys.stderr, flush=True)
                entry = bench_engine(engine, python, specs[engine], workdir, args.peer_timeout)
                engines[engine] = entry
                if "skipped" in entry:
                    print(f"[bench] {engine}: skipped: {entry['skipped']}", file=sys.stderr)
            rounds.append(engines)
            if "skipped" in engines["laneserve"]:
                break  # no ratio can come of the peers' further rounds
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["rounds"] = len(rounds)
    report["engines"], report["ratios_laneserve_over_peer"] = merge_rounds(rounds)
    report["load_avg_end_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    if path.is_file():
        report["bandwidth"] = bandwidth_shares(path, report["engines"], args.threads)
    return report


def bandwidth_shares(gguf: Path, engines: dict[str, Any], threads: int | None) -> dict[str, Any]:
    """The measured streaming read bandwidth (scripts/bench_bandwidth.py, all threads) and, per
    engine, the share of it a single-stream decode uses: tok/s x the weight bytes a one-token
    step reads from the GGUF (a MoE's top-k experts only; the KV of a 64-token context aside)."""
    gb_s = read_bandwidth(1.0, threads or torch.get_num_threads(), 5)
    step = model_bytes(str(gguf))["active_step_weight_bytes"]
    shares = {
        name: round(e["single_stream_decode_tok_s"] * step / (gb_s * 1e9), 3)
        for name, e in engines.items()
        if isinstance(e.get("single_stream_decode_tok_s"), int | float)
    }
    return {"read_gb_s": round(gb_s, 2), "step_weight_bytes": step, "single_stream_share": shares}


def make_family_model(family: str, shape: str, models_dir: Path) -> tuple[Path, Path]:
    """(GGUF file, bf16 Hugging Face directory) of a random-weight `family`/`shape` model from
    scripts/make_test_model.py (the same weights; F32 GGUF), made once under `models_dir`."""
    out = models_dir / f"{family}-{shape}"
    gguf, hf_dir = out / "model.gguf", out / "hf"
    if not (gguf.exists() and (hf_dir / "config.json").exists()):
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(REPO / "scripts" / "make_test_model.py"), family, shape,
               str(hf_dir), "--dtype", "bfloat16", "--gguf", str(gguf)]  # fmt: skip
        print(f"[bench] making {family}/{shape} under {out}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)  # stdout is the report's
    return gguf, hf_dir


def merge_rounds(
    rounds: list[dict[str, dict[str, Any]]],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Engines' entries and laneserve/peer ratios over one or more rounds (each round: every
    engine once, one after another).

    One round: the entries as measured and `ratios`. Several: per engine, its first successful
    entry with every timed figure (`MEDIAN_FIELDS`) replaced by its median over the rounds it
    succeeded in, except `cold_start_s`, which stays the first round's (later rounds start with
    the page cache and the engines' compile caches warm); under `per_round` every round's
    values, its CPU steal, load average and any warm-start error, None where the engine failed
    (index i is round i + 1). Per peer: the median of the ratios taken *within* each round
    (laneserve and that peer measured minutes apart), every round's ratio beside it (None where
    either failed). An engine that failed in every round keeps the first round's `skipped`
    entry."""
    if len(rounds) == 1:
        engines = rounds[0]
        lane = engines["laneserve"]
        return engines, {
            peer: ratios(lane, entry)
            for peer, entry in engines.items()
            if peer != "laneserve" and "skipped" not in entry and "skipped" not in lane
        }

    def median(values: list[Any]) -> float | None:
        known = [v for v in values if isinstance(v, int | float)]
        return round(statistics.median(known), 2) if known else None

    engines = {}
    for name in rounds[0]:
        entries = [None if "skipped" in r[name] else r[name] for r in rounds]
        ok = [e for e in entries if e is not None]
        if not ok:
            engines[name] = rounds[0][name]
            continue
        merged = dict(ok[0])  # cold_start_s stays the first round's
        conditions = ("cpu_steal_pct", "load_avg_before", "warm_start_error")
        merged["per_round"] = {
            k: [e and e.get(k) for e in entries] for k in (*MEDIAN_FIELDS, *conditions)
        }
        for key in conditions:
            merged.pop(key, None)  # a round's own: under per_round only
        for key in MEDIAN_FIELDS:
            if key != "cold_start_s":
                merged[key] = median(merged["per_round"][key])
        engines[name] = merged
    out = {}
    for peer in rounds[0]:
        if peer == "laneserve":
            continue
        pairs = [
            None
            if "skipped" in r["laneserve"] or "skipped" in r[peer]
            else ratios(r["laneserve"], r[peer])
            for r in rounds
        ]
        if not any(pairs):
            continue
        per_round = {key: [p and p[key] for p in pairs] for key in FIGURES}
        out[peer] = {**{k: median(v) for k, v in per_round.items()}, "per_round": per_round}
        out[peer]["cold_start_s"] = next(p["cold_start_s"] for p in pairs if p)  # as above
    return engines, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32, help="transformers static batch")
    ap.add_argument("--single-tokens", type=int, default=64, help="tokens for the batch-1 run")
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--peers",
        default=None,
        help="comma list of hf,vllm,llamacpp: run laneserve and these peers, one process each",
    )
    ap.add_argument(
        "--peer-timeout", type=float, default=1800.0, help="seconds per engine process (--peers)"
    )
    ap.add_argument(
        "--llamacpp-build", choices=("avx2", "avx512"), default="avx2",
        help="which llama.cpp build runs as the llamacpp peer (scripts/setup_peers.sh with "
        "LLAMACPP_ISA=...; its system info is in the JSON)",
    )  # fmt: skip
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="--peers: run every engine this many times, round-robin; report medians and the "
        "median of within-round ratios (a noisy shared machine)",
    )
    ap.add_argument("--hf-dir", type=Path, default=None,
                    help="the Hugging Face directory of --model's weights for transformers and "
                    "vLLM (default: --model's own, or its GGUF converted)")  # fmt: skip
    ap.add_argument("--family", default=None,
                    help="bench a random-weight model of scripts/make_test_model.py instead of "
                    "--model: FAMILY (with --shape); its F32 GGUF for laneserve and llama.cpp, "
                    "its bf16 directory for transformers and vLLM")  # fmt: skip
    ap.add_argument("--shape", default="tiny", help="--family's shape (make_test_model.py --list)")
    ap.add_argument("--models-dir", type=Path, default=None,
                    help="where --family models are made once (default: under LANESERVE_HOME "
                    "or ~/.cache/laneserve, bench-models/)")  # fmt: skip
    args = ap.parse_args()
    VENV_PEERS["llamacpp"] = LLAMACPP_VENVS[args.llamacpp_build]
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if args.family:
        home = Path(os.environ.get("LANESERVE_HOME") or Path.home() / ".cache" / "laneserve")
        gguf, args.hf_dir = make_family_model(
            args.family, args.shape, args.models_dir or home / "bench-models"
        )
        args.model = str(gguf)
    if args.peers is not None:
        print(json.dumps(run_peers(args), indent=2))
        return
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from laneserve.gpu_worker import LLM, SamplingParams
    from laneserve.gpu_worker.hardware import resolve_dtype
    from laneserve.gpu_worker.model_files import resolve_model_path
    from laneserve.gpu_worker.model_loader import convert_gguf

    path = resolve_model_path(args.model)
    hf_dir = args.hf_dir or (convert_gguf(path) if path.is_file() else path)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    llm = LLM(
        model=str(hf_dir),
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=2048,
        max_num_seqs=args.num_prompts,
    )
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
    prompts = build_prompts(llm.tokenizer, args.num_prompts)
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    run_transformers(hf, prompts[:2], 4, 2, pad_id)

    t0 = time.perf_counter()
    ours = llm.generate(prompts, params)
    ours_s = time.perf_counter() - t0
    ref, ref_s = run_transformers(hf, prompts, args.max_tokens, args.batch_size, pad_id)
    tokens = args.num_prompts * args.max_tokens
    agree = sum(o.token_ids == r for o, r in zip(ours, ref, strict=True))

    # Single stream, decode only: time for N tokens minus time for 1 token (the prefill), both sides.
    single = SamplingParams(max_tokens=args.single_tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0)
    llm.engine.block_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate([prompts[0]], first)
    ours_prefill = time.perf_counter() - t0
    llm.engine.block_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    one = llm.generate([prompts[0]], single)[0]
    ours_1 = time.perf_counter() - t0 - ours_prefill
    _, ref_prefill = run_transformers(hf, [prompts[0]], 1, 1, pad_id)
    ref_1_out, ref_1 = run_transformers(hf, [prompts[0]], args.single_tokens, 1, pad_id)
    ref_1 -= ref_prefill
    prompt_lens = [len(p) for p in prompts]
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        "dtype": str(dtype).removeprefix("torch."),
        "num_prompts": args.num_prompts,
        "prompt_tokens_mean": round(sum(prompt_lens) / len(prompt_lens), 1),
        "max_tokens": args.max_tokens,
        "throughput": {
            "tokens": tokens,
            "transformers_s": round(ref_s, 2),
            "laneserve_s": round(ours_s, 2),
            "transformers_tok_s": round(tokens / ref_s, 1),
            "laneserve_tok_s": round(tokens / ours_s, 1),
            "ratio": round(ref_s / ours_s, 2),
            "outputs_identical": f"{agree}/{args.num_prompts}",
        },
        "single_stream_decode": {
            "tokens": args.single_tokens,
            "transformers_tok_s": round((args.single_tokens - 1) / ref_1, 1),
            "laneserve_tok_s": round((args.single_tokens - 1) / ours_1, 1),
            "laneserve_tpot_ms_engine": round(one.metrics["tpot_ms"], 2),
            "ratio": round(ref_1 / ours_1, 2),
            "identical": one.token_ids == ref_1_out[0],
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
