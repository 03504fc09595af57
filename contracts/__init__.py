"""What every laneserve process shares, torch-free and import-light (DESIGN.md, "Import direction").

- :mod:`laneserve.contracts.env`: every environment variable laneserve reads (type, default, meaning), read in
  one place, and ``LANESERVE_HOME`` resolution.
- :mod:`laneserve.contracts.latency`: the DESIGN per-phase latency fields (one function each, composed from
  per-hop monotonic intervals) and the one percentile rule.
- :mod:`laneserve.contracts.tokens`: tokenizer loading without torch and the one prompt-id rule (the engine's).
- :mod:`laneserve.contracts.openai`: the OpenAI request/response layer shared by the gateway and bulk-job lines.
- :mod:`laneserve.contracts.procs`: ``pid_alive`` and ``parent_gone``, the one rule by which every process
  watches its parent.

Every package may import ``contracts``; it imports none of them (and never torch).
"""
