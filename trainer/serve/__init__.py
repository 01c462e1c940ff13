"""``trainer serve``: an OpenAI-compatible HTTP server over the batched engine (trainer/decoding/batch.py).

- ``cli``: the command; ``app``: the FastAPI routes, request validation and OpenAI-shaped errors;
- ``worker``: the engine thread, hot reload of published snapshots, verifier-log records;
- ``metrics``: the Prometheus metrics of ``/metrics``.
"""
