"""The OpenAI-compatible HTTP gateway (``laneserve api``).

Modules: ``config`` (ApiConfig), ``app`` (create_app, state, health/models/metrics routes),
``completions`` (chat and text completions, SSE), ``generate`` (fan-out to the broker, merging,
disconnect handling), ``schemas`` (body validation), ``model_info`` (tokenizer, prompt-length
checks), ``format`` (OpenAI response objects, logprobs, SSE framing), ``auth`` (API key, body
limit), ``files`` (files and batches over jobs.service), ``metrics`` (Prometheus), ``errors``.
"""

from __future__ import annotations

from laneserve.api.config import ApiConfig

__all__ = ["ApiConfig", "create_app"]


def create_app(config: ApiConfig):  # noqa: ANN201 - lazy import keeps `import laneserve.api` light
    from laneserve.api.app import create_app as _create_app

    return _create_app(config)
