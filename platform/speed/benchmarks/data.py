"""The data-at-scale benchmark: preparation time and per-worker peak memory as a corpus grows.

A corpus of ``scale`` copies of a split's files (symbolic links in a work
folder: same text, no disk) is prepared once per scale; then a fresh process
opens it as a training worker does (memory map, batch plan) and collates
``steps`` batches. Each measurement runs in its own process, so its peak
resident memory (``ru_maxrss``) is its own. ``measure_in_memory`` measures the
path training took before the preparation stage (every worker tokenizing the
whole split into Python lists) for comparison.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from speed.data.sources import split_files
from speed.paths import checkout_env

_MIB = 1024 * 1024


@dataclass(frozen=True)
class WorkerMemory:
    """What one worker-like process held: peak and current resident memory, in MiB."""

    peak_mib: float  # ru_maxrss: the process's high-water mark, mapped file pages included
    baseline_mib: float  # resident after importing torch and speed, before any data
    anon_mib: float  # RssAnon at the end: private memory (the mapped shards are RssFile, shared and reclaimable)
    examples: int
    seconds: float  # opening, planning and collating


def replicate(split_dir: Path, split: str, scale: int, out: Path) -> Path:
    """A folder holding ``scale`` copies of ``split``'s files as ``<split>-NNNNN...`` links."""
    out.mkdir(parents=True, exist_ok=True)
    for copy in range(scale):
        for f in split_files(split_dir, split):
            link = out / f"{split}-{copy:05d}{f.name.removeprefix(split)}"  # train.jsonl.gz -> train-00000.jsonl.gz
            if not link.is_symlink():
                link.symlink_to(f.resolve())
    return out


def peak_mib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def status_mib(field: str) -> float:
    """A memory field of /proc/self/status (e.g. RssAnon, VmRSS), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def measure_worker(uri: str, batch_size: int, steps: int) -> WorkerMemory:
    """Open a prepared corpus as a worker does and collate ``steps`` batches of its plan (call in a fresh process)."""
    import torch  # noqa: F401  (a worker has it loaded: part of the baseline)

    from speed.data import collate
    from speed.data.corpus import open_corpus
    from speed.train.batches import BatchPlan

    baseline = _warm_baseline(collate)
    started = time.perf_counter()
    corpus = open_corpus(uri)
    plan = BatchPlan(corpus.lengths, batch_size, seed=0, group_by_length=True)
    for step in range(steps):
        for indices in plan.micro_batches(step):
            collate(corpus.examples(indices, plan.epoch_at(step), seed=0))
    return WorkerMemory(peak_mib(), baseline, status_mib("RssAnon"), len(corpus), time.perf_counter() - started)


def measure_in_memory(spec_json: str, tokenizer: str, batch_size: int, steps: int) -> WorkerMemory:
    """The same, the way workers did before: tokenize the whole split into Python lists (a fresh process)."""
    import datasets
    import torch  # noqa: F401

    from speed.data import collate, load_records, tokenize_records
    from speed.data.shards import CorpusSpec
    from speed.tokenizer import Tokenizer
    from speed.train.batches import BatchPlan

    datasets.disable_progress_bars()
    spec = CorpusSpec(**json.loads(spec_json))
    baseline = _warm_baseline(collate)
    started = time.perf_counter()
    records = load_records(spec.task, spec.split, spec.source, spec.limit)
    ds = tokenize_records(
        records, spec.task, Tokenizer.load(tokenizer), spec.max_source_len, spec.max_target_len, pack=spec.pack
    )
    examples = [{"input_ids": i, "labels": t} for i, t in zip(ds["input_ids"], ds["labels"])]
    plan = BatchPlan(
        [len(e["input_ids"]) + len(e["labels"]) for e in examples], batch_size, seed=0, group_by_length=True
    )
    for step in range(steps):
        for indices in plan.micro_batches(step):
            collate([examples[i] for i in indices])
    return WorkerMemory(peak_mib(), baseline, status_mib("RssAnon"), len(examples), time.perf_counter() - started)


def _warm_baseline(collate: Callable[[list[dict]], dict]) -> float:
    """Resident MiB once torch has made its first tensors: what a worker holds before any data."""
    collate([{"input_ids": [5, 1], "labels": [1]}])
    return status_mib("VmRSS")


def in_subprocess(function: str, *args: object) -> dict:
    """Run ``speed.benchmarks.data.<function>(*args)`` in a fresh interpreter (importing this checkout's speed);
    its result as a dict."""
    code = (
        "import json, sys; from dataclasses import asdict; import speed.benchmarks.data as b; "
        f"print(json.dumps(asdict(b.{function}(*json.loads(sys.argv[1])))))"
    )
    command = [sys.executable, "-c", code, json.dumps(list(args))]
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=checkout_env()).stdout
    return json.loads(out.strip().splitlines()[-1])


@dataclass(frozen=True)
class PrepareRun:
    """One preparation, measured in its own process."""

    seconds: float
    records: int
    examples: int
    shards: int
    peak_mib: float
    uri: str
    cached: bool  # found prepared: the time is a cache hit's, not a preparation's


def measure_prepare(spec_json: str, tokenizer: str, root: str, docs_per_shard: int, use_ray: bool) -> PrepareRun:
    """Prepare a corpus (call in a fresh process): wall time, counts and the preparing process's peak memory."""
    from speed.data.shards import CorpusSpec, prepare_corpus

    if use_ray:
        import ray

        from speed.cluster import local_ray_options

        ray.init(address="local", include_dashboard=False, log_to_driver=False, **local_ray_options())
    spec = CorpusSpec(**json.loads(spec_json))
    started = time.perf_counter()
    prepared = prepare_corpus(
        spec,
        tokenizer,
        root,
        docs_per_shard=docs_per_shard,
        use_ray=use_ray,
        log=lambda line: print(line, file=sys.stderr),
    )
    m = prepared.manifest
    seconds = time.perf_counter() - started
    return PrepareRun(seconds, m.records, m.examples, len(m.shards), peak_mib(), prepared.uri, prepared.cached)


def as_row(scale: int, prep: dict, worker: dict, before: dict | None) -> dict:
    """One table row."""
    return {
        "scale": scale,
        "records": prep["records"],
        "examples": prep["examples"],
        "shards": prep["shards"],
        "prepare_s": prep["seconds"],
        "cached": prep["cached"],
        "prepare_peak_mib": prep["peak_mib"],
        "worker_peak_mib": worker["peak_mib"],
        "worker_data_mib": worker["peak_mib"] - worker["baseline_mib"],
        "worker_anon_mib": worker["anon_mib"],
        "before_peak_mib": before["peak_mib"] if before else None,
        "before_s": before["seconds"] if before else None,
    }


def format_rows(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    header = (
        "| corpus | records | examples | shards | prepare s | prepare peak MiB | worker peak MiB | "
        "worker data MiB | before: worker peak MiB | before: s |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for r in rows:
        before = (
            f"{r['before_peak_mib']:.0f} | {r['before_s']:.0f}" if r["before_peak_mib"] is not None else "not run | "
        )
        lines.append(
            f"| {r['scale']}x | {r['records']:,} | {r['examples']:,} | {r['shards']} | {r['prepare_s']:.0f}"
            f"{' (cached)' if r['cached'] else ''} | "
            f"{r['prepare_peak_mib']:.0f} | {r['worker_peak_mib']:.0f} | {r['worker_data_mib']:.0f} | {before} |"
        )
    return "\n".join(lines)
