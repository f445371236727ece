"""What the job entry points share: a user's mistakes end in one ``error: ...`` line and exit status 2.

A mistake (an unknown preset, a bad pattern, a missing file, a bad ``--set``)
is found while the job's settings are parsed and checked, before any work
starts; ``user_errors()`` turns it into that line. Faults after that point keep
their tracebacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from speed.config import ConfigError

T = TypeVar("T")

USAGE_STATUS = 2  # argparse's status for a bad command line

# What parsing and checking a job's settings raise for a mistake of the user's (ConfigError is a ValueError).
USER_ERRORS = (ValueError, FileNotFoundError)


class JobParser(argparse.ArgumentParser):
    """``argparse`` whose errors are one ``error: ...`` line (plus where to find help), status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE_STATUS, f"error: {message} (see {self.prog} --help)\n")


def parse_yaml(text: str, where: str) -> Any:
    """``text`` as YAML; invalid YAML is a ``ConfigError`` naming ``where``."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML ({' '.join(str(err).split())})") from None


def parse_set(item: str) -> tuple[str, Any]:
    """One ``--set KEY=VALUE`` -> ``(KEY, VALUE parsed as YAML)``; no ``=`` or no key is a ``ConfigError``."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    return key, parse_yaml(value, f"--set {item}")


def config_from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """The dataclass ``cls`` from the flags named like its fields (``--max-tokens`` fills ``max_tokens``);
    ``given`` values (the flags that need a conversion) win, fields without a flag keep their defaults."""
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**(flags | given))


def add_report_flags(parser: argparse.ArgumentParser, out: Path | None, out_help: str | None = None) -> None:
    """A benchmark job's ``--threads`` (torch's threads) and the flags ``report_rows`` reads: ``--out``, the
    Parquet file (default ``out``), and ``--json``."""
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=out, help=out_help)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def add_weight_flags(parser: argparse.ArgumentParser, dtypes: tuple[str, ...]) -> None:
    """A job's flags for the weights it loads: ``--dtype`` (one of ``dtypes``, ``speed.models.precision.DTYPES``)
    and ``--initial-state-seed`` (a Huginn directory's initial state)."""
    parser.add_argument(
        "--dtype",
        choices=dtypes,
        default="float32",
        help="bfloat16: bf16 weights, the linear weights bfloat16 and the rest float32 (speed.models.precision)",
    )
    parser.add_argument(
        "--initial-state-seed",
        type=int,
        default=None,
        help="a Huginn directory's published random initial state, drawn under this seed (default: zero)",
    )


def report_rows(
    table: pa.Table,
    args: argparse.Namespace,
    format_table: Callable[[pa.Table], str],
    summary: dict[str, Any] | None = None,
) -> None:
    """A benchmark's rows written to ``args.out`` (Parquet), then printed: one JSON object of the flags, the rows
    and ``summary`` (its named figures, when given) with ``args.json``, else ``format_table``'s table, the
    summary and where the rows went."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
    if args.json:
        report = {"config": vars(args) | {"out": str(out)}, "rows": table.to_pylist()}
        print(json.dumps(report | ({"summary": summary} if summary else {}), default=str))
    else:
        print(format_table(table))
        if summary:
            print(", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
        print(f"rows written to {out}")


@contextmanager
def user_errors(errors: tuple[type[BaseException], ...] = USER_ERRORS) -> Iterator[None]:
    """Around the parsing and checking of a job's settings: an exception of ``errors`` (default ``USER_ERRORS``)
    exits with status 2."""
    try:
        yield
    except errors as err:
        message = str(err).strip() or type(err).__name__
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(USAGE_STATUS) from None
