"""Where a task split's records come from: local files or a hub data set.

A source is, in this order: ``None`` (the task's local corpus under
``speed.paths.data_dir()``), ``"hub"`` (the task's own hub data set), an
existing path, glob or list of paths (JSON Lines, gzipped or not, or Parquet;
a folder holds ``<split>.jsonl.gz`` or ``<split>-*.parquet`` files), or any
other string, read as a hub name with an optional ``:config``
(``"wmt/wmt14:de-en"``).
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from speed.data.tasks import Task
from speed.paths import data_dir

HUB = "hub"  # source alias for the task's own hub data set
JSON_SUFFIXES = (".jsonl.gz", ".json.gz", ".jsonl", ".json")
PARQUET_SUFFIX = ".parquet"
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Source:
    """Where a split's records come from: local files, or a hub data set."""

    files: tuple[Path, ...] = ()
    hub_path: str | None = None
    hub_config: str | None = None
    streaming: bool = False

    def __str__(self) -> str:
        if self.hub_path is not None:
            return f"hub:{self.hub_path}" + (f":{self.hub_config}" if self.hub_config else "")
        shown = ", ".join(str(f) for f in self.files[:3])
        return shown + (f" (+{len(self.files) - 3} more)" if len(self.files) > 3 else "")


def resolve_source(task: Task, split: str, source: str | Sequence[str] | None) -> Source:
    """The files or hub data set that ``source`` names for ``task``'s ``split``."""
    if source is None:
        if task.local_dir is None:
            raise ValueError(
                f"task {task.name!r} has no local corpus under {data_dir()}; pass source='hub' "
                f"({task.hub_path}) or file paths"
            )
        return Source(files=split_files(data_dir() / task.local_dir, split))
    if not isinstance(source, str):
        return Source(files=_expand([str(s) for s in source]))
    if source == HUB:
        return Source(hub_path=task.hub_path, hub_config=task.hub_config, streaming=task.streaming)
    if _looks_local(source):
        path = Path(source).expanduser()
        return Source(files=split_files(path, split) if path.is_dir() else _expand([source]))
    name, _, config = source.partition(":")
    if not config and name == task.hub_path:
        config = task.hub_config or ""
    return Source(hub_path=name, hub_config=config or None, streaming=task.streaming)


def split_files(directory: Path, split: str) -> tuple[Path, ...]:
    """The data files of ``split`` in ``directory``: ``<split>.<ext>`` or shards ``<split>-*.<ext>``."""
    if not directory.is_dir():
        raise FileNotFoundError(f"data folder {directory} does not exist (set $SPEED_DATA_DIR or pass a source)")
    stems = {f: _stem(f.name) for f in sorted(directory.iterdir()) if _stem(f.name) is not None}
    files = tuple(f for f, stem in stems.items() if stem == split or stem.startswith(split + "-"))
    if not files:
        available = sorted({stem.split("-")[0] for stem in stems.values()})
        raise FileNotFoundError(f"no {split!r} split in {directory}; splits there: {available}")
    return _check_types(files)


def _stem(name: str) -> str | None:
    """The file name without its data suffix; None for a file that is not a data file."""
    for suffix in (*JSON_SUFFIXES, PARQUET_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def _looks_local(source: str) -> bool:
    return (
        Path(source).expanduser().exists()
        or any(c in source for c in _GLOB_CHARS)
        or source.startswith(("/", ".", "~"))
        or _stem(source) is not None
    )


def _expand(patterns: list[str]) -> tuple[Path, ...]:
    files: list[Path] = []
    for pattern in patterns:
        path = Path(pattern).expanduser()
        if any(c in pattern for c in _GLOB_CHARS):
            matches = sorted(Path(p) for p in glob.glob(str(path)))
            if not matches:
                raise FileNotFoundError(f"no files match {pattern!r}")
            files.extend(matches)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"no such data file: {path}")
    if not files:
        raise FileNotFoundError("no data files given")
    return _check_types(tuple(files))


def _check_types(files: tuple[Path, ...]) -> tuple[Path, ...]:
    unknown = [str(f) for f in files if _stem(f.name) is None]
    if unknown:
        raise ValueError(f"unsupported data files {unknown}: expected .jsonl[.gz], .json[.gz] or .parquet")
    if len({f.name.endswith(PARQUET_SUFFIX) for f in files}) > 1:
        raise ValueError(f"mixed JSON and Parquet files in one source: {[str(f) for f in files]}")
    return files
