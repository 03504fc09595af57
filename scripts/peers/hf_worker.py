"""bench_offline.py --peers: transformers `generate` (static batches, left padding, greedy).

Runs in the project's environment (the same torch and transformers laneserve uses), on the
Hugging Face directory laneserve converts the GGUF into, under the same OpenMP policy.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from common import Engine, run_worker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: benchlib

from laneserve.gpu_worker.openmp import apply_openmp_policy  # isort: skip

apply_openmp_policy(exclusive=True)  # the libgomp policy of the laneserve side


def build(spec: dict[str, Any]) -> Engine:
    import torch
    import transformers
    from benchlib import run_transformers
    from transformers import AutoModelForCausalLM

    opts = spec.get("options", {})
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    name = opts.get("dtype", "auto")  # auto: transformers' default, the checkpoint's dtype
    dtype = name if name == "auto" else getattr(torch, name)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()
    pad_id = opts.get("pad_id", 2)
    batch_size = opts.get("batch_size", 32)

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        return run_transformers(model, prompts, n, batch_size, pad_id)[0]

    return Engine(
        generate,
        {
            "name": "transformers",
            "version": transformers.__version__,
            "torch": torch.__version__,
            "dtype": str(model.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "batching": f"static, batch {batch_size}, left padding",
        },
    )


if __name__ == "__main__":
    run_worker(build)
