"""bench_offline.py --peers: llama.cpp through `llama-cpp-python` (built from source, see
scripts/setup_peers.sh), on the GGUF file itself (Q4_1).

`llama-cpp-python`'s high-level `Llama` serves one sequence at a time, so the offline run is the
prompts one after another (its default way to run a list of prompts). Greedy (top-k 1).
`Llama.generate` does not stop at an end-of-generation token; taking exactly N tokens from it is
the forced length (as vLLM's and laneserve's ``ignore_eos``).
"""

from __future__ import annotations

from typing import Any

from common import Engine, run_worker


def build(spec: dict[str, Any]) -> Engine:
    import llama_cpp
    from llama_cpp import Llama

    threads = spec.get("threads") or 2
    llm = Llama(
        model_path=spec["model"],
        n_ctx=spec.get("max_model_len", 2048),
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
    )

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        outs: list[list[int]] = []
        for prompt in prompts:
            new: list[int] = []
            llm.reset()  # no reuse of the previous prompt's KV: every run prefills its prompt
            for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                new.append(int(tok))
                if len(new) == n:
                    break
            outs.append(new)
        return outs

    return Engine(
        generate,
        {
            "name": "llama.cpp",
            "version": llama_cpp.__version__,
            "dtype": "gguf (as stored)",
            "threads": threads,
            "batching": "one sequence at a time (llama-cpp-python Llama)",
            # the instruction sets this build uses (AVX2 or AVX-512: scripts/setup_peers.sh)
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        },
    )


if __name__ == "__main__":
    run_worker(build)
