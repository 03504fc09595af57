#!/usr/bin/env python
"""Embeddings throughput (issue 49): sequences/s for N documents of ~T tokens, three ways.

1. **api**: a fresh stack (`laneserve up`, defaults plus `--pooling-type`), the documents through
   `POST /v1/embeddings` in requests of `--request-size` inputs, `--concurrency` at once;
2. **batch**: the same documents as a `/v1/embeddings` batch file (`POST /v1/files` +
   `POST /v1/batches`), the batch's in_progress -> completed span read from the stack's
   database (the `jobs` row's float timestamps: the API's are whole seconds, +-2 % of a 50 s
   run), and the lines' own span (first dispatch -> last finished, from their `requests`
   rows);
3. **transformers**: `AutoModel` on the same model (the bundled GGUF's converted directory) and
   the same token ids, padded batches of `--hf-batch-size`, the same pooling (last token or mean,
   L2-normalized), float32 (`--hf-dtype`); sentence-transformers is not used (not installed).

Each document is the first `--tokens` token ids of a stdlib document (`benchlib.
sample_documents`), sent as token ids so the API and transformers embed exactly the same input.
The batch file embeds `--num-docs` other documents of the same length: the same ones would hit
the prefix cache the API's run left (every one of them below ~450 documents, 42.9/s at 300). The stack's
vectors are checked against transformers' (max cosine distance reported). Forced tool calls'
validity and grammar overhead at batch 64 are `scripts/bench_structured.py --tools`. Prints one
JSON object (with the CPU model and flags) on stdout, progress on stderr.

    python scripts/bench_embeddings.py --num-docs 1000 --tokens 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from benchlib import (  # noqa: E402
    add_stack_args,
    api_call,
    bench_stack,
    log,
    machine,
    model_path,
    sample_documents,
    served_model,
)


def documents(hf_dir: Path, n: int, tokens: int) -> list[list[int]]:
    """`n` token-id documents of `tokens` ids each (shorter only if a source text is)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    texts = sample_documents(n, max_words=tokens)
    return [tok(t, add_special_tokens=False)["input_ids"][:tokens] for t in texts]


async def via_api(url: str, model: str, docs: list[list[int]], size: int, conc: int) -> dict:
    """Sequences/s through /v1/embeddings; the vectors in document order."""
    import httpx

    chunks = [docs[i : i + size] for i in range(0, len(docs), size)]
    out: list[list[float]] = [[] for _ in chunks]
    sem = asyncio.Semaphore(conc)

    async def one(c: httpx.AsyncClient, k: int) -> None:
        async with sem:
            r = await c.post("/v1/embeddings", json={"model": model, "input": chunks[k]})
            r.raise_for_status()
            out[k] = [d["embedding"] for d in r.json()["data"]]

    async with httpx.AsyncClient(base_url=url, timeout=3600) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c, k) for k in range(len(chunks))))
        wall = time.perf_counter() - t0
    vecs = [v for chunk in out for v in chunk]
    return {"wall_s": round(wall, 3), "seq_per_s": round(len(docs) / wall, 2), "vectors": vecs}


def via_batch(url: str, db_url: str, model: str, docs: list[list[int]]) -> dict:
    """Sequences/s of a /v1/embeddings batch file over its in_progress -> completed span, and
    over its lines' first dispatch -> last finished (both from the stack's database)."""
    import httpx

    lines = [
        {"custom_id": f"d{i}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": model, "input": ids}}
        for i, ids in enumerate(docs)
    ]  # fmt: skip
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    with httpx.Client(base_url=url, timeout=600) as c:
        f = api_call(c, "POST", "/v1/files", files={"file": ("emb.jsonl", data)},
                     data={"purpose": "batch"})  # fmt: skip
        b = api_call(
            c,
            "POST",
            "/v1/batches",
            json={
                "input_file_id": f["id"],
                "endpoint": "/v1/embeddings",
                "completion_window": "24h",
            },
        )
        while b["status"] not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(0.25)
            b = api_call(c, "GET", f"/v1/batches/{b['id']}")
    counts = b.get("request_counts") or {}
    done = counts.get("completed", 0)
    span, lines_span = batch_spans(db_url, b["id"], counts.get("total", 0))
    return {"status": b["status"], "request_counts": counts, "span_s": round(span, 3),
            "seq_per_s": round(done / span, 2) if span > 0 else None,
            "lines_span_s": round(lines_span, 3) if lines_span else None,
            "lines_seq_per_s": round(done / lines_span, 2) if lines_span else None}  # fmt: skip


