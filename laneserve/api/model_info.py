"""Load the served model's names, tokenizer and context length for the gateway (no torch).

The checks themselves live in :class:`laneserve.contracts.openai.model.ServedModel` (shared with the jobs
runner); this module resolves the ``--model`` flag (a bundled alias, a ``.gguf`` file whose
converted cache ``<stem>.hf/`` holds the tokenizer, or a Hugging Face directory).
"""

from __future__ import annotations

from laneserve.api.config import ApiConfig
from laneserve.contracts.openai.model import ServedModel


def load_served_model(config: ApiConfig) -> ServedModel:
    """The served model of ``config`` (blocking: about a second to read ``tokenizer.json``).

    Raises:
        gpu_worker.errors.ModelLoadError: the model path or alias does not exist.
        contracts.tokens.TokenizerError: no tokenizer files (the message says what to run).
    """
    if config.model is None:
        return ServedModel(
            served_name=config.served_model_name,
            max_model_len=config.max_model_len,
            tool_call_parser=config.tool_call_parser,
        )
    from laneserve.gpu_worker.model_files import model_display_name, resolve_model_path

    name = config.served_model_name or model_display_name(config.model)
    served = ServedModel.load(resolve_model_path(config.model), name, config.max_model_len)
    served.tool_call_parser = config.tool_call_parser
    return served
