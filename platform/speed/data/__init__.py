"""Data for pretraining and finetuning: tasks, sources, span corruption, tokenisation, batching."""

from speed.data.sources import HUB, RecordError, Records, Source, load_records, read_records, resolve_source
from speed.data.tasks import TASKS, Task, get_task

__all__ = [
    "HUB",
    "TASKS",
    "RecordError",
    "Records",
    "Source",
    "Task",
    "get_task",
    "load_records",
    "read_records",
    "resolve_source",
]
