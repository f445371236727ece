"""What a replica serves and how: the served model (loaded once), its live settings, how the application is
deployed, and how a request's decoding is named.

``load_served_model`` loads a checkpoint (a path or URI, or a run's newest) or a Hugging Face model directory
(``speed.models.pretrained.load_pretrained``) with its tokenizer, family and chat template.
``ServeSettings`` is Serve's ``user_config``: capacity, row budget, request defaults, statistics and body limits;
unknown keys are errors (``speed.config.from_dict``). ``AppConfig`` is how ``speed.serve.app.start_app`` deploys
the application: the replicas' checkpoint and ``user_config``, the deployment's resources, the HTTP proxy.
``decoding`` names how a request is decoded (method, SPEED's settings, seed, sampling) as answers and statistics
records give it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from speed.chat import ChatRenderer
from speed.config import from_dict
from speed.data import get_task
from speed.engine import LEVERS, METHODS, EngineConfig, Method, Request, SpeculationFields
from speed.engine.defaults import device_levers
from speed.hf_tokenizer import chat_renderer, load_tokenizer
from speed.models.checkpoint import checkpoint_family
from speed.models.family import Family, get_family
from speed.models.precision import DTYPES, dtype_named, with_dtype
from speed.models.pretrained import load_pretrained
from speed.paths import repo_root
from speed.tokenizer import TextTokenizer

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
    cost_model: bool = True  # the engine runs the speculative rows the device's measured pass cost says pay
    # (speed.engine.cost, measured as the replica starts; capped by row_budget); False: every row, or the budget's
    # runner-up branches: the engine's cache holds their side entries (M^2 per slot, speed.engine.memory), and a
    # request may ask for them; None: as the replica's device's default SPEED (a GPU's uses them, a CPU's does not),
    # or on where ``branches`` (the requests' default) is set
    allow_branches: bool | None = None
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
        if self.allow_branches not in (None, True, False):
            raise ValueError(f"ServeSettings.allow_branches must be true, false or null, got {self.allow_branches!r}")
        if self.allow_branches is None and self.branches:  # the requests' default asks for them: allocated
            object.__setattr__(self, "allow_branches", True)
        if self.allow_branches is False and self.branches:
            raise ValueError(f"ServeSettings: branches={self.branches} needs allow_branches: true")
        if self.max_tokens > self.max_target_len:
            raise ValueError(f"ServeSettings.max_tokens {self.max_tokens} exceeds max_target_len {self.max_target_len}")
        for name in ("trace", "cost_model"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"ServeSettings.{name} must be true or false, got {getattr(self, name)!r}")
        if not _number(self.flush_s) or self.flush_s <= 0:
            raise ValueError(f"ServeSettings.flush_s must be a positive number, got {self.flush_s!r}")

    def engine_config(self) -> EngineConfig:
        """The engine's fixed capacity and budget."""
        return EngineConfig(
            max_active=self.max_active,
            max_source_len=self.max_source_len,
            max_target_len=self.max_target_len,
            row_budget=self.row_budget,
            cost_model=self.cost_model,
            trace=self.trace,
            branches=bool(self.allow_branches),  # None (no device resolved it): none
        )

    @classmethod
    def on_device(cls, device: str, n_loops: int, user_config: dict[str, Any] | None) -> ServeSettings:
        """A replica's settings: ``user_config``, SPEED's settings it leaves out taking ``device``'s defaults
        (``speed.engine.defaults.device_levers``: runner-up branches with lanes on a GPU, plain SPEED on a CPU),
        and ``allow_branches`` left out on where those defaults or ``branches`` use branches; a deployment
        without branches takes none of the device's branch settings."""
        given = dict(user_config or {})
        levers = device_levers(device, n_loops)
        if given.get("allow_branches") is None:
            given["allow_branches"] = bool(given.get("branches", levers.get("branches")))
        if given["allow_branches"] is False:
            levers = {k: v for k, v in levers.items() if k not in ("branches", "branch_depth")}
        return from_dict(cls, levers | given)

    def check_model(self, n_loops: int) -> None:
        """``ValueError`` when a request default needs more loops than the served model's ``n_loops``."""
        try:
            self.speculation.check_loops(n_loops)
        except ValueError as err:
            raise ValueError(f"ServeSettings: {err}") from None


