"""Serving SPEED: a Ray Serve application around the continuous-batching engine, its statistics and load tools.

- ``speed.serve.app``: the FastAPI-ingress deployment (``build_app`` for ``serve run``/config files)
- ``speed.serve.runner``: one engine per replica, stepped by an asyncio loop (no Ray)
- ``speed.serve.protocol``: the OpenAI-style request and response models
- ``speed.serve.schemas``: the statistics' files and row schemas; ``speed.serve.sink`` writes them (write-ahead
  logs, Parquet, orphans compacted), ``speed.serve.readers`` reads them back
- ``speed.serve.metrics``: a replica's live counters (``GET /v1/stats``) and Prometheus metrics
- ``speed.loadtest.loadgen``: closed- and open-loop HTTP load; ``speed.benchmarks.serving``: the serving benchmark
"""
