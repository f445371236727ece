"""A replica's live settings (Serve's ``user_config``): capacity, row budget, request defaults, statistics and
body limits; unknown keys are errors (``speed.config.from_dict``)."""

from __future__ import annotations

from dataclasses import dataclass

from speed.data import get_task
from speed.engine import METHODS, EngineConfig, Method, SpeculationFields
from speed.paths import repo_root

DEFAULT_STATS_PATH = str(repo_root() / "runs" / "serve")


@dataclass(frozen=True)
class ServeSettings(SpeculationFields):
    """A replica's live settings: Serve's ``user_config``, applied by ``reconfigure``; unknown keys are errors.

    Its ``SpeculationFields`` (``launch_loop`` .. ``min_confidence``; ``speculation`` makes them one) are SPEED's
    settings of the requests that leave them out."""

    max_active: int = 16  # engine capacity: requests decoded at once
    # longest prompt in tokens (the engine's max_prompt_len): a T5's encoder input (task prefix and EOS included),
    # a looped LM's whole context (chat template, task instruction and every chat message included)
    max_source_len: int = 128
    max_target_len: int = 128  # largest max_tokens
    row_budget: int | None = None  # rows per engine step; None: every in-flight row
    method: Method = "speed"  # defaults for requests that leave them out (SPEED's settings: SpeculationFields)
    task: str | None = None  # the task of text prompts that name none (T5: its prefix; an LM: its instruction)
    max_tokens: int = 64
    trace: bool = True  # per-request flip traces to Parquet
    threads: int | None = None  # torch CPU threads of the replica; None: torch's choice
    flush_rows: int = 256  # statistics: write the buffer as Parquet at this many records ...
    flush_s: float = 30.0  # ... or when the oldest buffered record is this old
    max_prompts: int = 32  # prompts in one request (a longer prompt array is a 400)
    max_body_bytes: int = 1 << 20  # request body size (a larger body is a 413, refused before it is read)

    def __post_init__(self) -> None:
        super().__post_init__()  # SPEED's settings
        positive = ("max_active", "max_source_len", "max_target_len", "max_tokens", "flush_rows")
        for name in (*positive, "max_prompts", "max_body_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"ServeSettings.{name} must be an integer >= 1, got {value!r}")
        for name in ("row_budget", "threads"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"ServeSettings.{name} must be an integer >= 1 or null, got {value!r}")
        if self.method not in METHODS:
            raise ValueError(f"ServeSettings.method must be one of {METHODS}, got {self.method!r}")
        if self.task is not None:
            get_task(self.task)
        if self.max_tokens > self.max_target_len:
            raise ValueError(f"ServeSettings.max_tokens {self.max_tokens} exceeds max_target_len {self.max_target_len}")
        if type(self.trace) is not bool:
            raise ValueError(f"ServeSettings.trace must be true or false, got {self.trace!r}")
        if not _number(self.flush_s) or self.flush_s <= 0:
            raise ValueError(f"ServeSettings.flush_s must be a positive number, got {self.flush_s!r}")

    def engine_config(self) -> EngineConfig:
        """The engine's fixed capacity and budget."""
        return EngineConfig(
            max_active=self.max_active,
            max_source_len=self.max_source_len,
            max_target_len=self.max_target_len,
            row_budget=self.row_budget,
            trace=self.trace,
        )

    def check_model(self, n_loops: int) -> None:
        """``ValueError`` when a request default needs more loops than the served model's ``n_loops``."""
        try:
            self.speculation.check_loops(n_loops)
        except ValueError as err:
            raise ValueError(f"ServeSettings: {err}") from None


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
