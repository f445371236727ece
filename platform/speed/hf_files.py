"""Read a Hugging Face model directory: its ``config.json`` and its safetensors weights, nothing else.

A foundation module: it imports nothing from ``speed``, and never runs code from the directory. A
``config.json`` may name remote code (``auto_map``: classes in ``*.py`` files beside it, which
``transformers`` imports under ``trust_remote_code``); ``remote_code`` reports it, and nothing here
imports it.

- ``read_config(dir)``: the parsed ``config.json``, or a one-line ``ModelFilesError``.
  Which published form a config describes is the registry's (``speed.models.form.form_of``), not this module's.
- ``tensor_shapes(dir)``: every tensor's name, shape and stored dtype, from the safetensors headers alone.
- ``read_weights(dir, dtype, expected, optional)``: the tensors, each allocated as ``dtype`` (floating-point ones)
  and filled by ``read_into``; checked against ``expected`` (name -> shape) before any is read, with a one-line
  ``WeightsError`` naming what is missing, unexpected or of the wrong shape.
- ``read_into(dir, destinations, copies)``: each tensor copied into a tensor the caller allocated (a parameter, rows
  of a fused one), shard by shard: read straight into it where the stored dtype is its own, else in chunks of
  ``CHUNK_BYTES`` converted as they are copied; a stored copy of a tied tensor compared with it on the way.
- ``weights_bytes(expected, dtype)``: what those tensors take in memory, before reading them.

Weights are ``model.safetensors``, or shards named by ``model.safetensors.index.json`` (its
``weight_map``: tensor name -> shard file), as ``transformers`` looks for them (the single file first).
Only safetensors are read: a directory with ``pytorch_model.bin`` alone is refused (a pickle can run
code when loaded). Directories are local paths. A safetensors file is an 8-byte header length, a JSON header
(name -> dtype, shape, byte range) and the raw data, so each tensor's bytes are read with ``readinto`` from
their offset straight into their destination: what a memory map would give, without its cost, since a map's
touched pages count in the resident set beside the model until unmapped (a second copy at the peak), while read
pages go to the page cache, which the kernel drops under pressure.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")

CHUNK_BYTES = 16 * 2**20  # a tensor converted or compared as it is read goes through a buffer of at most this
NAMES_SHOWN = 5  # names listed in an error before "(+N more)"
# safetensors' dtype names -> torch's (the formats a checkpoint of the platform's forms holds)
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


class ModelFilesError(ValueError):
    """A model directory's files are missing, malformed or not of a form the platform loads (one line)."""


class WeightsError(ModelFilesError):
    """The weights are missing, unreadable, or not the tensors (names and shapes) asked for (one line)."""


def read_config(directory: str | Path) -> dict:
    """The directory's ``config.json``, parsed; a one-line ``ModelFilesError`` when missing or malformed."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise ModelFilesError(f"{path}: no such file (a Hugging Face model directory has a {CONFIG})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFilesError(f"{path}: not valid JSON ({_one_line(error)})") from None
    if not isinstance(config, dict):
        raise ModelFilesError(f"{path}: a JSON {type(config).__name__}, not an object")
    return config


def remote_code(config: Mapping) -> dict[str, str]:
    """The classes ``config.json`` names as remote code (``auto_map``: auto class -> ``module.Class``), to report.

    Never imported here: the platform computes these models with its own code."""
    auto_map = config.get("auto_map") or {}
    if not isinstance(auto_map, Mapping):
        return {}
    # An entry may be a list ([slow, fast] tokenizer classes): shown as given.
    return {str(key): value if isinstance(value, str) else repr(value) for key, value in auto_map.items()}


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it; a one-line ``WeightsError`` when there are none."""
    directory = Path(directory)
    single, index = directory / SINGLE, directory / INDEX
    if single.is_file():
        return dict.fromkeys(_header_names(single), single)
    if index.is_file():
        return _indexed_files(index)
    pickles = [name for name in PICKLES if (directory / name).is_file()]
    if pickles:
        raise WeightsError(
            f"{directory}: only {pickles[0]}, and only safetensors are read ({SINGLE} or {INDEX} with its shards): "
            "a pickle can run code when loaded; save the model with safe_serialization"
        )
    raise WeightsError(f"{directory}: no weights ({SINGLE}, or {INDEX} with its shards)")


