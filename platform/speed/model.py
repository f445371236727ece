"""A T5 v1.1 encoder-decoder whose decoder loops N shared layers M times.

After each of the M loops the shared classifier (final RMS norm + LM head)
predicts the next token: the early exits that SPEED speculates from and that
the shared loss ``L_w = sum_i w_i L_i`` trains.

Shapes: B batch, S encoder length, T decoder length, R decode rows, d d_model,
H heads, D d_kv, V vocabulary, M loops, N unique decoder layers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speed.cache import KVCache, Rows
from speed.config import ModelConfig
from speed.exits import ExitAdapters
from speed.kernels import attend, tile_linear
from speed.losses import LoopOutput, loop_output


def relative_position_bucket(
    relative_position: Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> Tensor:
    """T5's bucketing of (key - query) offsets: exact for small offsets, logarithmic beyond."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = (
        max_exact
        + (
            torch.log(relative_position.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, relative_position, large)


class RelativeBias(nn.Module):
    """Learned per-head bias over bucketed relative positions (one table per stack)."""

    def __init__(self, config: ModelConfig, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = config.relative_buckets
        self.max_distance = config.relative_max_distance
        self.embedding = nn.Embedding(config.relative_buckets, config.n_heads)

    def forward(self, q_len: int, k_len: int) -> Tensor:
        """(H, q_len, k_len) bias for queries 0..q_len-1 against keys 0..k_len-1."""
        device = self.embedding.weight.device
        rel = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
        buckets = relative_position_bucket(rel, self.bidirectional, self.num_buckets, self.max_distance)
        return self.embedding(buckets).permute(2, 0, 1)


def _mask_value(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


class SelfAttention(nn.Module):
    """Multi-head self-attention with fused QKV; T5 applies no 1/sqrt(D) scaling."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.d_kv = config.n_heads, config.d_kv
        inner = config.n_heads * config.d_kv
        self.qkv = nn.Linear(config.d_model, 3 * inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        self.dropout = config.dropout

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        """Full-sequence attention; ``bias`` (B or 1, H, T, T) holds position bias and masks."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.d_kv).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, scale=1.0)  # (B, H, T, D)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))

    def decode(self, x: Tensor, rows: Rows, cache: KVCache, layer: int, bias: Tensor) -> Tensor:
        """One new token per row of a tile (n, d), the token of each of ``rows``.

        Writes the rows' keys/values at their virtual layers, then attends over
        the first L key positions of each row's virtual layer, L whole attention chunks;
        ``bias`` (n, H, 1, L) adds position bias and masks the positions past
        each row's own.
        """
        n = x.shape[0]
        q, k, v = tile_linear(self.qkv, x).view(n, 3, self.n_heads, self.d_kv).unbind(1)  # 3 x (n, H, D)
        cache.write(layer, rows, k, v)
        keys, values = cache.read(layer, rows, bias.shape[-1])  # (n, H, L, D)
        return tile_linear(self.o, attend(q, keys, values, bias).reshape(n, -1))


class CrossAttention(nn.Module):
    """Decoder-to-encoder attention; keys/values depend only on the encoder output."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.d_kv = config.n_heads, config.d_kv
        inner = config.n_heads * config.d_kv
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.kv = nn.Linear(config.d_model, 2 * inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        self.dropout = config.dropout

    def keys_values(self, encoded: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, H, S, D) of the encoder output (B, S, d): what this layer's queries attend to."""
        B, S, _ = encoded.shape
        k, v = self.kv(encoded).view(B, S, 2, self.n_heads, self.d_kv).permute(2, 0, 3, 1, 4)
        return k, v

    def forward(self, x: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
        """Attend from (B, T, d) to precomputed keys/values; ``bias`` (B, 1, 1, S) masks padding."""
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.d_kv).transpose(1, 2)  # (B, H, T, D)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, dropout_p=p, scale=1.0)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))

    def decode(self, x: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
        """One query per row of a tile (n, d) against its own request's keys/values (n, H, S, D), bias (n, 1, 1, S).

        Always one query per row, even when rows share a request: attending R
        queries of one request at once would change the kernel with R.
        """
        n = x.shape[0]
        q = tile_linear(self.q, x).view(n, self.n_heads, self.d_kv)  # (n, H, D)
        return tile_linear(self.o, attend(q, keys, values, bias).reshape(n, -1))


class GatedFFN(nn.Module):
    """T5 v1.1 gated-GELU feed-forward: wo(gelu(x wi_0) * (x wi_1)), wi_0/wi_1 fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wi = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)  # [wi_0; wi_1]
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        gate, linear = self.wi(x).chunk(2, dim=-1)
        return self.wo(self.dropout(F.gelu(gate, approximate="tanh") * linear))

    def decode(self, x: Tensor) -> Tensor:
        """The same for one tile of decode rows (n, d) (no dropout)."""
        gate, linear = tile_linear(self.wi, x).chunk(2, dim=-1)  # 2 x (n, d_ff)
        return tile_linear(self.wo, F.gelu(gate, approximate="tanh") * linear)


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.layer_norm_eps)
        self.attn = SelfAttention(config)
        self.ffn_norm = nn.RMSNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn = GatedFFN(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), bias))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_norm = nn.RMSNorm(config.d_model, eps=config.layer_norm_eps)
        self.self_attn = SelfAttention(config)
        self.cross_norm = nn.RMSNorm(config.d_model, eps=config.layer_norm_eps)
        self.cross_attn = CrossAttention(config)
        self.ffn_norm = nn.RMSNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn = GatedFFN(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, self_bias: Tensor, keys: Tensor, values: Tensor, cross_bias: Tensor) -> Tensor:
        x = x + self.dropout(self.self_attn(self.self_norm(x), self_bias))
        x = x + self.dropout(self.cross_attn(self.cross_norm(x), keys, values, cross_bias))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))

    def decode(
        self,
        x: Tensor,
        rows: Rows,
        cache: KVCache,
        layer: int,
        self_bias: Tensor,
        keys: Tensor,
        values: Tensor,
        cross_bias: Tensor,
    ) -> Tensor:
        """One tile of decode rows (n, d) through this layer (see ``SelfAttention.decode``)."""
        x = x + self.self_attn.decode(self.self_norm(x), rows, cache, layer, self_bias)
        x = x + self.cross_attn.decode(self.cross_norm(x), keys, values, cross_bias)
        return x + self.ffn.decode(self.ffn_norm(x))


class SpeedT5(nn.Module):
    """T5 v1.1 encoder plus an ``NxM`` parameter-shared decoder with early exits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.sharing = sharing = config.sharing
        self.n_loops = sharing.n_loops
        self.eos_id, self.vocab_size = config.eos_id, config.vocab_size  # what decoding reads
        self.shared = nn.Embedding(config.vocab_size, config.d_model)  # encoder and decoder inputs
        self.encoder_layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_encoder_layers))
        self.encoder_bias = RelativeBias(config, bidirectional=True)
        self.encoder_norm = nn.RMSNorm(config.d_model, eps=config.layer_norm_eps)
        self.decoder_layers = nn.ModuleList(DecoderLayer(config) for _ in range(sharing.n_unique))
        self.decoder_bias = RelativeBias(config, bidirectional=False)
        self.decoder_norm = nn.RMSNorm(config.d_model, eps=config.layer_norm_eps)  # the shared classifier's norm
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.dropout = nn.Dropout(config.dropout)
        self.apply(self._init_weights)
        self.exit_adapters: ExitAdapters | None = None  # the early exits' adapters (speed.exits), never in model.pt

    def _init_weights(self, module: nn.Module) -> None:
        """T5's initialisation (Mesh TensorFlow scales), LM head at d_model**-0.5."""
        c = self.config
        if isinstance(module, SelfAttention):
            inner = c.n_heads * c.d_kv
            nn.init.normal_(module.qkv.weight[:inner], std=(c.d_model * c.d_kv) ** -0.5)
            nn.init.normal_(module.qkv.weight[inner:], std=c.d_model**-0.5)
            nn.init.normal_(module.o.weight, std=inner**-0.5)
        elif isinstance(module, CrossAttention):
            nn.init.normal_(module.q.weight, std=(c.d_model * c.d_kv) ** -0.5)
            nn.init.normal_(module.kv.weight, std=c.d_model**-0.5)
            nn.init.normal_(module.o.weight, std=(c.n_heads * c.d_kv) ** -0.5)
        elif isinstance(module, GatedFFN):
            nn.init.normal_(module.wi.weight, std=c.d_model**-0.5)
            nn.init.normal_(module.wo.weight, std=c.d_ff**-0.5)
        elif isinstance(module, RelativeBias):
            nn.init.normal_(module.embedding.weight, std=c.d_model**-0.5)
        elif module is self:
            nn.init.normal_(self.shared.weight, std=1.0)
            nn.init.normal_(self.lm_head.weight, std=c.d_model**-0.5)

    # ----- encoder -------------------------------------------------------------------

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Encoder output (B, S, d) for token ids (B, S); ``attention_mask`` 1 = real token."""
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        x = self.dropout(self.shared(input_ids))
        bias = self.encoder_bias(S, S).unsqueeze(0) + self._padding_bias(attention_mask, x.dtype)  # (B, H, S, S)
        for layer in self.encoder_layers:
            x = layer(x, bias)
        return self.dropout(self.encoder_norm(x))

    @staticmethod
    def _padding_bias(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
        """(B, 1, 1, S) additive mask: 0 for real tokens, a large negative for padding."""
        return ((1.0 - attention_mask[:, None, None, :].to(dtype)) * _mask_value(dtype)).to(dtype)

    # ----- training forward ------------------------------------------------------------

    def exit_logits(self, hidden: Tensor, loop: int | None = None) -> Tensor:
        """The shared classifier: final norm + LM head, (..., d) -> (..., V); with ``loop`` (0-based), that
        loop's exit adapter first, when the model has one for it (``speed.exits``; never the last loop)."""
        if loop is not None and self.exit_adapters is not None:
            hidden = self.exit_adapters.adapt(hidden, loop)
        return self.lm_head(self.dropout(self.decoder_norm(hidden)))

    def forward(
        self,
        input_ids: Tensor,
        decoder_input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        weights: Tensor | None = None,
        return_logits: bool = False,
    ) -> LoopOutput:
        """Teacher-forced forward through all M loops.

        With ``labels`` (B, T; -100 = ignore) returns each loop's mean token
        cross-entropy L_i and ``L_w = sum_i w_i L_i`` with ``weights`` (M,)
        (default: the paper's linear scheme).
        """
        encoded = self.encode(input_ids, attention_mask)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        B, T = decoder_input_ids.shape
        cross_bias = self._padding_bias(attention_mask, encoded.dtype)
        causal = torch.full((T, T), _mask_value(encoded.dtype), device=encoded.device).triu(1)
        self_bias = (self.decoder_bias(T, T) + causal).unsqueeze(0)  # (1, H, T, T)
        encoder_kv = [layer.cross_attn.keys_values(encoded) for layer in self.decoder_layers]

        sharing = self.sharing

        def loop_exits(x: Tensor) -> Iterator[Tensor]:
            """Each loop's exit logits (B, T, V), in loop order, of decoder inputs ``x`` (B, T, d)."""
            for v in range(sharing.depth):  # virtual layers
                j = sharing.physical_layer(v)
                x = self.decoder_layers[j](x, self_bias, *encoder_kv[j], cross_bias)
                if v + 1 < sharing.depth and sharing.loop_of(v + 1) == sharing.loop_of(v):
                    continue  # the early exit comes after the loop's last layer
                yield self.exit_logits(x, sharing.loop_of(v))

        x = self.dropout(self.shared(decoder_input_ids))
        return loop_output(loop_exits(x), labels, weights, return_logits)

    # ----- what decoding reads (the decode kernels are the layers' ``decode``; see speed.engine.adapters) -----

    @property
    def start_id(self) -> int:
        """T5 starts decoding from the pad token."""
        return self.config.pad_id

    @property
    def device(self) -> torch.device:
        """Where the weights live; the decode path creates every tensor here."""
        return self.lm_head.weight.device


def shift_right(labels: Tensor, start_id: int = 0, pad_id: int = 0) -> Tensor:
    """Decoder inputs for teacher forcing: start token, then labels[:-1] (-100 -> pad)."""
    shifted = labels.new_full(labels.shape, start_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, pad_id)


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (shared layers counted once)."""
    return sum(p.numel() for p in model.parameters())
