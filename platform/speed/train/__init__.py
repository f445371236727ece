"""Training on Ray Train: job configs, the per-worker loop, checkpoints that resume exactly, the driver.

- ``speed.train.config``: ``JobConfig`` and its sections, parsed from YAML and flags; run names.
- ``speed.train.origin``: what ``--init-from`` names (a Hugging Face form, an imported LM, a platform checkpoint).
- ``speed.train.launch``: the driver's stages and ``run_job`` (what the training jobs call); its first stage,
  ``speed.train.tokenizer_stage``, resolves the tokenizer and the model config (no Ray).
- ``speed.train.loop``: ``train_loop_per_worker``, what every Ray Train worker runs; ``speed.train.worker_checkpoint``:
  what a worker holds, and its checkpoints (save, restore, the completion marker).
- ``speed.train.families``: both model families trained and evaluated side by side (``jobs/compare_families.py``).
- ``speed.train.optim``, ``speed.train.state``: the optimizer and its schedule; training checkpoints.
- ``speed.train.sharding``: FSDP (``--strategy fsdp``) and its sharded checkpoints.
- ``speed.train.memory_plan``: what a worker holds at a step's peak, printed (and checked) before a job starts.
- ``speed.train.recurrence``: Huginn's sampled loop count per step (``--recurrence-sampling``).

This package imports nothing itself: the optimizer, checkpoint, sharding, plan and recurrence modules load without
Ray (``jobs/gpu_check.py`` trains on a machine that has none); only the driver and the loop import it.
"""
