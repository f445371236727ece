"""The task registry: which data set a task reads, which fields, and how inputs are prefixed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """A data set layout and how its records become model inputs.

    ``source_field``/``target_field`` are dotted paths into a record
    (``"translation.en"``). A task without a target is a pretraining corpus:
    its records become one ``text`` column that span corruption turns into
    inputs and targets.
    """

    name: str
    hub_path: str  # the data set on the Hugging Face hub
    hub_config: str | None  # its configuration (subset), e.g. "de-en"
    streaming: bool  # stream from the hub instead of downloading (corpora too big to download, like c4)
    local_dir: str | None  # folder under speed.paths.data_dir() holding <split>.jsonl.gz; None: no local copy
    source_field: str
    target_field: str | None = None
    prefix: str = ""  # T5's task prefix, put before every source text
    instruction: str = ""  # the looped LM's: the start of its prompt's user turn (``speed.chat.task_prompt``)
    metrics: tuple[str, ...] = ()  # what evaluation reports: "bleu", "chrf", "rouge"

    @property
    def is_pretrain(self) -> bool:
        """A corpus of plain text (column ``text``) rather than source/target pairs."""
        return self.target_field is None

    @property
    def columns(self) -> dict[str, str]:
        """Output column -> the record field it is read from."""
        if self.is_pretrain:
            return {"text": self.source_field}
        return {"source": self.source_field, "target": self.target_field}


def _summarization(
    name: str, hub: str, hub_config: str | None, local_dir: str | None, document: str, summary: str, instruction: str
) -> Task:
    """A summarization task: a hub dataset's documents and summaries, under T5's ``summarize:`` prefix, scored by
    ROUGE."""
    return Task(name, hub, hub_config, streaming=False, local_dir=local_dir, source_field=document,
                target_field=summary, prefix="summarize: ", instruction=instruction, metrics=("rouge",))  # fmt: skip


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task("pretrain", "allenai/c4", "en", streaming=True, local_dir="pretrain_text", source_field="text"),
        Task("translate_en_de", "wmt/wmt16", "de-en", streaming=False, local_dir="multi30k_en_de",
             source_field="translation.en", target_field="translation.de", prefix="translate English to German: ",
             instruction="Translate to German: ", metrics=("bleu", "chrf")),
        _summarization("summarize", "EdinburghNLP/xsum", None, "news_headlines", "document", "summary",
                       instruction="Write a headline for this article: "),
        _summarization("summarize_cnn_dailymail", "abisee/cnn_dailymail", "3.0.0", None, "article", "highlights",
                       instruction="Summarize: "),
    )
}  # fmt: skip


def lm_task(task: Task) -> Task:
    """The task as the looped LM reads it: its instruction, not T5's prefix, before every source text."""
    return dataclasses.replace(task, prefix=task.instruction)


def get_task(name: str) -> Task:
    """The registered task ``name``; an unknown name is an error listing the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]
