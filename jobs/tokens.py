"""The served model of the jobs runner: names, tokenizer and context length, without torch.

DESIGN.md "Edge validation": the jobs runner counts prompt tokens with the model's tokenizer and
the engine's rule, through the same :class:`laneserve.contracts.openai.model.ServedModel` as the gateway,
so an over-length prompt becomes an error line before any inference, worded as the API's 400.
"""

from __future__ import annotations

from laneserve.contracts.openai.model import ServedModel
from laneserve.jobs.limits import DEFAULT_MAX_MODEL_LEN


def load_served_model(
    model: str, served_name: str, max_model_len: int | None = None, *, tokenizer: bool = True
) -> ServedModel:
    """The served model ``model`` (a bundled alias, a ``.gguf`` file with its converted cache,
    or a HF directory) named ``served_name``. ``max_model_len`` may only lower the model's
    (default: its ``max_position_embeddings``, else 8192). Without ``tokenizer`` only the name
    is known (no length checks, no map-reduce).

    Raises:
        gpu_worker.errors.ModelLoadError: the model path or alias does not exist.
        contracts.tokens.TokenizerError: no tokenizer files (the message says what to run).
    """
    if not tokenizer:
        return ServedModel(served_name=served_name)
    from laneserve.gpu_worker.model_files import resolve_model_path

    served = ServedModel.load(resolve_model_path(model), served_name, max_model_len)
    if served.max_model_len is None:
        served.max_model_len = DEFAULT_MAX_MODEL_LEN
    return served
