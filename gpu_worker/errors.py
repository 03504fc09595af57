"""Typed errors raised by the engine and its helpers.

The edge (HTTP gateway, jobs runner) maps these to client-facing codes:
`InvalidRequestError` and its subclasses are 4xx / error lines (the caller's fault, never retried);
`EngineError` is a 5xx (the engine's fault); `ModelLoadError` stops a worker at start-up.
"""

from __future__ import annotations

__all__ = ["EngineError", "InvalidRequestError", "ModelLoadError", "PromptTooLongError"]


class EngineError(Exception):
    """An internal engine failure (not caused by the request's content)."""


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as given (bad sampling params, bad prompt, ...).

    Subclasses `ValueError` so plain validation code can raise or catch either.
    """


class PromptTooLongError(InvalidRequestError):
    """The prompt has more tokens than the model accepts.

    Attributes:
        prompt_tokens: number of tokens in the prompt.
        max_model_len: the engine's `max_model_len` (tokens, prompt + output).
    """

    def __init__(self, prompt_tokens: int, max_model_len: int, message: str | None = None) -> None:
        self.prompt_tokens = int(prompt_tokens)
        self.max_model_len = int(max_model_len)
        if message is None:
            message = (
                f"prompt has {self.prompt_tokens} tokens, more than max_model_len="
                f"{self.max_model_len}"
            )
        super().__init__(message)

    def __reduce__(self):  # keep pickling/copying working with the custom __init__
        return (type(self), (self.prompt_tokens, self.max_model_len, str(self)))


class ModelLoadError(RuntimeError):
    """A model (weights, config or tokenizer) could not be found or loaded."""