def tensor_shapes(directory: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, stored dtype as safetensors names it: ``"BF16"``, ``"F32"``), from the headers."""
    return _shapes(weight_files(directory))


def read_weights(
    directory: str | Path,
    dtype: torch.dtype | None = torch.float32,
    expected: Mapping[str, tuple[int, ...]] | None = None,
    optional: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """The directory's tensors by name, floating-point ones as ``dtype`` (``None``: as stored).

    With ``expected`` (name -> shape), every name in it but those in ``optional`` must be present, no other
    name may be, and each shape must match; all of this is checked from the headers before any tensor is
    read, and a failure is one ``WeightsError`` line naming the problem. Each tensor is allocated in its final
    dtype and filled by ``read_into``: loading holds the tensors once, plus one chunk."""
    stored = _stored(weight_files(directory))
    if expected is not None:
        check_shapes(directory, {name: s.shape for name, s in stored.items()}, expected, optional)
    weights = {
        name: torch.empty(s.shape, dtype=dtype if dtype is not None and s.dtype.is_floating_point else s.dtype)
        for name, s in stored.items()
    }
    read_into(directory, weights)
    return weights


def read_into(
    directory: str | Path, destinations: Mapping[str, torch.Tensor], copies: Mapping[str, str] | None = None
) -> None:
    """Copy each named tensor of the directory into its destination (a tensor of the same shape: a parameter, or
    rows of a fused one), shard by shard, converting to the destination's dtype as it is copied; names and shapes
    are the caller's to check first (``check_shapes``). The model's memory is allocated once, by the caller: a
    tensor stored in its destination's dtype is read straight into it, any other in chunks of ``CHUNK_BYTES``
    (so loading adds at most a chunk, whatever the largest tensor).

    ``copies`` (stored name -> the destination name it duplicates: a tied head stored beside its embedding) are
    compared with their original chunk by chunk, as stored, while the original is read (no copy kept); a copy that
    differs is one ``WeightsError`` line. A copy the directory does not store is not looked for."""
    stored = _stored(weight_files(directory))
    twins: dict[str, list[_Stored]] = {}
    for copy, original in (copies or {}).items():
        if copy in stored:
            twins.setdefault(original, []).append(stored[copy])
    with _Files() as files:
        for _, names in _by_file({name: stored[name].path for name in destinations}).items():
            for name in names:
                _fill(files, stored[name], destinations[name], twins.get(name, ()))


def check_shapes(
    where: str | Path,
    found: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    optional: Collection[str] = (),
) -> None:
    """A one-line ``WeightsError`` (prefixed ``where``) unless ``found`` holds every ``expected`` name but the
    ``optional`` ones, no other name, and each with its expected shape."""
    missing = [name for name in expected if name not in found and name not in optional]
    unexpected = [name for name in found if name not in expected]
    problems = []
    if missing:
        problems.append(f"{len(missing)} expected tensor{_s(missing)} missing: {_names(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor{_s(unexpected)}: {_names(unexpected)}")
    wrong = [name for name in expected if name in found and tuple(found[name]) != tuple(expected[name])]
    if wrong:
        first = wrong[0]
        more = f" (+{len(wrong) - 1} more of the wrong shape)" if len(wrong) > 1 else ""
        problems.append(f"{first} has shape {_shape(found[first])}, expected {_shape(expected[first])}{more}")
    if problems:
        raise WeightsError(f"{where}: " + "; ".join(problems))


def weights_bytes(expected: Mapping[str, tuple[int, ...]], dtype: torch.dtype = torch.float32) -> int:
    """Bytes the tensors ``expected`` (name -> shape) take as ``dtype``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) for shape in expected.values()) * itemsize


# ---------------------------------------------------------------------------------------------------------------


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, data offsets; ``__metadata__`` dropped) and
    where its data starts: the file is an 8-byte little-endian header length, the JSON header, then the data."""
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, struct.error, UnicodeDecodeError, ValueError) as error:
        raise WeightsError(f"{path}: not a readable safetensors file ({_one_line(error)})") from None
    header.pop("__metadata__", None)
    return header, 8 + length


@dataclass(frozen=True)
class _Stored:
    """Where one tensor lies: its file, stored dtype and shape, its data's first byte in the file and its bytes."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _stored(files: Mapping[str, Path]) -> dict[str, _Stored]:
    """Every tensor of ``files`` (name -> file) as its header places it; one header read per file."""
    found: dict[str, _Stored] = {}
    for path, names in _by_file(files).items():
        header, start = _header(path)
        for name in names:
            entry = header[name]
            if entry["dtype"] not in DTYPES:
                raise WeightsError(f"{path}: {name} is stored as {entry['dtype']}, which the platform does not read")
            begin, end = entry["data_offsets"]
            found[name] = _Stored(name, path, DTYPES[entry["dtype"]], tuple(entry["shape"]), start + begin, end - begin)
    return found


