"""Serving SPEED: a Ray Serve application around the continuous-batching engine, its statistics and load tools.

- ``speed.serve.app``: the FastAPI-ingress deployment (``build_app`` for ``serve run``/config files)
- ``speed.serve.runner``: one engine per replica, stepped by an asyncio loop (no Ray)
- ``speed.serve.protocol``: the OpenAI-style request and response models
- ``speed.serve.stats``: Parquet schemas, the statistics sink and the live counters
- ``speed.serve.loadgen``: closed- and open-loop HTTP load; ``speed.benchmarks.serving``: the serving benchmark
"""
