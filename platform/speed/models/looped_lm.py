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
whole (B, T) sequences (training, teacher forcing, the reference; here, with
``TrainRun``, how a training forward runs the loops), and the cached
incremental path, ``prefill`` of a prompt plus ``step``, one group pass of the
loop over rows each at its own loop and position (the model's call in one of
the engine's pipeline steps), on the batch-invariant kernels of
``speed.engine.kernels`` as T5's (``speed.models.t5.SpeedT5.step``) is: the
methods ``LoopedLM`` inherits from ``speed.models.lm_decode.LMDecoding``. The
blocks, with each path's way through them, are ``speed.models.lm_blocks``'s;
the engine's view of the model, ``speed.models.lm_stepper.LMStepper``.

Shapes: B batch, T length, R decode rows (n in one tile), d d_model, W the
carry's width (d, or 2d with injection), H query heads, K key/value heads
(H a multiple of K), D head_dim, L key positions, V vocabulary, M loops, N
core, P prelude and C coda layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from speed.config import LMConfig
from speed.engine.kernels import tile_rms_norm
from speed.engine.sampling import truncated_normals
from speed.losses import LoopOutput, gate_objective, loop_output
from speed.models.exits import ExitAdapters
from speed.models.lm_blocks import Block, rotary
from speed.models.lm_decode import LMDecoding
from speed.models.lm_stepper import LMStepper


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



class LoopedLM(LMDecoding, nn.Module):
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

    # ----- what both paths read; the cached path itself is ``LMDecoding``'s (speed.models.lm_decode) ------------

    @property
    def device(self) -> torch.device:
        """Where the weights live; the decode path creates every tensor here."""
        return self.lm_head.weight.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the activations, the KV cache and the logits: the norms' (float32 with bf16 weights, whose
        linear weights alone are bfloat16: ``speed.models.precision``)."""
        return self.norm.weight.dtype

    def stepper(self) -> LMStepper:
        """The engine's view of this model (``speed.engine.Stepper``)."""
        return LMStepper(self)


def next_token_labels(input_ids: Tensor) -> Tensor:
    """Labels (B, T) for teacher forcing: the token after each position, -100 (ignored) after the last."""
    labels = input_ids.new_full(input_ids.shape, -100)
    labels[:, :-1] = input_ids[:, 1:]
    return labels
