"""The OpenAI-compatible HTTP gateway (``laneserve api``).

Modules: ``config`` (ApiConfig), ``app`` (create_app, the models routes), ``state``
(GatewayState: the app's shared state and lifespan), ``probes`` (health/ready/metrics routes, the
metrics port), ``arrival`` (the request's arrival stamp), ``completions`` (chat and text
completions, SSE), ``tokenize`` (/tokenize, /detokenize, /v1/models/{id}),
``generate`` (fan-out to the broker, merging, disconnect handling, edge TTFT), ``model_info``
(loads the served model), ``auth`` (API key, body limit), ``files`` (files and batches over
jobs.service), ``metrics`` (Prometheus), ``errors`` (error responses).

Body validation, prompt counting, response objects and error objects are the shared OpenAI layer
:mod:`laneserve.contracts.openai` (the same code checks bulk-job lines); the process never imports torch.
"""

from __future__ import annotations

from laneserve.api.config import ApiConfig

__all__ = ["ApiConfig", "create_app"]


def create_app(config: ApiConfig):  # noqa: ANN201 - lazy import keeps `import laneserve.api` light
    from laneserve.api.app import create_app as _create_app

    return _create_app(config)
