"""A T5 v1.1 encoder-decoder whose decoder loops N shared layers M times.

After each of the M loops the shared classifier (final RMS norm + LM head)
predicts the next token: the early exits that SPEED speculates from and that
the shared loss ``L_w = sum_i w_i L_i`` trains. Here the model and its group
pass over decode rows (``SpeedT5.step``); the engine's view of it, with the
decoding memory the pass reads, is ``speed.models.t5_stepper.T5Stepper``.

Shapes: B batch, S encoder length, T decoder length, R decode rows, d d_model,
H heads, D d_kv, V vocabulary, M loops, N unique decoder layers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speed.config import ModelConfig
from speed.engine.cache import KVCache, Rows, StagedView
from speed.engine.cache_index import StagedIndex
from speed.engine.kernels import attend, chunk_span, in_tiles, rows_norm
from speed.engine.matmuls import tile_gated, tile_linear
from speed.losses import LoopOutput, loop_output
from speed.models.exits import ExitAdapters, exit_logits
from speed.models.t5_stepper import Memory, T5Stepper, mask_value


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

    def decode(self, x: Tensor, rows: Rows, cache: KVCache | StagedView, layer: int, bias: Tensor) -> Tensor:
        """One new token per row of a tile (n, d), the token of each of ``rows``.

        Writes the rows' keys/values at their virtual layers, then attends over
        each row's positions at its virtual layer. On the Triton attention
        (``cache.triton_attention``; a staged pass's ``StagedView`` too) in place through the block table,
        ``bias`` (n, H, L) each row's position bias over all L = ``n_positions`` of the cache; else over the first
        L key positions gathered (``KVCache.read``), L whole attention chunks, ``bias`` (n, H, 1, L) adding position
        bias and masking the positions past each row's own.
        """
        n = x.shape[0]
        q, k, v = tile_linear(self.qkv, x).view(n, 3, self.n_heads, self.d_kv).unbind(1)  # 3 x (n, H, D)
        cache.write(layer, rows, k, v)
        if cache.triton_attention:
            return tile_linear(self.o, cache.attend(layer, rows, q, bias).reshape(n, -1))
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

    def decode(self, x: Tensor, keys: Tensor, values: Tensor, bias: Tensor, source: Tensor | None = None) -> Tensor:
        """One query per row of a tile (n, d) against its own request's keys/values (n, H, S, D), bias (n, 1, 1, S);
        with ``source`` (n,) on the device, against row r's ``source[r]`` of keys/values (C, H, S, D) and bias
        (C, 1, 1, S) (each row's slot of the encoder memory, picked by the attention: ``kernels.attend``).

        Always one query per row, even when rows share a request: attending R
        queries of one request at once would change the kernel with R.
        """
        n = x.shape[0]
        q = tile_linear(self.q, x).view(n, self.n_heads, self.d_kv)  # (n, H, D)
        return tile_linear(self.o, attend(q, keys, values, bias, source=source).reshape(n, -1))


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
        return tile_linear(self.wo, tile_gated(self.wi, x, "gelu"))  # (n, d_ff) -> (n, d)


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
        cache: KVCache | StagedView,
        layer: int,
        self_bias: Tensor,
        keys: Tensor,
        values: Tensor,
        cross_bias: Tensor,
        source: Tensor | None = None,
    ) -> Tensor:
        """One tile of decode rows (n, d) through this layer (``SelfAttention.decode``, ``CrossAttention.decode``)."""
        x = x + self.self_attn.decode(rows_norm(self.self_norm, x), rows, cache, layer, self_bias)
        x = x + self.cross_attn.decode(rows_norm(self.cross_norm, x), keys, values, cross_bias, source)
        return x + self.ffn.decode(rows_norm(self.ffn_norm, x))


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
        self.exit_adapters: ExitAdapters | None = None  # early-exit adapters (speed.models.exits), never in model.pt

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
        return ((1.0 - attention_mask[:, None, None, :].to(dtype)) * mask_value(dtype)).to(dtype)

    # ----- training forward ------------------------------------------------------------

    def exit_logits(self, hidden: Tensor, loop: int | None = None) -> Tensor:
        """The shared classifier: final norm + LM head, (..., d) -> (..., V); with ``loop`` (0-based), that
        loop's exit adapter first, when the model has one for it (``speed.models.exits``; never the last loop)."""
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
        causal = torch.full((T, T), mask_value(encoded.dtype), device=encoded.device).triu(1)
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

    # ----- decoding: the group pass over rows, on the layers' ``decode`` kernels ------------------------------

    def stepper(self) -> T5Stepper:
        """The engine's view of this model (``speed.engine.Stepper``)."""
        return T5Stepper(self)

    def pack_for_decoding(self) -> int:
        """Packs nothing (returns 0): T5's encoder, and its decoder's cross-attention keys, run their layers'
        ``forward``, which a packed weight cannot (``speed.engine.matmuls.pack_linears``)."""
        return 0

    def step(
        self,
        memory: Memory,
        cache: KVCache,
        rows: Rows,
        hidden: Tensor,
        with_logits: bool = True,
        logit_rows: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """One group pass (the model's call in a pipeline step of ``speed.engine``): the shared N-layer group over
        R rows, each at its own loop, reading the slots' encoder ``memory`` (``T5Stepper.memory``).

        ``hidden`` (R, d) is each row's input to this loop; returns its output
        (R, d) and, if asked, the early-exit logits (K, V) of the rows ``logit_rows`` names (ascending; None:
        all R). Each row's results
        are bit-identical whatever other rows share the pass: the rows run in
        tiles of up to ``TILE_ROWS`` on row-invariant kernels (see ``speed.engine.kernels``), and the exits
        in tiles of their own (``speed.models.exits.exit_logits``).
        """
        out, _ = in_tiles(lambda part, x: self._pass_tile(memory, cache, part, x), rows, hidden)
        if not with_logits:
            return out, None
        # The exit adapters (speed.models.exits) change the early exits' inputs only: out, the carry, stays as it is
        return out, exit_logits(out, rows.loop, logit_rows, self.exit_adapters, self.decoder_norm, self.lm_head)

    def step_staged(
        self,
        memory: Memory,
        cache: KVCache,
        staged: StagedIndex,
        rows: Rows,
        hidden: Tensor,
        with_logits: bool = True,
        logit_rows: Sequence[int] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``step`` over the rows ``KVCache.stage`` staged (``T5Stepper.prepare``), reading only device tensors:
        the staged index, the rows' device tensors (``Rows.tensors``: a bucket's static buffers), ``hidden``,
        the encoder memory and the weights, never ``rows``' host arrays nor anything back from the device: the pass
        a CUDA graph captures. The same kernels on the same values as ``step``'s on the Triton attention, so the
        same bits; the exits' adapters run on every row (``exit_logits`` with device loops)."""
        slot_t, _, _ = rows.tensors(hidden.device)
        out = self._paged_pass(memory, StagedView(cache, staged), rows, hidden, slot_t, staged.pos)
        if not with_logits:
            return out, None
        return out, exit_logits(out, staged.loop, logit_rows, self.exit_adapters, self.decoder_norm, self.lm_head)

    def _paged_pass(
        self, memory: Memory, cache: KVCache | StagedView, rows: Rows, x: Tensor, slot: Tensor, pos: Tensor
    ) -> Tensor:
        """The group pass on the Triton attention over rows at slots ``slot`` and positions ``pos`` (n,) on the
        device, ``x`` (n, d): every shape fixed by the row count and the memory's capacity, no index made on the
        host. Self-attention reads the cache in place with each row's position bias over all the cache's
        positions; cross-attention reads each row's slot of the encoder memory over all its S positions (the
        masked chunks past a row's own add exact zeros: ``speed.engine.triton_kernels``)."""
        self_bias = memory.self_bias.index_select(0, pos)  # (n, H, L)
        for j, layer in enumerate(self.decoder_layers):  # CYCLE order, as ``_pass_tile``
            x = layer.decode(x, rows, cache, j, self_bias, memory.keys[j], memory.values[j], memory.cross_bias, slot)
        return x

    def _pass_tile(self, memory: Memory, cache: KVCache, rows: Rows, x: Tensor) -> tuple[Tensor, None]:
        """The group pass for one tile of n <= ``TILE_ROWS`` rows, ``x`` (n, d) (on the Triton attention, any n:
        ``_paged_pass``)."""
        if cache.triton_attention:
            slot_t, _, pos_t = rows.tensors(x.device)
            return self._paged_pass(memory, cache, rows, x, slot_t, pos_t), None
        m = self
        # Attention runs over the fewest whole chunks that cover the tile's rows: the kernels' results do not
        # depend on how many masked chunks follow (see ``attend``), so the span changes no row's logits.
        n, slot_t, _, pos_t = len(rows), *rows.tensors(x.device)
        L, S = chunk_span(int(rows.pos.max()) + 1), chunk_span(int(memory.prompt_lens[rows.slot].max()))
        self_bias = memory.self_bias[..., :L].index_select(0, pos_t).unsqueeze(2)  # (n, H, 1, L)
        first = int(rows.slot[0])
        one_slot = bool((rows.slot == first).all())  # e.g. one request's pipeline: share its keys, copy none

        def source(t: Tensor) -> Tensor:  # each row's slot of a per-slot tensor (C, ...) -> (n, ...)
            return t.narrow(0, first, 1).expand(n, *t.shape[1:]) if one_slot else t.index_select(0, slot_t)

        cross_bias = source(memory.cross_bias[..., :S])  # (n, 1, 1, S)
        # CYCLE order: loop l's pass runs virtual layers l*N .. l*N+N-1, which are the N unique layers in order
        for j, layer in enumerate(m.decoder_layers):
            keys, values = source(memory.keys[j][:, :, :S]), source(memory.values[j][:, :, :S])  # (n, H, S, D)
            x = layer.decode(x, rows, cache, j, self_bias, keys, values, cross_bias)  # (n, d)
        return x, None

    @property
    def start_id(self) -> int:
        """T5 starts decoding from the pad token."""
        return self.config.pad_id

    @property
    def device(self) -> torch.device:
        """Where the weights live; the decode path creates every tensor here."""
        return self.lm_head.weight.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the activations, the KV cache, the encoder memory and the logits: the norms' (float32 with
        bf16 weights, whose linear weights alone are bfloat16: ``speed.models.precision``)."""
        return self.decoder_norm.weight.dtype



def count_parameters(model: nn.Module) -> int:
    """Number of parameters (shared layers counted once)."""
    return sum(p.numel() for p in model.parameters())
