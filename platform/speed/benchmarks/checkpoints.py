"""Random checkpoints of published looped LMs at their full size, in their published layouts: what loading at real
sizes is measured on (``speed.benchmarks.loading``) where the real download is out of reach.

    python -m speed.benchmarks.checkpoints Huginn-0125 /tmp/fullsize/Huginn-0125   # 15.6 GB of float32 shards
    python -m speed.benchmarks.checkpoints Ouro-1.4B /tmp/fullsize/Ouro-1.4B       # bfloat16
    python -m speed.benchmarks.checkpoints Ouro-2.6B /tmp/fullsize/Ouro-2.6B

``PUBLISHED`` holds each model's config.json (the published fields the importers read, with the published values:
``speed.benchmarks.shapes``), its stored dtype and whether its tied head is stored beside the embedding (Huginn-0125
is published with two copies of its tied embedding, under ``transformer.wte.weight`` and ``lm_head.weight``). The
tensors are the importer's own list of published names and shapes (``convert_ouro.ouro_shapes``,
``convert_huginn.huginn_shapes``), random (seeded, each tensor from its own generator; the tied copy the same
values again), in shards of at most ``SHARD_BYTES`` (transformers' default ``max_shard_size``) named as
``save_pretrained`` names them, with ``model.safetensors.index.json``. Each file is written tensor by tensor: the
writer holds one tensor at a time, never a shard. A word-level ``tokenizer.json`` covering the whole vocabulary
(one token per id, the special tokens at the published ids) and a chat template make the directory servable.

``write_checkpoint(out, published)`` takes any ``Published``: a tiny config runs the same code (the tests').
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from speed.benchmarks.shapes import HUGINN_0125, OURO_1_4B
from speed.config import LMConfig
from speed.models.convert_huginn import EMBEDDING as HUGINN_EMBEDDING
from speed.models.convert_huginn import FREQS
from speed.models.form import Form, form_of

SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Published:
    """A published model's layout: its config.json, the dtype its files store, whether a tied head is stored as a
    second copy of the embedding, and its tokenizer's special tokens (id -> token; ``bos``, ``eos`` name two)."""

    name: str
    config: dict
    dtype: torch.dtype
    tied_copy: bool = False
    specials: dict[int, str] = field(default_factory=dict)
    eos: str = "<|endoftext|>"
    bos: str | None = None

    @property
    def form(self) -> Form:
        return form_of(self.config)

    def lm_config(self) -> LMConfig:
        return self.form.config(self.config)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """The published tensors in the published order, and their shapes (a tied head's copy only if stored)."""
        shapes = self.form.shapes(self.config)  # type: ignore[attr-defined]
        if self.tied_copy or not self.lm_config().tie_embeddings:
            return shapes
        return {n: s for n, s in shapes.items() if n != "lm_head.weight"}


@dataclass(frozen=True)
class Written:
    """A written checkpoint: its directory, its weight files, their bytes and the parameters they store."""

    directory: Path
    files: list[str]
    bytes: int
    parameters: int


def ouro(name: str, layers: int) -> Published:
    config = OURO_1_4B | {
        "architectures": ["OuroForCausalLM"], "num_hidden_layers": layers, "bos_token_id": 0,
        "early_exit_threshold": 1.0, "torch_dtype": "bfloat16", "rope_scaling": None, "use_sliding_window": False,
    }  # fmt: skip
    specials = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"}
    return Published(name, config, torch.bfloat16, specials=specials)


HUGINN_SPECIALS = {65504: "<|begin_text|>", 65505: "<|end_text|>", 65506: "<|im_start|>", 65507: "<|im_end|>"}
PUBLISHED = {
    "Huginn-0125": Published(
        "Huginn-0125",
        HUGINN_0125
        | {
            "architectures": ["RavenForCausalLM"],
            "bos_token_id": 65504,
            "eos_token_id": 65505,
            "torch_dtype": "float32",
            "tie_word_embeddings": True,
        },  # fmt: skip
        torch.float32,
        tied_copy=True,
        specials=HUGINN_SPECIALS,
        eos="<|end_text|>",
        bos="<|begin_text|>",
    ),
    "Ouro-1.4B": ouro("Ouro-1.4B", 24),
    "Ouro-2.6B": ouro("Ouro-2.6B", 48),
}


