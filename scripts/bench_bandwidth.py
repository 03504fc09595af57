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

import torch
from benchlib import cpu_info, model_bytes, read_bandwidth


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
