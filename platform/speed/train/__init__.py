"""Training on Ray Train: job configs, the per-worker loop, checkpoints that resume exactly, the driver."""

from speed.train.config import JobConfig, job_from_args, job_from_dict, job_to_dict, run_name
from speed.train.launch import TrainOutcome, run_job

__all__ = ["JobConfig", "TrainOutcome", "job_from_args", "job_from_dict", "job_to_dict", "run_job", "run_name"]