def write_checkpoint(out: str | Path, published: Published, seed: int = 0, shard_bytes: int = SHARD_BYTES) -> Written:
    """``published``'s directory at ``out``: config.json, the shards (or one ``model.safetensors``) with their index,
    the tokenizer; one tensor in memory at a time."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(published.config, indent=2) + "\n")
    shapes = published.tensors()
    kept = {FREQS: torch.float32}  # a persistent buffer, stored float32 whatever the weights
    itemsize = {name: kept.get(name, published.dtype).itemsize for name in shapes}
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize[name]
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    seeds = {name: seed * 100_003 + i for i, name in enumerate(shapes)}
    if published.tied_copy:
        seeds["lm_head.weight"] = seeds[HUGINN_EMBEDDING]  # the same values, stored twice
    weight_map = {}
    for file, names in zip(files, shards):
        entries = {name: (shapes[name], kept.get(name, published.dtype)) for name in names}
        _write_safetensors(out / file, entries, lambda name: _tensor(name, shapes[name], seeds[name], published))
        weight_map |= dict.fromkeys(names, file)
    total = sum(math.prod(shapes[name]) * itemsize[name] for name in shapes)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _write_tokenizer(out, published)
    return Written(out, files, total, sum(math.prod(s) for s in shapes.values()))


def _tensor(name: str, shape: tuple[int, ...], seed: int, published: Published) -> torch.Tensor:
    """One published tensor, random and seeded: norms ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.5^2), the embedding ~
    N(0, 1 / d), matrices ~ N(0, 1 / fan_in) (so that activations stay of order 1 through every loop)."""
    if name == FREQS:  # the rotary table, as Huginn computes it: (1, T, 1, D/2, [cos, sin])
        half = shape[3]
        theta = published.config["rope_base"] ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(shape[1], dtype=torch.float64)[:, None] * theta
        return torch.stack([angles.cos(), angles.sin()], -1).float().reshape(shape)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))  # scaled in place: one tensor held
    if "norm" in name or name.endswith("ln_f.weight"):
        noise.mul_(0.1).add_(1.0)
    else:
        noise.mul_(0.5 if name.endswith("bias") else 1 / math.sqrt(shape[-1]))
    return noise.to(published.dtype)


def _write_safetensors(path: Path, entries: Mapping[str, tuple[tuple[int, ...], torch.dtype]], make) -> None:
    """A safetensors file of ``entries`` (name -> shape, dtype), each tensor made by ``make(name)`` and written
    before the next is made: the header (byte ranges from the shapes alone, padded to 8 bytes), then the data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (shape, dtype) in entries.items():
        nbytes = math.prod(shape) * dtype.itemsize
        ranges = [offset, offset + nbytes]
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": ranges}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as file:
        file.write(len(text).to_bytes(8, "little") + text)
        for name, (_, dtype) in entries.items():
            tensor = make(name).to(dtype).contiguous()
            file.write(tensor.view(-1).view(torch.uint8).numpy().data)
            del tensor


def _write_tokenizer(out: Path, published: Published) -> None:
    """A word-level tokenizer with one token per id of the vocabulary (``w{id}``, the special tokens at their ids)
    and a ChatML template: every id the random model may emit decodes, and chats render."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab_size = published.lm_config().vocab_size
    vocab = {published.specials.get(i, f"w{i}"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=published.specials.get(0, "w0")))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in published.specials.values()])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"eos_token": published.eos, "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"}
    if published.bos:
        config["bos_token"] = published.bos
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str]) -> None:
    """``NAME OUT``: write ``PUBLISHED[NAME]`` at OUT; prints its files and bytes."""
    if len(argv) != 2 or argv[0] not in PUBLISHED:
        sys.exit(f"usage: python -m speed.benchmarks.checkpoints {{{','.join(PUBLISHED)}}} OUT_DIR")
    written = write_checkpoint(argv[1], PUBLISHED[argv[0]])
    print(f"{written.directory}: {len(written.files)} file(s), {written.bytes / 1e9:.2f} GB, "
          f"{written.parameters / 1e9:.3f}e9 parameters stored")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
