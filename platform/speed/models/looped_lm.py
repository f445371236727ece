"""A decoder-only looped transformer of Llama blocks, with an early exit after every loop.

Layout ``P+NxM+C`` (``speed.config.SharingPattern``): each token's embedding
runs once through a prelude of P layers; a core of N unique layers then runs
M times in CYCLE order (loop i runs core layers 0..N-1); after each loop the
exit, that is the coda's C layers, the final RMS norm and the LM head, gives
that loop's logits. The coda belongs to the exit, not to the loop: it reads
the loop's core output, and what feeds the next loop is that core output
(``loop_norm``: its final-norm output, as in Ouro), never the coda's. So a
loop whose exit is evaluated costs N + C layers, and a token that runs all M
loops P + M * (N + C); the coda writes keys and values at every loop, so it
always runs (``with_logits=False`` skips only the head). With input injection
(Huginn) each loop's input is ``adapter([state, e])``, e the prelude's output
and state the previous loop's output, zero before the first loop, or with an
``InitialState`` (Huginn's published default) a random draw that depends on
the seed and the token's position alone, the same in every path. The options of the
published looped LMs (Ouro, Huginn-0125; ``LMConfig``'s docstring) hold in
both paths alike.

Keys and values have one entry per virtual layer: (loop, core layer) and
(loop, coda layer) in ``LMCache.loops``, and the prelude's, which run once, in
``LMCache.prelude``. Two paths compute the same logits: ``forward`` over
whole (B, T) sequences (training, teacher forcing, the reference), and the
cached incremental path, ``prefill`` of a prompt plus ``step``, one group pass
of the loop over rows each at its own loop and position (the model's call in
one of the engine's pipeline steps), on the batch-invariant kernels of
``speed.engine.kernels`` as T5's (``speed.models.steppers.T5Stepper.step``) is.

Shapes: B batch, T length, R decode rows (n in one tile), d d_model, W the
carry's width (d, or 2d with injection), H query heads, K key/value heads
(H a multiple of K), D head_dim, L key positions, V vocabulary, M loops, N
core, P prelude and C coda layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from speed.config import LMConfig, RopeLayout
from speed.engine import native
from speed.engine.cache import KVCache, Rows, StagedIndex, StagedView, kv_bytes, pool_blocks
from speed.engine.kernels import (
    ATTN_CHUNK,
    TILE_ROWS,
    BiasFree,
    attention_triton,
    chunk_span,
    fused_block_on,
    in_tiles,
    pack_linears,
    rows_linear,
    rows_norm,
    tile_gated,
    tile_linear,
    tile_residual,
    tile_rms_norm,
    tile_rope,
    tile_rope_qkv,
)
from speed.engine.memory import MemoryNeed
from speed.engine.rows import to_device
from speed.engine.sampling import truncated_normals
from speed.engine.types import Admitted
from speed.losses import LoopOutput, gate_objective, loop_output
from speed.models.exits import ExitAdapters, exit_logits
from speed.models.steppers import ModelStepper

Store = Callable[[Tensor, Tensor], None]  # receives one prompt's keys and values at a virtual layer (1, K, T, D)
Segment = tuple[int, int]  # a prompt's rows in a prefill: (first row, length)


def rotary(positions: Tensor, head_dim: int, theta: float, layout: RopeLayout = "halves") -> tuple[Tensor, Tensor]:
    """cos and sin (..., D) of the rotary angles at integer ``positions`` (...), in ``layout``.

    Frequency f_i = theta^(-2i/D) for i < D/2, the angle of dimension pair i:
    ``halves`` (Llama) pairs dimension i with i + D/2, so f is repeated for
    both halves; ``pairs`` (Huginn) pairs 2i with 2i + 1, so each f_i is
    repeated in place (``rotate``, ``rotate_pairs``).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)  # (D/2,)
    freqs = positions[..., None].float() * inv_freq  # (..., D/2)
    angles = torch.cat([freqs, freqs], dim=-1) if layout == "halves" else freqs.repeat_interleave(2, dim=-1)  # (..., D)
    return angles.cos(), angles.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Head vectors x (..., D) rotated by the angles of cos/sin (broadcast to x), the ``halves`` layout.

    Dimension pairs (a, b) = (i, i + D/2) become (a cos - b sin, b cos + a sin).
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # in x's dtype, as Llama's and Ouro's rotary embeddings
    first, second = x.chunk(2, dim=-1)  # 2 x (..., D/2)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``rotate`` in the ``pairs`` layout: dimension pairs (a, b) = (2i, 2i + 1) become (a cos - b sin,
    b cos + a sin)."""
    even, odd = x[..., 0::2], x[..., 1::2]  # 2 x (..., D/2)
    turned = x * cos + torch.stack([-odd, even], dim=-1).flatten(-2) * sin  # in float32, as Huginn's
    return turned.to(x.dtype)


def _call(layer: nn.Linear, x: Tensor) -> Tensor:
    """``layer(x)``: the whole-sequence path's way of applying a layer (the cached path's: the row kernels)."""
    return layer(x)


CHECKPOINTING = ("none", "block", "loop")


@dataclass(frozen=True)
class TrainRun:
    """How a training forward runs the loops; the default is the plain forward (every loop, every exit).

    ``loops``: the recurrences this forward runs (Huginn's sampled count; None: the model's M). ``backprop``: only
    the last K of them keep gradients, the earlier ones run under ``no_grad`` (Huginn's truncated backpropagation;
    None: all). Either makes the forward Huginn's: only the last loop's exit is computed, so the loss is that
    loop's alone. ``checkpoint``: activation checkpointing, ``block`` (each block's activations recomputed in the
    backward pass, only its input kept) or ``loop`` (each loop's core and coda as one). ``gate_entropy``: Ouro's
    gate objective with this entropy coefficient (``speed.losses.gate_objective``) in place of fixed weights.
    """

    loops: int | None = None
    backprop: int | None = None
    checkpoint: str = "none"
    gate_entropy: float | None = None

    def __post_init__(self) -> None:
        if self.checkpoint not in CHECKPOINTING:
            choices = list(CHECKPOINTING)
            raise ValueError(f"unknown activation checkpointing {self.checkpoint!r}; choose one of {choices}")
        for name in ("loops", "backprop"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"TrainRun.{name} must be positive or None, got {value}")
        if self.gate_entropy is not None and self.last_only:
            raise ValueError("the gate objective weighs every loop's exit: it cannot train the last loop's alone")

    @property
    def last_only(self) -> bool:
        """Whether only the last loop's exit is computed (a sampled or truncated recurrence)."""
        return self.loops is not None or self.backprop is not None


FULL_RUN = TrainRun()


def _plain(block: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return block(x, cos, sin)


def _checkpointed(block: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``block(x, cos, sin)`` keeping only its input for the backward pass, which recomputes the rest."""
    if not torch.is_grad_enabled():
        return block(x, cos, sin)
    return checkpoint(block, x, cos, sin, use_reentrant=False)


class Attention(nn.Module):
    """Causal self-attention with rotary positions and K key/value heads, each shared by H/K query heads;
    with ``qk_bias`` a learned bias on queries and keys before their rotation (Huginn)."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        H, K, D = config.n_heads, config.n_kv_heads, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim, self.layout = H, K, D, config.rope_layout
        self.qkv = nn.Linear(config.d_model, (H + 2 * K) * D, bias=False)  # q;k;v
        self.o = nn.Linear(H * D, config.d_model, bias=False)
        # Apart from qkv: the decode kernels take bias-free layers, and v has none.
        self.q_bias = nn.Parameter(torch.zeros(H, D)) if config.qk_bias else None
        self.k_bias = nn.Parameter(torch.zeros(K, D)) if config.qk_bias else None

    def _split(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (..., H, D), keys and values (..., K, D) of a fused projection (..., (H + 2K) * D), queries
        and keys biased (``qk_bias``) and rotated by cos/sin (..., D)."""
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = qkv.view(*qkv.shape[:-1], H + 2 * K, D).split([H, K, K], dim=-2)
        if self.q_bias is not None:
            q, k = q + self.q_bias, k + self.k_bias
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., 1, D): one angle for every head
        turn = rotate if self.layout == "halves" else rotate_pairs
        return turn(q, cos, sin), turn(k, cos, sin), v

    def _split_rows(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``_split`` for decode rows (n, (H + 2K) * D), angles (n, D): the rotations on ``tile_rope`` (the same
        bits, one call per head group)."""
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = qkv.view(qkv.shape[0], H + 2 * K, D).split([H, K, K], dim=-2)
        if self.q_bias is not None:
            q, k = q + self.q_bias, k + self.k_bias
        pairs = self.layout != "halves"
        turn = rotate_pairs if pairs else rotate
        return tile_rope(q, cos, sin, pairs, turn), tile_rope(k, cos, sin, pairs, turn), v

    def _share(self, kv: Tensor) -> Tensor:
        """Keys or values (..., K, T, D) repeated for the H/K query heads of each (as they are when K == H)."""
        group = self.n_heads // self.n_kv_heads
        return kv if group == 1 else kv.repeat_interleave(group, dim=1)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Causal attention over whole sequences (B, T, d), angles cos/sin (T, D)."""
        B, T, _ = x.shape
        q, k, v = self._split(self.qkv(x), cos, sin)  # (B, T, H, D), 2 x (B, T, K, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D), 2 x (B, K, T, D)
        k, v = self._share(k), self._share(v)  # 2 x (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D), scaled by D**-0.5
        return self.o(y.transpose(1, 2).reshape(B, T, -1))

    def prefill(
        self, x: Tensor, cos: Tensor, sin: Tensor, segments: Sequence[Segment], stores: Sequence[Store | None]
    ) -> Tensor:
        """Causal attention over several prompts given as rows (R, d) (angles cos/sin (R, D)): the projections
        on row tiles (``rows_linear``), the attention of each prompt alone; ``stores[b]`` gets prompt b's."""
        q, k, v = self._split(rows_linear(self.qkv, x), cos, sin)  # (R, H, D), 2 x (R, K, D)
        out = []
        for (start, T), store in zip(segments, stores):
            qb, kb, vb = (t[start : start + T].transpose(0, 1)[None] for t in (q, k, v))  # (1, H or K, T, D)
            if store is not None:
                store(kb, vb)
            y = F.scaled_dot_product_attention(qb, self._share(kb), self._share(vb), is_causal=True)  # (1, H, T, D)
            out.append(y[0].transpose(0, 1).reshape(T, -1))
        return rows_linear(self.o, torch.cat(out))

    def decode(
        self, x: Tensor, cos: Tensor, sin: Tensor, rows: Rows, cache: KVCache | StagedView, layer: int
    ) -> Tensor:
        """One new token per row of a tile (n, d) at its own position (angles cos/sin (n, D)).

        Writes the rows' keys/values at their virtual layers (their loop,
        ``layer``), then attends over each row's positions there (``KVCache.attend``; a staged pass's
        ``StagedView`` does both from its device index).
        """
        n, heads, pairs = x.shape[0], (self.n_heads, self.n_kv_heads), self.layout != "halves"
        qkv = tile_linear(self.qkv, x)  # (n, (H + 2K) D)
        biases, scale = (self.q_bias, self.k_bias), self.head_dim**-0.5
        q, k, v = tile_rope_qkv(qkv, cos, sin, heads, biases, pairs, scale, self._split_rows)  # (n, H or K, D)
        cache.write(layer, rows, k, v)
        y = cache.attend(layer, rows, q)  # (n, H, D)
        return tile_linear(self.o, y.reshape(n, -1))


class SwiGLU(nn.Module):
    """Llama's feed-forward: wo(silu(x w_gate) * (x w_up)), w_gate/w_up fused."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.wi = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)  # [gate; up]
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.wi(x).chunk(2, dim=-1)  # 2 x (..., F)
        return self.wo(F.silu(gate) * up)

    def decode(self, x: Tensor) -> Tensor:
        """The same for one tile of decode rows (n, d)."""
        return tile_linear(self.wo, tile_gated(self.wi, x, "silu"))  # (n, F) -> (n, d)

    def prefill(self, x: Tensor) -> Tensor:
        """The same for a prefill's rows (R, d), on row tiles."""
        gate, up = rows_linear(self.wi, x).chunk(2, dim=-1)  # 2 x (R, F)
        return rows_linear(self.wo, F.silu(gate) * up)


class Block(nn.Module):
    """``pre``: h += attn(norm(h)); h += mlp(norm(h)). ``sandwich`` (Ouro): each sublayer's output is normed too,
    h += out_norm(attn(norm(h))). ``residual`` (Huginn): each residual sum is, h = out_norm(h + attn(norm(h)))."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        d, eps = config.d_model, config.norm_eps
        self.norm_sum = config.norm == "residual"

        def out_norm() -> nn.Module:
            return nn.RMSNorm(d, eps=eps) if config.norm != "pre" else nn.Identity()

        self.attn_norm, self.attn, self.attn_out_norm = nn.RMSNorm(d, eps=eps), Attention(config), out_norm()
        self.mlp_norm, self.mlp, self.mlp_out_norm = nn.RMSNorm(d, eps=eps), SwiGLU(config), out_norm()

    def _add(self, x: Tensor, y: Tensor, out_norm: nn.Module, norm: Callable = nn.Module.__call__) -> Tensor:
        """The residual stream x plus a sublayer's output y, ``out_norm`` on y or on the sum (applied by ``norm``:
        the module's call, or the prefill rows' ``rows_norm``; the decode rows': ``tile_residual``)."""
        return norm(out_norm, x + y) if self.norm_sum else x + norm(out_norm, y)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = self._add(x, self.attn(self.attn_norm(x), cos, sin), self.attn_out_norm)
        return self._add(x, self.mlp(self.mlp_norm(x)), self.mlp_out_norm)

    def prefill(
        self, x: Tensor, cos: Tensor, sin: Tensor, segments: Sequence[Segment], stores: Sequence[Store | None]
    ) -> Tensor:
        """A prefill's rows (R, d) through this block (see ``Attention.prefill``), the norms per row
        (``rows_norm``: a prompt's rows never depend on the others')."""
        y = self.attn.prefill(rows_norm(self.attn_norm, x), cos, sin, segments, stores)
        x = self._add(x, y, self.attn_out_norm, rows_norm)
        return self._add(x, self.mlp.prefill(rows_norm(self.mlp_norm, x)), self.mlp_out_norm, rows_norm)

    def decode(
        self, x: Tensor, cos: Tensor, sin: Tensor, rows: Rows, cache: KVCache | StagedView, layer: int
    ) -> Tensor:
        """One tile of decode rows (n, d) through this block (see ``Attention.decode``), the norms on the decode
        rows' kernel (``tile_rms_norm``); on packed weights the whole block in one native call (``native.lm_block``,
        the same kernels in the same order: the same bits)."""
        if fused_block_on(x, rows, cache.native_attention):
            weights = self._block_weights(cos)
            if weights is not None:
                offsets, lengths = cache.claim(layer, rows)
                keys, values = cache.keys[layer], cache.values[layer]
                return native.lm_block(x, weights, cos, sin, keys, values, offsets, lengths, cache.pool_head_stride)
        y = self.attn.decode(tile_rms_norm(self.attn_norm, x), cos, sin, rows, cache, layer)
        x, h = tile_residual(x, y, self.attn_out_norm, self.norm_sum, self.mlp_norm)  # the stream, mlp_norm of it
        return tile_residual(x, self.mlp.decode(h), self.mlp_out_norm, self.norm_sum, None)[0]

    def _block_weights(self, cos: Tensor) -> native.BlockWeights | None:
        """What ``native.lm_block`` reads of this block, or None where it cannot run it: every linear packed
        (``pack_linears``) in one dtype, RMS norms of float32 gains, float32 angles."""
        a, m = self.attn, self.mlp
        linears = (a.qkv.weight, a.o.weight, m.wi.weight, m.wo.weight)
        if cos.dtype != torch.float32 or not cos.is_contiguous():
            return None
        if any(w.dim() != 3 or w.dtype != linears[0].dtype for w in linears):
            return None
        norms = (self.attn_norm, self.attn_out_norm, self.mlp_norm, self.mlp_out_norm)
        if not all(isinstance(n, nn.RMSNorm) and n.weight.dtype == torch.float32 for n in norms[::2]):
            return None
        if not all(isinstance(n, (nn.RMSNorm, nn.Identity)) for n in norms[1::2]):
            return None
        gains = [n.weight if isinstance(n, nn.RMSNorm) else None for n in norms]
        if any(g is not None and g.dtype != torch.float32 for g in gains):
            return None
        eps = tuple(
            (n.eps if n.eps is not None else torch.finfo(torch.float32).eps) if isinstance(n, nn.RMSNorm) else 0.0
            for n in norms
        )
        return native.BlockWeights(
            *linears, *gains, eps, self.norm_sum, a.q_bias, a.k_bias,
            a.n_heads, a.n_kv_heads, a.head_dim, m.wo.in_features, a.layout != "halves",
        )  # fmt: skip


@dataclass
class LMCache:
    """Keys/values of every virtual layer for ``n_slots`` sequences, in pools of blocks (see ``KVCache``).

    ``loops``: one entry per (loop, layer) of the looped layers, layer j < N
    the core's layer j and layer N + c the coda's layer c (the coda runs in
    every loop's exit). ``prelude``: the prelude's P layers, which run once per
    token (its only loop is 0), with as many side entries per slot as
    ``loops`` (a runner-up branch runs the prelude at its loop 0); None
    without a prelude.
    """

    loops: KVCache
    prelude: KVCache | None
    draws: dict[int, Tensor] = field(default_factory=dict)  # a staged pass's initial states by row count (static)

    @property
    def device(self) -> torch.device:
        return self.loops.device

    @property
    def n_blocks(self) -> int:
        """Blocks in each part's pool (the parts take the same blocks per slot, so they run out together)."""
        return self.loops.n_blocks

    @property
    def blocks_used(self) -> int:
        """Blocks taken now in the looped layers' pool (the prelude's takes the same)."""
        return self.loops.blocks_used

    def _parts(self) -> list[KVCache]:
        return [self.loops] if self.prelude is None else [self.prelude, self.loops]

    def invalidate(self, slot: int, from_pos: int) -> None:
        """Drop positions >= ``from_pos`` of ``slot`` at every virtual layer (no copy)."""
        for part in self._parts():
            part.invalidate(slot, from_pos)

    def reset(self, slot: int) -> None:
        """Empty ``slot``, e.g. for a new sequence."""
        for part in self._parts():
            part.reset(slot)

    def promote(self, slot: int, side: int, pos: int, loops_done: int) -> None:
        """Make the branch in side entry ``side`` of ``slot`` the token at ``pos`` (``KVCache.promote``); the
        prelude's entry is its loop 0's."""
        for part in self._parts():
            part.promote(slot, side, pos, loops_done)


@dataclass(frozen=True)
class InitialState:
    """A random state before the first loop of an injecting model (Huginn's published ``initialize_state``),
    reproducible: the state of the token at position p is ``std * z``, z (d,) standard normals truncated to +-3
    that depend on (seed, p, dimension) alone (``speed.engine.sampling.truncated_normals``): no global RNG, no
    batch, no step, so the forward, the prefill and every pipeline step draw the same state for a token, and SPEED
    equals sequential decoding under a seed. Without one (``LoopedLM.initial_state`` None) the state is zero."""

    seed: int
    std: float  # Huginn: init_values.std * init_scale * embed_scale (``convert_huginn.huginn_initial_state``)

    def __post_init__(self) -> None:
        if type(self.seed) is not int or self.seed < 0:
            raise ValueError(f"InitialState.seed must be an integer >= 0, got {self.seed!r}")
        if not (isinstance(self.std, (int, float)) and math.isfinite(self.std) and self.std > 0):
            raise ValueError(f"InitialState.std must be a positive number, got {self.std!r}")

    def draw(self, positions: Sequence[int] | Tensor | np.ndarray, like: Tensor) -> Tensor:
        """The states (R, d) of tokens at ``positions`` (R,), in ``like``'s dtype and device (d its last size)."""
        d = like.shape[-1]
        z = torch.stack([truncated_normals(self.seed, int(p), d) for p in torch.as_tensor(positions).tolist()])
        return (z * self.std).to(dtype=like.dtype, device=like.device)


class LoopedLM(nn.Module):
    """A ``P+NxM+C`` looped decoder-only LM: prelude once, core M times, an exit (coda, norm, head) per loop."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.sharing = sharing = config.sharing
        self.n_loops = sharing.n_loops
        self.eos_id, self.vocab_size = config.eos_id, config.vocab_size  # what decoding reads
        d = config.d_model
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.prelude = nn.ModuleList(Block(config) for _ in range(sharing.prelude))
        self.core = nn.ModuleList(Block(config) for _ in range(sharing.n_unique))
        self.coda = nn.ModuleList(Block(config) for _ in range(sharing.coda))
        self.adapter = nn.Linear(2 * d, d, bias=False) if config.injection else None  # [state, e] -> loop input
        # Apart from the adapter, as the query and key biases: the decode kernels take bias-free layers.
        self.adapter_bias = nn.Parameter(torch.zeros(d)) if config.adapter_bias else None
        self.norm = nn.RMSNorm(d, eps=config.norm_eps)  # the exits' final norm
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.exit_gate = nn.Linear(d, 1) if config.exit_gate else None  # each exit's lambda (``exit_lambdas``)
        self.apply(self._init_weights)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.exit_adapters: ExitAdapters | None = None  # early-exit adapters (speed.models.exits), never in model.pt
        self._initial_state: InitialState | None = None  # with injection: a random state before loop 1 (None: zero)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """Llama's initialisation: every weight matrix and the embedding N(0, 0.02), norm gains 1, biases 0."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def initial_state(self) -> InitialState | None:
        """The random state before the first loop (``InitialState``; Huginn's published default), or None: zero (the
        platform's default). Only a model with injection has a state to draw; the engine's and the forward's draws
        are the same for a token, so set it before decoding, not during."""
        return self._initial_state

    @initial_state.setter
    def initial_state(self, value: InitialState | None) -> None:
        if value is not None and (self.adapter is None or not isinstance(value, InitialState)):
            raise ValueError("an initial state needs a model with injection (LMConfig.injection) and an InitialState")
        self._initial_state = value

    # ----- whole sequences ---------------------------------------------------------------------------------

    def _embed(self, ids: Tensor) -> Tensor:
        """The tokens' embeddings (..., d), times ``embed_scale`` (Huginn's sqrt(d))."""
        x = self.embed_tokens(ids).to(self.compute_dtype)  # a tied bfloat16 head's rows widened (precision.py)
        return x if self.config.embed_scale == 1.0 else x * self.config.embed_scale

    def _inject(self, state: Tensor, e: Tensor, linear: Callable[[nn.Linear, Tensor], Tensor]) -> Tensor:
        """A loop's input with injection, ``adapter([state, e])`` (..., d), the adapter applied by ``linear`` (the
        path's own: a plain call, ``rows_linear`` or ``tile_linear``), plus its bias (``adapter_bias``)."""
        h = linear(self.adapter, torch.cat([state, e], dim=-1))
        return h if self.adapter_bias is None else h + self.adapter_bias

    def _first_state(self, e: Tensor, positions: Tensor) -> Tensor:
        """The state before the first loop for the prelude's outputs ``e`` (..., T, d) at ``positions`` (T,): zero,
        or ``initial_state``'s draws (the same for every sequence of a batch)."""
        if self.initial_state is None:
            return torch.zeros_like(e)
        return self.initial_state.draw(positions, e).expand_as(e)

    def _exit_inputs(self, input_ids: Tensor, run: TrainRun = FULL_RUN) -> list[Tensor]:
        """Each loop's exit input M x (B, T, d): the coda's output (the core's without one), before the loop's
        exit adapter and the final norm. ``run`` (training only) changes which loops run and keep gradients and
        what is recomputed in the backward pass; then only the last loop's exit when it asks (``TrainRun``)."""
        c, T = self.config, input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device)
        cos, sin = rotary(positions, c.head_dim, c.rope_theta, c.rope_layout)
        blocks = _checkpointed if run.checkpoint == "block" else _plain
        e = self._embed(input_ids)  # (B, T, d)
        for block in self.prelude:
            e = blocks(block, e, cos, sin)
        state = self._first_state(e, positions) if self.adapter is not None else e
        loops = run.loops or self.n_loops
        free = loops - min(run.backprop or loops, loops)  # the first loops run without gradients (Huginn's)
        exits = []
        for i in range(loops):
            wanted = not run.last_only or i == loops - 1
            with torch.no_grad() if i < free else nullcontext():
                if run.checkpoint == "loop" and i >= free:
                    h, y = checkpoint(self._loop, state, e, cos, sin, wanted, _plain, use_reentrant=False)
                else:
                    h, y = self._loop(state, e, cos, sin, wanted, blocks)
            if y is not None:
                exits.append(y)
            state = self.norm(h) if c.loop_norm else h
        return exits

    def _loop(
        self, state: Tensor, e: Tensor, cos: Tensor, sin: Tensor, exit: bool, blocks: Callable[..., Tensor]
    ) -> tuple[Tensor, Tensor | None]:
        """One loop over whole sequences: (the core's output h, the loop's exit input y or None without ``exit``),
        each block applied by ``blocks`` (a plain call, or recomputed in the backward pass)."""
        h = self._inject(state, e, _call) if self.adapter is not None else state  # (B, T, d)
        for block in self.core:
            h = blocks(block, h, cos, sin)
        if not exit:
            return h, None
        y = tile_rms_norm(self.norm, h) if self.config.coda_norm else h
        for block in self.coda:
            y = blocks(block, y, cos, sin)
        return h, y

    def _exit_states(self, input_ids: Tensor, run: TrainRun = FULL_RUN) -> list[Tensor]:
        """Each loop's exit state M x (B, T, d), the LM head's input (after the loop's exit adapter, if any; a
        ``run`` of the last loop's exit alone adapts none: the last loop never has one)."""
        adapters = self.exit_adapters if not run.last_only else None
        adapt = adapters.adapt if adapters is not None else lambda y, i: y
        return [self.norm(adapt(y, i)) for i, y in enumerate(self._exit_inputs(input_ids, run))]

    def exit_lambdas(self, input_ids: Tensor) -> Tensor:
        """Each loop's exit-gate probability lambda (B, T, M) for token ids (B, T): sigmoid(exit_gate(norm(y))), y
        the loop's exit input, so the gate reads the state the head reads (Ouro's ``early_exit_gate``); the
        probability of exiting at loop i is lambda_i * prod_{j<i} (1 - lambda_j), the last loop taking the rest."""
        if self.exit_gate is None:
            raise ValueError("this LoopedLM has no exit gate (LMConfig.exit_gate)")
        gates = [self.exit_gate(self.norm(y)) for y in self._exit_inputs(input_ids)]  # M x (B, T, 1)
        return torch.sigmoid(torch.cat(gates, dim=-1))

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        weights: Tensor | None = None,
        return_logits: bool = False,
        run: TrainRun = FULL_RUN,
    ) -> LoopOutput:
        """Teacher-forced forward of token ids (B, T) through all M loops, causal (right padding is harmless).

        ``labels`` (B, T; -100 = ignore) are the tokens that follow each
        position (``next_token_labels``); with them, returns each loop's mean
        token cross-entropy L_i and ``L_w = sum_i w_i L_i`` with ``weights``
        (M,) (default: the paper's linear scheme). ``run`` (training only): the loops run, those with
        gradients, activation checkpointing and Ouro's gate objective (``TrainRun``); with a run of the last
        loop's exit alone the losses are that loop's (shape (1,)).
        """
        states = self._exit_states(input_ids, run)
        if run.gate_entropy is None or labels is None:
            return loop_output((self.lm_head(state) for state in states), labels, weights, return_logits)
        return self._gate_output(states, labels, run.gate_entropy, return_logits)

    def _gate_output(self, states: list[Tensor], labels: Tensor, entropy: float, return_logits: bool) -> LoopOutput:
        """Each loop's mean loss and Ouro's gate objective (``speed.losses.gate_objective``) over the target tokens,
        the gate reading each loop's exit state as ``exit_lambdas`` does."""
        if self.exit_gate is None:
            raise ValueError("the gate objective needs a LoopedLM with an exit gate (LMConfig.exit_gate)")
        keep = labels.reshape(-1) != -100  # (B*T,)
        logits = [self.lm_head(state) for state in states]  # M x (B, T, V)
        targets = labels.reshape(-1)[keep]  # (n,)
        losses = [F.cross_entropy(lg.flatten(0, 1)[keep].float(), targets, reduction="none") for lg in logits]
        token_losses = torch.stack(losses, dim=-1)  # (n, M)
        gates = torch.cat([self.exit_gate(state).flatten(0, 1)[keep] for state in states], dim=-1)  # (n, M)
        loss = gate_objective(token_losses, gates, entropy)
        return LoopOutput(token_losses.mean(0), loss, logits if return_logits else None)

    # ----- cached decoding ---------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where the weights live; the decode path creates every tensor here."""
        return self.lm_head.weight.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the activations, the KV cache and the logits: the norms' (float32 with bf16 weights, whose
        linear weights alone are bfloat16: ``speed.models.precision``)."""
        return self.norm.weight.dtype

    def cache(self, n_slots: int, max_len: int, side: bool = True, blocks: int | None = None) -> LMCache:
        """An empty cache for ``n_slots`` sequences of up to ``max_len`` positions (prompt included) each; with
        the runner-up branches' side entries if ``side`` (else none: a sequence decoded without branches); a pool
        of ``blocks`` blocks of ``ATTN_CHUNK`` positions (None: every slot at ``max_len``; see ``KVCache``)."""
        c, dtype = self.config, self.compute_dtype

        def kv(n_loops: int, n_layers: int, n_side: int) -> KVCache | None:
            if n_layers == 0:
                return None
            shape = (n_loops, n_layers, n_slots, c.n_kv_heads, max_len, c.head_dim)
            return KVCache(*shape, dtype, self.device, n_side, blocks)

        return LMCache(*(kv(*part) for part in self._cache_parts(side)))

    def cache_bytes(self, n_slots: int, max_len: int, side: bool = True, blocks: int | None = None) -> tuple[int, int]:
        """Bytes ``cache`` of these arguments allocates: (its pools', its side entries'), without allocating."""
        c, dtype = self.config, self.compute_dtype
        parts = [
            kv_bytes(n_loops, n_layers, n_slots, c.n_kv_heads, max_len, c.head_dim, dtype, n_side, blocks)
            for n_loops, n_layers, n_side in self._cache_parts(side)
            if n_layers
        ]
        return sum(kv for kv, _ in parts), sum(s for _, s in parts)

    def _cache_parts(self, side: bool) -> list[tuple[int, int, int]]:
        """(loops, layers, side entries per slot) of ``LMCache.loops`` and ``LMCache.prelude`` (0 layers: none)."""
        s = self.sharing
        n_side = s.n_loops**2 if side else 0  # the looped layers' side entries, in the prelude too
        return [(s.n_loops, s.n_unique + s.coda, n_side), (1, s.prelude, n_side)]

    def prefill(self, cache: LMCache, slot: int, input_ids: Tensor) -> Tensor:
        """``prefill_batch`` of one prompt (T,) into ``slot``: each loop's logits (M, V) at its last position."""
        return self.prefill_batch(cache, [slot], [input_ids])[0]

    def prefill_batch(self, cache: LMCache, slots: Sequence[int], prompts: Sequence[Tensor]) -> list[Tensor]:
        """``prefill_gated``'s logits alone."""
        return self.prefill_gated(cache, slots, prompts, gates=False)[0]

    @torch.no_grad()
    def prefill_gated(
        self, cache: LMCache, slots: Sequence[int], prompts: Sequence[Tensor], gates: bool = True
    ) -> tuple[list[Tensor], list[Tensor] | None]:
        """Run prompts (each (T_b,)) through every loop into their empty slots, together: their keys/values at
        positions 0..T_b-1 of every virtual layer; returns each prompt's loops' logits (M, V) at its last
        position (its first new token's), and with ``gates`` their loops' exit-gate lambdas (M,) there too (else
        None; the model must have a gate).

        The prompts' tokens are the rows of one pass: every matmul runs on tiles of ``PREFILL_ROWS`` rows of
        them on the row-invariant kernels (``speed.engine.kernels.rows_linear``), attention runs on each prompt
        alone, and the exits' head on tiles of its last rows, so what a prompt leaves in the cache and its
        logits do not depend on the prompts prefilled with it, nor on their order.
        """
        if len(slots) != len(prompts) or not prompts:
            raise ValueError(f"prefill_batch needs one slot per prompt, got {len(slots)} slots, {len(prompts)} prompts")
        if any(p.numel() == 0 for p in prompts):
            raise ValueError("prefill needs at least one prompt token")
        c, N = self.config, self.sharing.n_unique
        ids = torch.cat([p.reshape(-1) for p in prompts]).to(self.device)  # (R,)
        lengths = [p.numel() for p in prompts]
        starts = np.cumsum([0, *lengths[:-1]]).tolist()
        segments = list(zip(starts, lengths))
        positions = torch.cat([torch.arange(T, device=self.device) for T in lengths])
        cos, sin = rotary(positions, c.head_dim, c.rope_theta, c.rope_layout)  # 2 x (R, D)

        def stores(part: str, loop: int, layer: int) -> list[Store]:
            kv = getattr(cache, part)
            return [lambda k, v, s=slot: kv.write_span(layer, loop, s, 0, k[0], v[0]) for slot in slots]

        e = self._embed(ids)  # (R, d)
        for p, block in enumerate(self.prelude):
            e = block.prefill(e, cos, sin, segments, stores("prelude", 0, p))
        state = self._first_state(e, positions) if self.adapter is not None else e
        last = torch.tensor([s + T - 1 for s, T in segments], device=self.device)
        logits, lambdas = [], []
        for i in range(self.n_loops):
            h = self._inject(state, e, rows_linear) if self.adapter is not None else state  # (R, d)
            for j, block in enumerate(self.core):
                h = block.prefill(h, cos, sin, segments, stores("loops", i, j))
            y = tile_rms_norm(self.norm, h) if c.coda_norm else h
            for k, block in enumerate(self.coda):
                y = block.prefill(y, cos, sin, segments, stores("loops", i, N + k))
            y = y.index_select(0, last)  # (B, d)
            if gates:
                lambdas.append(self._gate(rows_norm(self.norm, y), rows_linear))  # (B,)
            if self.exit_adapters is not None:
                y = self.exit_adapters.adapt_rows(y, [i] * len(prompts))
            logits.append(rows_linear(self.lm_head, rows_norm(self.norm, y), TILE_ROWS))  # (B, V)
            state = rows_norm(self.norm, h) if c.loop_norm else h
        return list(torch.stack(logits, dim=1)), (list(torch.stack(lambdas, dim=1)) if gates else None)  # B x (M, V)

    def _gate(self, state: Tensor, linear: Callable[[nn.Linear, Tensor], Tensor]) -> Tensor:
        """Each row's exit-gate lambda (R,) from its normed exit state (R, d): sigmoid(exit_gate(state)), the gate
        applied by ``linear`` (a row kernel, which takes bias-free layers: its bias is added after)."""
        if self.exit_gate is None:
            raise ValueError("this LoopedLM has no exit gate (LMConfig.exit_gate)")
        return torch.sigmoid(linear(BiasFree(self.exit_gate.weight), state)[:, 0] + self.exit_gate.bias)

    def stepper(self) -> LMStepper:
        """The engine's view of this model (``speed.engine.Stepper``)."""
        return LMStepper(self)

    def pack_for_decoding(self) -> int:
        """Pack the weights that decode on the native kernel for it (``speed.engine.kernels.pack_linears``: 4-8
        rows a pass at about one row's cost); returns how many. The cached decoding and the prefill run on the
        packed layers; ``forward`` and training do not (``unpack_linears`` restores the layers)."""
        return pack_linears(self)

    def embed(self, tokens: Sequence[int] | Tensor) -> Tensor:
        """Each token's carry into its first loop (R, W): its embedding, after a zero state with injection (the
        step draws ``initial_state``'s at the token's position: embed knows no position)."""
        x = self._embed(torch.as_tensor(tokens, dtype=torch.long, device=self.device))  # (R, d)
        return torch.cat([torch.zeros_like(x), x], dim=-1) if self.adapter is not None else x

    def step(
        self,
        cache: LMCache,
        rows: Rows,
        hidden: Tensor,
        with_logits: bool = True,
        logit_rows: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """One group pass of the loop over R rows, each at its own loop and position (the model's call in a
        pipeline step of ``speed.engine``).

        ``hidden`` (R, W) is each row's carry into this loop: ``embed``'s at
        loop 0, else what the previous ``step`` returned for it. Without
        injection the carry is the loop's input; with it, [state, e]. A row at
        loop 0 first runs the prelude (e = prelude(embedding)); every row then
        runs the core and its exit (the coda, the final norm and, if asked,
        the LM head) for the rows ``logit_rows`` names (ascending; None: all).
        Returns the carries into the next loop (R, W) and those rows' exit
        logits (K, V). Each row's results are bit-identical whatever
        other rows share the pass (tiles of ``TILE_ROWS`` rows on the
        row-invariant kernels of ``speed.engine.kernels``; the exits in tiles
        of their own, ``speed.models.exits.exit_logits``).
        """
        carry, y = in_tiles(lambda part, c: self._pass_tile(cache, part, c, with_logits), rows, hidden)
        return carry, (self._exit_logits(y, rows, logit_rows) if with_logits else None)

    def step_gated(
        self, cache: LMCache, rows: Rows, hidden: Tensor, logit_rows: Sequence[int] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``step`` with the exit logits (K, V) of the rows ``logit_rows`` names and every row's exit-gate lambda
        (R,) beside them (``exit_lambdas``' in the cached path: sigmoid(exit_gate(norm(y))), row-invariant as the
        logits)."""
        d = self.config.d_model
        carry, both = in_tiles(lambda part, c: self._pass_tile(cache, part, c, True, gates=True), rows, hidden)
        return carry, self._exit_logits(both[:, :d], rows, logit_rows), both[:, d]

    def stage(self, cache: LMCache, rows: Rows) -> StagedPass:
        """The host's part of ``step`` over ``rows`` (R), done before it (``LMStepper.prepare``, before a captured
        CUDA graph's replay): each cache part's bookkeeping and index (``KVCache.stage``; the prelude's with the
        rows past loop 0 as padding rows), and with an ``initial_state`` the draws of the rows at loop 0, each
        into static buffers of this row count. ``step_staged`` then reads those alone."""
        first = rows.loop == 0
        prelude = cache.prelude.stage(rows, first) if self.prelude else None
        draws = None
        if self.adapter is not None and self.initial_state is not None:
            R, d = len(rows), self.config.d_model
            draws = cache.draws.get(R)
            if draws is None:
                draws = cache.draws[R] = torch.zeros(R, d, dtype=self.compute_dtype, device=cache.device)
            host = torch.zeros(R, d, dtype=draws.dtype)
            if first.any():
                host[torch.from_numpy(np.flatnonzero(first))] = self.initial_state.draw(rows.pos[first], host)
            draws.copy_(to_device(host, cache.device))
        return StagedPass(cache.loops.stage(rows), prelude, draws)

    def step_staged(
        self,
        cache: LMCache,
        staged: StagedPass,
        rows: Rows,
        hidden: Tensor,
        with_logits: bool = True,
        logit_rows: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``step`` over the rows ``stage`` staged, reading only device tensors (the staged buffers, ``hidden``
        and the weights), never ``rows``' host arrays nor anything back from the device: the pass a CUDA graph
        captures. On the Triton kernels, all rows at once; the same bits as ``step``'s.

        The prelude runs on every row (those past loop 0 as padding rows, their results dropped by a select on
        the device) and the exit adapters on every exit (unadapted rows keep their inputs' bits), so that no
        host decision depends on the rows."""
        c, d = self.config, self.config.d_model
        cos, sin = rotary(staged.loops.pos, c.head_dim, c.rope_theta, c.rope_layout)  # 2 x (R, D)
        x = hidden[:, -d:]
        first = (staged.loops.loop == 0)[:, None]  # (R, 1) on the device
        if self.prelude:
            e, view = x, StagedView(cache.prelude, staged.prelude)
            for p, block in enumerate(self.prelude):
                e = block.decode(e, cos, sin, rows, view, p)
            x = torch.where(first, e, x)
        h = x
        if self.adapter is not None:
            state = hidden[:, :d]
            if staged.draws is not None:
                state = torch.where(first, staged.draws, state)
            h = self._inject(state, x, tile_linear)
        carry, y = self._loop_tile(StagedView(cache.loops, staged.loops), rows, h, x, cos, sin, with_logits)
        if not with_logits:
            return carry, None
        return carry, exit_logits(y, staged.loops.loop, logit_rows, self.exit_adapters, self.norm, self.lm_head)

    def _exit_logits(self, y: Tensor, rows: Rows, logit_rows: Sequence[int] | None) -> Tensor:
        """The exit logits (K, V) of the picked rows of the coda's outputs ``y`` (R, d) (adapted, normed, the head)."""
        return exit_logits(y, rows.loop, logit_rows, self.exit_adapters, self.norm, self.lm_head)

    def _pass_tile(
        self, cache: LMCache, rows: Rows, carry: Tensor, with_exits: bool, gates: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """The group pass (``step``) for one tile of n <= ``TILE_ROWS`` rows, ``carry`` (n, W): the carries into
        the next loop and, ``with_exits``, the exits' inputs (the coda's outputs, (n, d)); with ``gates`` each
        row's gate lambda as one more column of them (n, d + 1), so that ``in_tiles`` joins both."""
        c, d = self.config, self.config.d_model
        _, _, pos_t = rows.tensors(carry.device)
        cos, sin = rotary(pos_t, c.head_dim, c.rope_theta, c.rope_layout)  # 2 x (n, D)
        x = carry[:, -d:]  # (n, d): the embedding at loop 0; then e with injection, else the loop's input
        first = np.flatnonzero(rows.loop == 0)
        if self.prelude and len(first):
            at = torch.as_tensor(first, device=carry.device)
            e, part = x.index_select(0, at), rows.take(first)  # the rows at loop 0
            for p, block in enumerate(self.prelude):
                e = block.decode(e, cos[at], sin[at], part, cache.prelude, p)
            x = x.index_copy(0, at, e)
        if self.adapter is not None:
            state = carry[:, :d]  # (n, d)
            if self.initial_state is not None and len(first):  # the rows at loop 0: their positions' draws
                at = torch.as_tensor(first, device=carry.device)
                state = state.index_copy(0, at, self.initial_state.draw(rows.pos[first], state))
            h = self._inject(state, x, tile_linear)  # (n, d)
        else:
            h = x
        return self._loop_tile(cache.loops, rows, h, x, cos, sin, with_exits, gates)

    def _loop_tile(
        self,
        loops: KVCache | StagedView,
        rows: Rows,
        h: Tensor,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        with_exits: bool,
        gates: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """The rest of ``_pass_tile`` from the loop's input h (n, d) on (``x``: the carry's e with injection): the
        core and the coda writing and reading ``loops``, the exits' inputs, the carries."""
        c, N = self.config, self.sharing.n_unique
        for j, block in enumerate(self.core):
            h = block.decode(h, cos, sin, rows, loops, j)
        y = tile_rms_norm(self.norm, h) if c.coda_norm else h
        for k, block in enumerate(self.coda):
            y = block.decode(y, cos, sin, rows, loops, N + k)
        exits = None
        if with_exits:  # the exit adapters (speed.models.exits) change the exits' inputs only, never the carry
            lam = self._gate(rows_norm(self.norm, y), tile_linear)[:, None] if gates else None  # (n, 1)
            exits = y if lam is None else torch.cat([y, lam.to(y.dtype)], dim=-1)
        state = tile_rms_norm(self.norm, h) if c.loop_norm else h  # (n, d)
        return (torch.cat([state, x], dim=-1) if self.adapter is not None else state), exits


@dataclass(frozen=True)
class StagedPass:
    """A group pass staged on the host (``LoopedLM.stage``): what ``LoopedLM.step_staged`` reads, all on the
    device in static buffers of its row count."""

    loops: StagedIndex  # the looped layers' cache index (positions and loops of the rows among it)
    prelude: StagedIndex | None  # the prelude's (rows past loop 0 as padding rows); None without a prelude
    draws: Tensor | None  # (R, d) the rows at loop 0's initial states (zero elsewhere); None without them


class PromptCache:
    """An ``LMCache`` seen in output positions: output position p of a slot is its cache position
    ``offset[slot] + p``, after the slot's prompt (``offset``: the prompt's length minus 1)."""

    def __init__(self, inner: LMCache) -> None:
        self.inner = inner
        self.offset = np.zeros(inner.loops.n_slots, dtype=np.int64)  # (C,)

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def n_blocks(self) -> int:
        """Blocks in the pool (``LMCache.n_blocks``)."""
        return self.inner.n_blocks

    @property
    def blocks_used(self) -> int:
        """Blocks taken now (``LMCache.blocks_used``)."""
        return self.inner.blocks_used

    def blocks_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Blocks a request reserves: one per chunk of its cache positions, its prompt's but the last (that one
        is output position 0's row) and its ``max_new_tokens`` output positions."""
        return chunk_span(prompt_len - 1 + max_new_tokens) // ATTN_CHUNK

    def reset(self, slot: int) -> None:
        self.inner.reset(slot)
        self.offset[slot] = 0

    def invalidate(self, slot: int, from_pos: int) -> None:
        self.inner.invalidate(slot, int(self.offset[slot]) + from_pos)

    def promote(self, slot: int, side: int, pos: int, loops_done: int) -> None:
        self.inner.promote(slot, side, int(self.offset[slot]) + pos, loops_done)

    def rows(self, rows: Rows) -> Rows:
        """``rows`` at their cache positions."""
        offset = self.offset[rows.slot]
        if rows.side is None:
            return Rows(rows.slot, rows.loop, rows.pos + offset)
        up = tuple(tuple((p + int(o), b) for p, b in lane) for lane, o in zip(rows.up, offset))
        return Rows(rows.slot, rows.loop, rows.pos + offset, rows.side, up)


class LMStepper(ModelStepper):
    """The engine's view of a ``LoopedLM``: the prompt prefilled into the cache at admission, no memory."""

    model: LoopedLM
    _staged: tuple[Rows, StagedPass] | None = None  # the rows ``prepare`` staged last, and what it staged

    @property
    def gated(self) -> bool:
        """Whether the model has an exit gate (``step_gated``; ``exit_gate`` requests need one)."""
        return self.model.exit_gate is not None

    def cache(
        self, n_slots: int, max_prompt_len: int, max_len: int, side: bool = True, blocks: int | None = None
    ) -> PromptCache:
        """An empty cache for ``n_slots`` requests of a prompt of up to ``max_prompt_len`` tokens and
        ``max_len`` output positions each (output position 0's row is the prompt's last); with the runner-up
        branches' side entries if ``side``; a pool of ``blocks`` blocks (None: every slot at its longest)."""
        return PromptCache(self.model.cache(n_slots, max_prompt_len + max_len - 1, side, blocks))

    def memory_need(
        self, n_slots: int, max_prompt_len: int, max_len: int, side: bool = True, blocks: int | None = None
    ) -> MemoryNeed:
        """What ``cache`` of this capacity allocates (the prompt's positions included), and the weights."""
        positions = max_prompt_len + max_len - 1
        cache, side_bytes = self.model.cache_bytes(n_slots, positions, side, blocks)
        return MemoryNeed(self.weights_bytes(), cache, side_bytes, 0, pool_blocks(n_slots, positions, blocks))

    def memory(self, capacity: int, max_prompt_len: int, max_len: int) -> None:
        """None: everything a request keeps is in the cache."""
        return None

    def admit(
        self, memory: None, cache: PromptCache, slots: Sequence[int], prompts: Sequence[Tensor]
    ) -> list[Admitted]:
        """Prefill the requests' prompts (each (P,)) together into their empty slots (``LoopedLM.prefill_batch``:
        row-invariant, so each prompt's result is its own alone); each last position's exits (M, V) are its
        output position 0's."""
        exits, gates = self.model.prefill_gated(cache.inner, slots, prompts, gates=self.gated)
        for slot, prompt in zip(slots, prompts):
            cache.offset[slot] = prompt.shape[0] - 1
        gates = [None] * len(prompts) if gates is None else gates
        return [Admitted(int(prompt[-1]), x, g) for prompt, x, g in zip(prompts, exits, gates)]

    def embed(self, tokens: Sequence[int] | Tensor) -> Tensor:
        """Each token's carry into its first loop (R, W) (``LoopedLM.embed``)."""
        return self.model.embed(tokens)

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph can replay this stepper's pass (``speed.engine.graphs``): on the Triton kernels,
        whose pass ``prepare`` stages."""
        return attention_triton(self.device)

    def prepare(self, memory: None, cache: PromptCache, rows: Rows) -> None:
        """The host's part of the next ``step`` over ``rows`` (a bucket's rows, ``speed.engine.graphs``), done
        before it: ``LoopedLM.stage`` at their cache positions, where the cache attends on the Triton kernel
        (elsewhere ``step`` does its bookkeeping as it goes). ``step`` over these very rows then runs
        ``LoopedLM.step_staged``, as often as it is called (a graph's warm-up and capture run it twice)."""
        if cache.inner.loops.triton_attention:
            self._staged = (rows, self.model.stage(cache.inner, cache.rows(rows)))

    def step(
        self,
        memory: None,
        cache: PromptCache,
        rows: Rows,
        hidden: Tensor,
        with_logits: bool = True,
        logit_rows: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """One group pass over R rows at their output positions (``LoopedLM.step`` at cache positions), exit
        logits for the rows ``logit_rows`` names; over the rows ``prepare`` staged, ``LoopedLM.step_staged``."""
        staged = self._staged
        if staged is not None and staged[0] is rows:
            return self.model.step_staged(cache.inner, staged[1], rows, hidden, with_logits, logit_rows)
        return self.model.step(cache.inner, cache.rows(rows), hidden, with_logits, logit_rows)

    def step_gated(
        self, memory: None, cache: PromptCache, rows: Rows, hidden: Tensor, logit_rows: Sequence[int] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``step`` with each row's exit-gate lambda (R,) beside the picked rows' logits (``LoopedLM.step_gated``)."""
        return self.model.step_gated(cache.inner, cache.rows(rows), hidden, logit_rows)


def next_token_labels(input_ids: Tensor) -> Tensor:
    """Labels (B, T) for teacher forcing: the token after each position, -100 (ignored) after the last."""
    labels = input_ids.new_full(input_ids.shape, -100)
    labels[:, :-1] = input_ids[:, 1:]
    return labels
