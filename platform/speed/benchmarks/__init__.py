"""The benchmarks: every measurement that compares variants side by side in one run, ratios never typed in.

- ``speed.benchmarks.decode``: decode latency (sequential vs SPEED vs the shallow decoder) and seeded sampling;
  ``jobs/bench_decode.py``, ``jobs/bench_sampling.py``.
- ``speed.benchmarks.data``: the data stage at scale (preparation time, per-worker peak memory); ``jobs/bench_data.py``.
- ``speed.benchmarks.serving``: one request at a time vs continuous batching, sequential vs SPEED, over HTTP;
  ``jobs/bench_serve.py``.
- ``speed.benchmarks.gpu``: the GPU check, every CUDA path once (training, CPU agreement, decode timing,
  pytest -m gpu) on a machine without Ray; ``jobs/gpu_check.py``.
"""