class _Files(contextlib.ExitStack):
    """The safetensors files a load reads, each opened once and closed at the end."""

    def __init__(self) -> None:
        super().__init__()
        self._open: dict[Path, BinaryIO] = {}

    def read(self, tensor: _Stored, start: int, into: torch.Tensor) -> None:
        """Bytes ``start`` onwards of ``tensor`` into ``into`` (a contiguous CPU tensor: its bytes are filled)."""
        if tensor.path not in self._open:
            self._open[tensor.path] = self.enter_context(open(tensor.path, "rb"))  # noqa: SIM115 (closed by the stack)
        file = self._open[tensor.path]
        file.seek(tensor.offset + start)
        if into.numel() and file.readinto(into.view(-1).view(torch.uint8).numpy()) != into.nbytes:
            raise WeightsError(f"{tensor.path}: {tensor.name} is cut short (the file ends inside it)")


def _fill(files: _Files, tensor: _Stored, destination: torch.Tensor, copies: Iterable[_Stored]) -> None:
    """``tensor`` into ``destination``: read straight in where it is a contiguous CPU tensor of the stored dtype
    and no copy is compared, else chunk by chunk, each converted as it is copied and compared with ``copies``."""
    copies = list(copies)
    for copy in copies:
        if (copy.dtype, copy.shape) != (tensor.dtype, tensor.shape):
            raise WeightsError(
                f"{copy.path}: {copy.name} is stored as a copy of {tensor.name} (tied), but as {copy.dtype} "
                f"{_shape(copy.shape)}, not {tensor.dtype} {_shape(tensor.shape)}"
            )
    direct = destination.dtype == tensor.dtype and destination.is_contiguous() and destination.device.type == "cpu"
    if direct and not copies:
        files.read(tensor, 0, destination)
        return
    contiguous = destination.is_contiguous()
    target = destination if contiguous else torch.empty_like(destination, memory_format=torch.contiguous_format)
    flat, itemsize = target.view(-1), tensor.dtype.itemsize
    step = max(1, CHUNK_BYTES // itemsize)
    chunk = torch.empty(min(step, flat.numel()), dtype=tensor.dtype)
    twin = torch.empty_like(chunk) if copies else None
    for first in range(0, flat.numel(), step):
        part = chunk[: min(step, flat.numel() - first)]
        files.read(tensor, first * itemsize, part)
        for copy in copies:
            files.read(copy, first * itemsize, twin[: part.numel()])
            if not torch.equal(part.view(torch.uint8), twin[: part.numel()].view(torch.uint8)):
                raise WeightsError(f"{copy.path}: tied checkpoint, but {copy.name} differs from {tensor.name}")
        flat[first : first + part.numel()].copy_(part)
    if not contiguous:
        destination.copy_(target)


def _shapes(files: Mapping[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for path, names in _by_file(files).items():
        header, _ = _header(path)
        for name in names:
            shapes[name] = (tuple(header[name]["shape"]), header[name]["dtype"])
    return shapes


def _header_names(path: Path) -> list[str]:
    return list(_header(path)[0])


def _indexed_files(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise WeightsError(f"{index}: not a safetensors index with a weight_map ({_one_line(error)})") from None
    if not isinstance(weight_map, Mapping) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsError(f"{index}: weight_map is not an object of tensor name -> shard file name")
    files = {name: index.parent / shard for name, shard in weight_map.items()}
    for shard, names in _by_file(files).items():
        if not shard.is_file():
            raise WeightsError(f"{index}: shard {shard.name} (holding {len(names)} tensors) is missing")
        held = set(_header_names(shard))
        absent = [name for name in names if name not in held]
        if absent:
            raise WeightsError(
                f"{shard}: lacks {len(absent)} tensor{_s(absent)} the index puts there: {_names(absent)}"
            )
        unindexed = sorted(held.difference(names))
        if unindexed:
            raise WeightsError(f"{shard}: holds {len(unindexed)} tensor{_s(unindexed)} the index does not name: "
                               f"{_names(unindexed)}")
    return files


def _by_file(files: Mapping[str, Path]) -> dict[Path, list[str]]:
    grouped: dict[Path, list[str]] = {}
    for name, path in files.items():
        grouped.setdefault(path, []).append(name)
    return grouped


def _names(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" (+{len(names) - NAMES_SHOWN} more)" if len(names) > NAMES_SHOWN else "")


def _shape(shape: Iterable[int]) -> str:
    return str(tuple(int(n) for n in shape))


def _s(items: Collection) -> str:
    return "" if len(items) == 1 else "s"


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
