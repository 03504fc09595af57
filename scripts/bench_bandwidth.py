"""Memory bandwidth, measured, against the bytes a decode step must read.

Prints one JSON object:

- ``cpu``: the model name, core count and flags of /proc/cpuinfo;
- ``bandwidth_gb_s``: the streaming read bandwidth of a torch sum over ``--gib`` GiB of float32
  (median of ``--repeats``, after one warm-up), with all of torch's threads (``all_threads``) and
  with one (``one_thread``), in GB/s (1e9 bytes);
- with ``--model FILE.gguf``: per batch size (1 and 8, ``--batches``) the bytes a decode step
  reads at ``--context`` tokens of context per sequence: every weight tensor once (the embedding
  only its looked-up rows unless the output head is tied to it), plus each sequence's K and V
  (``--kv-bytes`` per element: 2 for a bf16 cache, 4 for float32); per token that divided by the
  batch. With ``--tok-s`` (decode tokens per second at batch 1, as measured by another benchmark;
  ``--tok-s-8`` at batch 8) it adds the bandwidth those rates imply and their share of the
  measured all-threads bandwidth.

    python scripts/bench_bandwidth.py [--gib 1] [--model FILE.gguf --context 512 --tok-s 17.5]

Run it on a quiet machine: a shared one measures its neighbours too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from benchlib import cpu_info


def read_bandwidth(gib: float, threads: int, repeats: int) -> float:
    """GB/s of `torch.sum` over `gib` GiB of float32 with `threads` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * 2**30) // 4)
        x.sum()  # warm-up: the pages are touched by `ones`, the threads started here
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t0)
        return x.numel() * 4 / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(before)


def _field(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def model_bytes(path: str) -> dict:
    """The GGUF's weight bytes as a decode step reads them, and its per-token KV elements."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    layers = int(_field(reader, f"{arch}.block_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)
    head_dim = int(_field(reader, f"{arch}.attention.key_length") or hidden // heads)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    embed = sizes.get("token_embd.weight", 0)
    tied = "output.weight" not in sizes
    vocab = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
    experts = int(_field(reader, f"{arch}.expert_count") or 0)
    used = int(_field(reader, f"{arch}.expert_used_count") or 0)
    expert_bytes = sum(n for name, n in sizes.items() if "_exps." in name)
    step = sum(sizes.values()) - (0 if tied else embed)
    return {
        "file_bytes": os.path.getsize(path),
        "weight_bytes": sum(sizes.values()),
        # the embedding is read in full only when it is also the output head
        "step_weight_bytes": step,
        # a one-token MoE step reads only its top-k experts (expert_used_count of expert_count)
        "active_step_weight_bytes": step - expert_bytes + expert_bytes * used // max(experts, 1),
        "embedding_row_bytes": embed // vocab,
        "tied_embedding": tied,
        "kv_elements_per_token": 2 * layers * kv_heads * head_dim,  # K and V, every layer
    }


def decode_reads(model: dict, batches: list[int], context: int, kv_bytes: int) -> dict:
    out = {}
    for b in batches:
        kv = b * context * model["kv_elements_per_token"] * kv_bytes
        step = model["step_weight_bytes"] + kv + b * model["embedding_row_bytes"]
        out[str(b)] = {"step_bytes": step, "kv_bytes": kv, "bytes_per_token": step / b}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="GiB summed per bandwidth measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", help="a GGUF file: the bytes its decode step reads")
    p.add_argument("--context", type=int, default=512, help="tokens of context per sequence")
    p.add_argument("--kv-bytes", type=int, default=2, help="bytes per KV element (2: bf16)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tok-s", type=float, help="measured batch-1 decode tokens/s")
    p.add_argument("--tok-s-8", type=float, help="measured batch-8 decode tokens/s (all streams)")
    args = p.parse_args()
    threads = torch.get_num_threads()
    all_bw = read_bandwidth(args.gib, threads, args.repeats)
    result = {
        "cpu": cpu_info(),
        "torch_threads": threads,
        "bandwidth_gb_s": {
            "all_threads": round(all_bw, 2),
            "one_thread": round(read_bandwidth(args.gib, 1, args.repeats), 2),
            "gib": args.gib,
        },
    }
    if args.model:
        model = model_bytes(args.model)
        reads = decode_reads(
            model, [int(b) for b in args.batches.split(",")], args.context, args.kv_bytes
        )
        for batch, rate in (("1", args.tok_s), ("8", args.tok_s_8)):
            if rate and batch in reads:
                implied = rate * reads[batch]["bytes_per_token"] / 1e9
                reads[batch] |= {
                    "tok_s": rate,
                    "implied_gb_s": round(implied, 2),
                    "share_of_measured": round(implied / all_bw, 3),
                }
        result["model"] = {
            "path": args.model,
            "context": args.context,
            "kv_bytes_per_element": args.kv_bytes,
            **model,
            "decode": reads,
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
