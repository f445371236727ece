"""What the job entry points share: a user's mistakes end in one ``error: ...`` line and exit status 2.

A mistake (an unknown preset, a bad pattern, a missing file, a bad ``--set``)
is found while the job's settings are parsed and checked, before any work
starts; ``user_errors()`` turns it into that line. Faults after that point keep
their tracebacks.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import yaml

from speed.config import ConfigError

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


@contextmanager
def user_errors() -> Iterator[None]:
    """Around the parsing and checking of a job's settings: a ``USER_ERRORS`` exception exits with status 2."""
    try:
        yield
    except USER_ERRORS as err:
        message = str(err).strip() or type(err).__name__
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(USAGE_STATUS) from None
