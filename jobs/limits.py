"""Limits and constants of bulk jobs (DESIGN.md "Bulk jobs").

The numbers follow the OpenAI Batch API's published limits (50,000 requests and 200 MB per
input file; `custom_id` unique within a batch) so files prepared for OpenAI run here as they are.
"""

from __future__ import annotations

MAX_FILE_BYTES = 200 * 1024 * 1024  # bytes per input file (OpenAI Batch API: 200 MB)
MAX_LINES = 50_000  # requests per input file (OpenAI Batch API: 50,000)
MAX_CUSTOM_ID_CHARS = 512  # = requests.custom_id column width
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
TASKS = ("summarize", "translate", "extract", "embed")  # embed: the /v1/embeddings endpoint
DEFAULT_COMPLETION_WINDOW = "24h"  # the only window OpenAI accepts; "Ns|Nm|Nh" are accepted here
MAX_BAD_FRACTION = 0.5  # more than this fraction of bad lines fails the job at validation
MAX_JOB_ERRORS = 20  # line errors listed in a failed job's errors[]
DEFAULT_MAX_MODEL_LEN = 8192  # SmolLM2 (config.json max_position_embeddings)
DEFAULT_TASK_MAX_TOKENS = 256  # completion tokens per task-shorthand document
