"""The Llama blocks of ``speed.models.looped_lm.LoopedLM``, each in the model's three paths: ``forward`` over
whole (B, T) sequences, ``prefill`` over a prefill's rows (R, d) on the row-invariant kernels, each prompt's
attention alone, and ``decode`` over one tile of decode rows (n, d) at their own loops and positions, writing and
reading the engine's ``KVCache``; and the rotary positions they share (``rotary``, ``rotate``, ``rotate_pairs``).

Shapes: B batch, T length, R prefill rows, n decode rows of a tile, d d_model, H query heads, K key/value heads
(H a multiple of K), D head_dim, F d_ff.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speed.config import LMConfig, RopeLayout
from speed.engine import native
from speed.engine.cache import KVCache, Rows, StagedView
from speed.engine.kernels import (
    fused_block_on,
    rows_norm,
    tile_residual,
    tile_rms_norm,
    tile_rope,
    tile_rope_qkv,
)
from speed.engine.matmuls import rows_linear, tile_gated, tile_linear

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
