"""bench_offline.py --peers: llama.cpp through `llama-cpp-python` (built from source, see
scripts/setup_peers.sh), on the GGUF file itself (Q4_1).

`llama-cpp-python`'s high-level `Llama` serves one sequence at a time, so the offline run is the
prompts one after another (its default way to run a list of prompts). Greedy (top-k 1); the
end-of-generation tokens are masked so every prompt gets exactly the forced length.
"""

from __future__ import annotations

from typing import Any

from common import Engine, run_worker


def build(spec: dict[str, Any]) -> Engine:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama, LogitsProcessorList

    threads = spec.get("threads") or 2
    llm = Llama(
        model_path=spec["model"],
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
    )
    vocab = llm._model.vocab  # noqa: SLF001 - no public accessor for the vocabulary handle
    eog = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]

    def no_eog(_ids: Any, logits: np.ndarray) -> np.ndarray:
        logits[eog] = -np.inf
        return logits

    processors = LogitsProcessorList([no_eog])

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        outs: list[list[int]] = []
        for prompt in prompts:
            new: list[int] = []
            llm.reset()  # no reuse of the previous prompt's KV: every run prefills its prompt
            for tok in llm.generate(
                prompt, top_k=1, temp=0.0, reset=True, logits_processor=processors
            ):
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
            "eog_tokens_masked": len(eog),
        },
    )


if __name__ == "__main__":
    run_worker(build)
