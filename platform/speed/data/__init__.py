"""Data for pretraining and finetuning: tasks, sources, span corruption, tokenisation, batching."""

from speed.data.batching import collate, pad_inputs, tokenize_records, truncate
from speed.data.records import RecordError, Records, load_records, read_records
from speed.data.sources import HUB, Source, resolve_source
from speed.data.spans import Corrupted, CorruptionLengths, corruption_lengths, random_spans_noise_mask, span_corruption
from speed.data.tasks import TASKS, Task, get_task

__all__ = [
    "HUB",
    "TASKS",
    "Corrupted",
    "CorruptionLengths",
    "RecordError",
    "Records",
    "Source",
    "Task",
    "collate",
    "corruption_lengths",
    "get_task",
    "load_records",
    "pad_inputs",
    "random_spans_noise_mask",
    "read_records",
    "resolve_source",
    "span_corruption",
    "tokenize_records",
    "truncate",
]
