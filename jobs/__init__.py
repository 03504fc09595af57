"""Bulk jobs (DESIGN.md "Bulk jobs"): OpenAI batch files and the summarize/translate shorthand.

Modules, one concept each:

- `jobs.service`: the library API for the HTTP gateway and the CLI (files, batches: create,
  get, list, cancel, OpenAI objects). Start here.
- `jobs.files`: file rows and their content under `$LANESERVE_HOME/files/`.
- `jobs.validate`: line-by-line validation before any inference (`Validator`).
- `jobs.tokens`: prompt token counting with the model's tokenizer (`PromptCounter`).
- `jobs.prompts`: task prompt templates and the map-reduce split of long documents.
- `jobs.results`: broker submit arguments in, OpenAI batch output lines out.
- `jobs.store`: the runner's SQL operations (lines, idempotent results, counters, files).
- `jobs.runner`: `JobsRunner`, the `laneserve jobs-runner` process loop.
- `jobs.limits`, `jobs.errors`: constants and typed errors.
"""