@dataclass(frozen=True)
class AppConfig:
    """How ``start_app`` deploys the application. ``settings`` is the replicas' ``user_config``
    (``ServeSettings`` keys; SPEED's settings it leaves out follow each replica's device), checked here so that
    a misspelled key fails before any replica starts."""

    checkpoint: str  # a checkpoint, run or Hugging Face model directory, a local path or a URI
    settings: dict[str, Any] = field(default_factory=dict)
    # each replica's
    stats_path: str = DEFAULT_STATS_PATH  # where its statistics go, local or a URI
    model_name: str | None = None  # the id in /v1/models; None: the checkpoint's (or model directory's) folder name
    device: str = "auto"  # "auto", "cpu", "cuda"
    exit_adapters: bool | None = None  # draft with the checkpoint's exit adapters; None: on a GPU yes, on a CPU no
    dtype: str = "float32"  # the weights': float32, or bfloat16 (bf16 weights: speed.models.precision)
    initial_state_seed: int | None = None  # Huginn's seeded random initial state (None: zero; load_pretrained)
    api_key: str | None = field(default=None, repr=False)  # every route but /healthz needs it; None: $SPEED_API_KEY
    # the deployment's
    name: str = "speed"
    route_prefix: str = "/"
    replicas: int = 1
    num_cpus: float = 1  # per replica
    num_gpus: float = 0
    max_ongoing_requests: int | None = None  # None: the deployment's own (speed.serve.app.SpeedServer)
    max_queued_requests: int | None = None
    max_replicas_per_node: int | None = None  # 1: each replica on a node of its own
    # Serve's HTTP proxy
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    proxy_location: str = "EveryNode"  # "HeadOnly": one proxy (nodes sharing a machine cannot all bind host:port)

    def __post_init__(self) -> None:
        from_dict(ServeSettings, dict(self.settings))
        if self.dtype not in DTYPES:
            raise ValueError(f"AppConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        seed = self.initial_state_seed
        if seed is not None and (type(seed) is not int or seed < 0):
            raise ValueError(f"AppConfig.initial_state_seed must be an integer >= 0 or null, got {seed!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"AppConfig.device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and self.num_gpus <= 0:  # Ray hides every GPU from a replica that asked for none
            raise ValueError("AppConfig.device='cuda' needs num_gpus > 0 per replica (Ray shows a replica its GPUs)")


def host_capacity(device: str, user_config: dict[str, Any] | None) -> EngineConfig | None:
    """The engine a replica on ``device`` builds for ``user_config`` where its cache is in the host's memory: a CPU
    replica's (SPEED's CPU defaults allocate no branches: ``device_levers``); None on a GPU, whose cache the GPU
    holds."""
    if str(device).split(":")[0] != "cpu":
        return None
    return from_dict(ServeSettings, dict(user_config or {})).engine_config()


@dataclass(frozen=True)
class ServedModel:
    """What a replica serves: the model (eval mode, on its device), its tokenizer (whose ``stop_ids`` end every
    answer), its family (the checkpoint's config.json names it) and, for an LM, the chat template its prompts are
    written in."""

    model: torch.nn.Module
    tokenizer: TextTokenizer  # a platform checkpoint's SentencePiece model, an imported model's ``HFTokenizer``
    family: Family  # how prompts become the model's inputs (``speed.models.family``)
    template: ChatRenderer | None  # an LM's: an imported model's own (its directory's Jinja template), else
    # config.json's ``chat_template`` (``speed.chat``'s when absent)
    packed_weights: int = 0  # weights packed for the native kernel (``pack_for_decoding``)


def load_served_model(
    checkpoint: str,
    device: str,
    exits: bool = True,
    dtype: str = "float32",
    user_config: dict[str, Any] | None = None,
    initial_state_seed: int | None = None,
) -> ServedModel:
    """The served model of a checkpoint path or URI (or a run's newest) or of a Hugging Face model directory, in
    ``dtype`` (``bfloat16``: bf16 weights, ``speed.models.precision.with_dtype``, as ``jobs/evaluate.py --dtype``),
    with Huginn's seeded random initial state under ``initial_state_seed`` (None: zero); one without its tokenizer
    (spm.model, tokenizer.json) is an error.

    Before anything is allocated the load is checked against the host's available memory
    (``speed.models.pretrained.check_load``): the weights, and on a CPU, where the key/value cache lies in the same
    memory, the engine that ``user_config`` (the deployment's ``ServeSettings``) asks for beside them
    (``host_capacity``); one that does not fit is one ``MemoryBudgetError`` line.

    With ``exits`` the checkpoint's exit adapters (``speed.models.exits``), when it has them, adapt the drafts; the
    answers are the same either way. A replica only decodes, so a looped LM's weights that run on the native kernel
    are packed for it (``pack_for_decoding``: 4-8 rows a pass at about one row's cost; ``packed_weights`` counts
    them, 0 for T5, a GPU or small float32 weights): its answers are those of offline decoding of the model packed
    the same way."""
    capacity = host_capacity(device, user_config)
    loaded = load_pretrained(  # read as dtype
        checkpoint, device, exits, dtype=dtype_named(dtype), capacity=capacity, initial_state_seed=initial_state_seed
    )
    if loaded.tokenizer_path is None:
        raise FileNotFoundError(f"{loaded.checkpoint} holds no spm.model nor tokenizer.json: serving needs one")
    tokenizer = load_tokenizer(loaded.tokenizer_path)  # reads the files into memory
    family = get_family(checkpoint_family(loaded.config))
    template = family.chat_template(loaded.config)
    template = template if template is None else chat_renderer(tokenizer, template)
    model = with_dtype(loaded.model.to(device), dtype_named(dtype)).eval()
    packed = model.pack_for_decoding()  # after the dtype: a panel's layout is its dtype's
    return ServedModel(model, tokenizer, family, template, packed)


def levers(request: Request) -> dict[str, Any]:
    """SPEED's settings of a request by name (``speed.engine.LEVERS``), as answers and statistics records give
    them: for a sequential request its launch loop and invalidation only, the rest null (they do not apply)."""
    s, speed = request.speculation, request.method != "sequential"
    return {name: getattr(s, name) if speed or name in ("launch_loop", "invalidation") else None for name in LEVERS}


def decoding(request: Request, seed: int) -> dict[str, Any]:
    """How a request is decoded, by name, as an answer's ``speed`` object and a statistics record give it: its
    method, SPEED's settings (``levers``), its exit gate's rule (null but for ``exit_gate``), the ``seed`` it was
    given and its sampling."""
    s, rule = request.sampling, request.exit_rule
    return {
        "method": request.method,
        **levers(request),
        "exit_kind": None if rule is None else rule.kind,
        "exit_threshold": None if rule is None or rule.kind != "threshold" else float(rule.threshold),
        "exit_step": None if rule is None or rule.kind != "step" else rule.step,
        "seed": seed,
        "temperature": float(s.temperature),
        "top_p": float(s.top_p),
        "top_k": s.top_k,
    }


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
