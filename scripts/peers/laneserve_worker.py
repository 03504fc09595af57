"""bench_offline.py --peers: laneserve's offline `LLM` (continuous batching, paged KV cache).

Runs in the project's environment with the repository on PYTHONPATH. The model is what
`laneserve up` loads for the same name (``spec["model"]``), at the engine's default dtype.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from common import Engine, run_worker

from laneserve.gpu_worker.openmp import apply_openmp_policy  # isort: skip

apply_openmp_policy(exclusive=True)  # before torch loads, as the offline LLM does


def _version() -> str:
    """The installed laneserve version and, in a git checkout, the commit being measured."""
    from importlib import metadata

    try:
        version = metadata.version("laneserve")
    except metadata.PackageNotFoundError:
        version = "unknown"
    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return version
    return f"{version} ({commit})"


def build(spec: dict[str, Any]) -> Engine:
    import torch

    from laneserve.gpu_worker import LLM, SamplingParams

    opts = spec.get("options", {})
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    llm = LLM(
        model=spec["model"],
        dtype=opts.get("dtype", "auto"),
        max_model_len=spec.get("max_model_len", 2048),
        max_num_seqs=len(spec["prompts"]),
    )

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        llm.engine.block_manager.reset_prefix_cache()  # every run prefills its prompts
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return [list(o.token_ids) for o in llm.generate(prompts, params)]

    return Engine(
        generate,
        {
            "name": "laneserve",
            "version": _version(),
            "torch": torch.__version__,
            "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "batching": f"continuous, max_num_seqs={len(spec['prompts'])}",
        },
    )


if __name__ == "__main__":
    run_worker(build)
