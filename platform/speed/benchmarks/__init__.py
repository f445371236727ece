"""The benchmarks: every measurement that compares variants side by side in one run, ratios never typed in.

- ``speed.benchmarks.decode`` (T5, and what both families share), ``speed.benchmarks.decode_lm`` (the looped LM):
  decode latency, sequential vs SPEED vs the shallow decoder; ``jobs/bench_decode.py``.
- ``speed.benchmarks.shapes``: decode latency at the published models' real shapes (random weights) against the
  machine's read bandwidth measured in the same run; ``jobs/bench_shapes.py``.
- ``speed.benchmarks.precision``: bf16 weights' greedy tokens against float32's on a trained looped LM;
  ``jobs/bench_agreement.py``.
- ``speed.benchmarks.sampling``: SPEED under seeded sampling against sequential sampling; ``jobs/bench_sampling.py``.
- ``speed.benchmarks.levers``: SPEED's levers on trained checkpoints, side by side; ``jobs/bench_levers.py``.
- ``speed.benchmarks.heldout``: the trained-checkpoint benchmarks' workload (held-out inputs) and its scoring.
- ``speed.benchmarks.data``: the data stage at scale (preparation time, per-worker peak memory); ``jobs/bench_data.py``.
- ``speed.benchmarks.serving``: one request at a time vs continuous batching, sequential vs SPEED, over HTTP;
  ``jobs/bench_serve.py``.
- ``speed.benchmarks.loading``: ``speed.from_pretrained`` at real sizes: load time and peak resident set over the
  weights beside the memory check's figure, each dtype in a fresh process; ``speed.benchmarks.checkpoints`` writes
  the full-size random checkpoints in the published layouts it runs on.
- ``speed.benchmarks.end_to_end``: one directory as a user meets it: the memory check, the load, SPEED equal to
  sequential, a two-request chat through Serve in bf16 weights, the check's figures beside the resident sets.
- ``speed.benchmarks.gpu``: the GPU check, every CUDA path once (training, CPU agreement, decode timing,
  pytest -m gpu) on a machine without Ray; ``jobs/gpu_check.py``. Its stages: ``speed.benchmarks.gpu_correctness``
  (exactness, agreement, training), ``speed.benchmarks.gpu_timing`` (launches, shapes, llama, timing) and
  ``speed.benchmarks.gpu_train`` (FSDP at Ouro-1.4B's shape against the memory plan); their size,
  ``speed.benchmarks.gpu_setup``.
- ``speed.benchmarks.train_memory``: a training step's peak memory on the CPU, measured beside the memory plan,
  with and without activation checkpointing, under DDP and under FSDP (two gloo workers);
  ``python -m speed.benchmarks.train_memory``.
"""