def batch_spans(db_url: str, job_id: str, total: int, wait_s: float = 5.0) -> tuple[float, float]:
    """(in_progress -> completed seconds from the `jobs` row, first line dispatched -> last line
    finished seconds from the job's `requests` rows). The recorder commits a line's
    `finished_at` within about a second of its end, so this waits up to `wait_s` for all
    `total` of them (then the span of those it has)."""
    from sqlalchemy import create_engine, func, select

    from laneserve.db.models import Job, Request

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            start, end = conn.execute(
                select(Job.in_progress_at, Job.completed_at).where(Job.id == job_id)
            ).one()
            rows = select(func.min(Request.arrival_at), func.max(Request.finished_at),
                          func.count(Request.finished_at)).where(Request.job_id == job_id)  # fmt: skip
            deadline = time.monotonic() + wait_s
            while True:
                first, last, finished = conn.execute(rows).one()
                if finished >= total or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
                conn.rollback()  # a fresh snapshot for the next read
    finally:
        engine.dispose()
    lines = (last - first) if first is not None and last is not None else 0.0
    return (end or 0.0) - (start or 0.0), lines


def via_transformers(hf_dir: Path, docs, pooling: str, batch: int, dtype: str) -> dict:
    """Sequences/s of transformers' forward with the same pooling; the vectors."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    vecs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(docs), batch):
            part = docs[i : i + batch]
            width = max(len(d) for d in part)
            ids = torch.zeros(len(part), width, dtype=torch.long)
            mask = torch.zeros(len(part), width, dtype=torch.long)
            for r, d in enumerate(part):
                ids[r, : len(d)], mask[r, : len(d)] = torch.tensor(d), 1
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            if pooling == "MEAN":
                pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            else:
                pooled = h[torch.arange(len(part)), mask.sum(1) - 1]
            vecs += torch.nn.functional.normalize(pooled, dim=1).tolist()
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 3), "seq_per_s": round(len(docs) / wall, 2), "vectors": vecs}


def max_cosine_distance(a: list, b: list) -> float:
    x, y = np.asarray(a), np.asarray(b)
    return float(np.max(1.0 - np.sum(x * y, axis=1)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_stack_args(ap)
    ap.add_argument("--num-docs", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=200, help="tokens per document")
    ap.add_argument("--pooling-type", default="LAST", choices=("LAST", "MEAN"))
    ap.add_argument("--request-size", type=int, default=64, help="inputs per /v1/embeddings call")
    ap.add_argument("--concurrency", type=int, default=4, help="calls in flight")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--hf-dtype", default="float32")
    ap.add_argument(
        "--up-args",
        default="",
        help='more `laneserve up` flags for the fresh stack, e.g. "--slo interactive:ttft=20000"',
    )
    args = ap.parse_args()
    from laneserve.gpu_worker.model_loader import convert_gguf

    path = Path(model_path(args.model))
    hf_dir = convert_gguf(path) if path.suffix == ".gguf" else path
    both = documents(hf_dir, 2 * args.num_docs, args.tokens)
    docs, batch_docs = both[: args.num_docs], both[args.num_docs :]
    result: dict[str, Any] = {"machine": machine(), "num_docs": len(docs),
                              "mean_tokens": round(float(np.mean([len(d) for d in docs])), 1),
                              "batch_mean_tokens": round(float(np.mean([len(d) for d in batch_docs])), 1),
                              "pooling_type": args.pooling_type, "dtype": args.dtype}  # fmt: skip
    up_args = ["--pooling-type", args.pooling_type, *args.up_args.split()]
    with bench_stack(args, up_args) as info:
        model = served_model(info["api_url"])
        log(f"{len(docs)} documents through /v1/embeddings")
        api = asyncio.run(
            via_api(info["api_url"], model, docs, args.request_size, args.concurrency)
        )
        log(f"{len(batch_docs)} other documents as a batch file")
        result["batch"] = via_batch(info["api_url"], info["db_url"], model, batch_docs)
    log("transformers' forward")
    hf = via_transformers(hf_dir, docs, args.pooling_type, args.hf_batch_size, args.hf_dtype)
    result["api"] = {k: v for k, v in api.items() if k != "vectors"}
    result["transformers"] = {k: v for k, v in hf.items() if k != "vectors"}
    result["transformers"]["dtype"] = args.hf_dtype
    result["api_max_cosine_distance_vs_transformers"] = max_cosine_distance(
        api["vectors"], hf["vectors"]
    )
    for name in ("api", "batch"):
        rate = result[name].get("seq_per_s")
        result[f"{name}_over_transformers"] = (
            round(rate / hf["seq_per_s"], 2) if rate and hf["seq_per_s"] else None
        )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
