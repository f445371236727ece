"""Exit adapters: a small residual adapter per early loop, before the shared classifier.

A looped model's early exits (loop k < M) are what SPEED speculates from:
the closer loop k's prediction is to loop M's, the fewer flushes. An exit
adapter is a lever for that agreement that costs the model nothing: trained
after the model, its backbone frozen (``jobs/train_exits.py``), with KL(loop M
|| loop k), it changes only loop k's exit logits. Loop M's exit is never
adapted, so the output (tokens and last-loop logits) is bit-identical with
and without adapters: lossless by construction (LayerSkip and Kangaroo adapt
their drafts the same way).

One adapter per adapted loop k: ``h + up(relu(down(rms(h))))`` (``rms``
without a gain; ``down`` d -> r, ``up`` r -> d, ``up`` zero-initialised, so a
fresh adapter is the identity; ReLU because it is exact: SiLU's vectorised
exponential rounds a row of a short call differently from the same row among
others, measured, so the drafts would depend on the batch) on the exit's input (T5: the loop's output;
the LM: the coda's), before the shared final norm and LM head. The carry into
the next loop is never adapted: the loops themselves compute what they did.

Not to be confused with ``speed.models.steppers``: those adapt a model *family*
to the engine's ``Stepper`` protocol. Here an adapter belongs to an *exit*.

A model holds its adapters as ``model.exit_adapters`` (None: plain exits;
``attach``); the training forward (``SpeedT5.exit_logits``,
``LoopedLM.forward``), the decode path's group passes and the LM's prefill
apply them. On the decode path the adapter's matmuls run per row on the
row-invariant kernels (``speed.engine.matmuls.tile_linear``), so a row's exit does
not depend on the rows it shares a group pass with: drafts never change the output, but the statistics stay
deterministic. In a checkpoint they are two files beside the model's
(``speed.models.checkpoint``): ``exits.pt`` (the adapters' state dict) and ``exits.json``
(``ExitConfig``: which loops are adapted, the rank; plus the training job's
config), so a checkpoint without them loads as before.

Shapes: R rows, d d_model, r rank, M loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speed.engine.kernels import TILE_ROWS, on_triton, rows_norm, triton_ops
from speed.engine.matmuls import rows_linear, tile_linear
from speed.engine.rows import to_device

EXITS_FILE = "exits.pt"  # the adapters' state dict, beside a checkpoint's model.pt
EXITS_CONFIG_FILE = "exits.json"  # {"exits": ExitConfig's fields, "job": the training job's config, "step": ...}
RMS_EPS = 1e-6


@dataclass(frozen=True)
class ExitConfig:
    """Which exits of a model are adapted, and how wide the adapters are."""

    n_loops: int  # the model's loops (M)
    d_model: int  # the exit's input width
    rank: int = 64  # the adapter's bottleneck (r)
    loops: tuple[int, ...] = field(default=())  # adapted loops, 1-based, each < M; (): every early loop 1..M-1

    def __post_init__(self) -> None:
        if self.n_loops < 1 or self.d_model < 1 or self.rank < 1:
            raise ValueError(f"ExitConfig needs n_loops, d_model and rank >= 1, got {self}")
        loops = tuple(self.loops) or tuple(range(1, self.n_loops))
        if any(type(k) is not int or not 1 <= k < self.n_loops for k in loops) or len(set(loops)) != len(loops):
            raise ValueError(
                f"adapted loops must be distinct integers in 1..{self.n_loops - 1} (loop {self.n_loops}, the "
                f"last, is never adapted), got {list(self.loops)}"
            )
        object.__setattr__(self, "loops", tuple(sorted(loops)))


class ExitAdapter(nn.Module):
    """One loop's residual adapter ``h + up(relu(down(rms(h))))``, the identity when fresh (``up`` is zero)."""

    def __init__(self, d_model: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(d_model, rank, bias=False)
        self.up = nn.Linear(rank, d_model, bias=False)
        nn.init.normal_(self.down.weight, std=d_model**-0.5)
        nn.init.zeros_(self.up.weight)

    def forward(self, h: Tensor) -> Tensor:
        """(..., d) -> (..., d) with plain matmuls (training, whole sequences)."""
        return h + self.up(F.relu(self.down(_rms(h))))


def _rms(h: Tensor) -> Tensor:
    return F.rms_norm(h, (h.shape[-1],), eps=RMS_EPS)


class ExitAdapters(nn.Module):
    """The adapters of a model's early exits, one per adapted loop (``ExitConfig.loops``)."""

    def __init__(self, config: ExitConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleDict({str(k): ExitAdapter(config.d_model, config.rank) for k in config.loops})

    def adapt(self, h: Tensor, loop: int) -> Tensor:
        """Loop ``loop``'s (0-based) exit input ``h`` (..., d), adapted when that loop is (never the last)."""
        head = self.heads[str(loop + 1)] if str(loop + 1) in self.heads else None
        return h if head is None else head(h)

    def adapt_rows(self, h: Tensor, loops: np.ndarray | Sequence[int]) -> Tensor:
        """Decode rows' exit inputs (R, d), row r at loop ``loops[r]`` (0-based), each adapted when its loop is,
        on the row-invariant kernels; rows at unadapted loops (the last loop's among them) are returned as
        they came, bit for bit.

        Every head at once, in two kernel calls whatever the rows' loops: ``down`` of all K heads stacked
        (d -> K r), each row's other heads' r outputs zeroed, then ``up`` stacked (K r -> d), where those
        zeros add exact nothing. A row's result depends on its own loop and values only (``tile_linear`` is
        row-invariant; the rest is elementwise), and a step pays two small matmuls, not two per loop present.
        """
        index = {int(key) - 1: i for i, key in enumerate(self.heads)}  # loop (0-based) -> head
        which = np.asarray([index.get(int(loop), -1) for loop in np.asarray(loops)], dtype=np.int64)  # (R,)
        if not (which >= 0).any():  # decided on the host: no row is adapted
            return h
        return self.adapt_heads(h, to_device(which, h.device))

    def heads_of(self, loops: Tensor) -> Tensor:
        """(R,) each row's head (-1: its loop is not adapted) from its loop (R,), on the device: no host read (a
        captured pass's), the lookup table made once per device."""
        tables = self.__dict__.setdefault("_head_tables", {})  # not a buffer: nothing in the state dict
        table = tables.get(str(loops.device))
        if table is None:
            index = {int(key) - 1: i for i, key in enumerate(self.heads)}
            host = [index.get(loop, -1) for loop in range(self.config.n_loops)]
            table = tables[str(loops.device)] = to_device(host, loops.device)
        return table.index_select(0, loops)

    def adapt_heads(self, h: Tensor, which: Tensor) -> Tensor:
        """``adapt_rows`` of rows whose heads ``which`` (R,) are on the device (-1: none): every row runs through
        the stacked heads whatever its loop, and rows of no head get their inputs back, bit for bit (a select)."""
        down, up = self._stacked()
        r = self.config.rank
        normed = triton_ops().rms_norm(h, None, RMS_EPS) if on_triton(h) else _rms(h)  # per row either way
        z = F.relu(rows_linear(down, normed, TILE_ROWS))  # (R, K r)
        own = torch.arange(z.shape[1], device=h.device)[None, :] // r == which[:, None]  # (R, K r): its head's
        delta = rows_linear(up, z * own, TILE_ROWS)  # (R, d)
        return torch.where((which >= 0)[:, None], h + delta, h)

    def _stacked(self) -> tuple[nn.Linear, nn.Linear]:
        """The heads as two linear layers, ``down`` (K r, d) and ``up`` (d, K r), built from their weights
        again only when one of those changed (so the decode kernels pack them once)."""
        weights = [w for head in self.heads.values() for w in (head.down.weight, head.up.weight)]
        key = tuple((id(w), w.data_ptr(), None if w.is_inference() else w._version) for w in weights)
        if getattr(self, "_stack_key", None) != key:
            down, up = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
            down.weight = nn.Parameter(torch.cat(weights[0::2]).detach(), requires_grad=False)  # (K r, d)
            up.weight = nn.Parameter(torch.cat(weights[1::2], dim=1).detach(), requires_grad=False)  # (d, K r)
            self._stack, self._stack_key = (down, up), key  # a tuple: no submodules, nothing in the state dict
        return self._stack


def exit_logits(
    y: Tensor,
    loops: np.ndarray | Tensor,
    logit_rows: Sequence[int] | None,
    adapters: ExitAdapters | None,
    norm: nn.Module,
    head: nn.Linear,
) -> Tensor:
    """The decode path's exit logits (K, V) of the rows ``logit_rows`` picks (ascending indices; None: all R) of
    the exit inputs ``y`` (R, d), row r at loop ``loops[r]``: each adapted (``adapters``), normed, through ``head``.
    ``loops`` on the host, or on the device (a staged pass's, ``LoopedLM.step_staged``: then nothing is decided
    on the host, and every row runs through the adapters).

    The picked rows run in tiles of ``TILE_ROWS`` on the row-invariant kernels whatever tiles the group pass ran,
    so a row's logits are the same bits whichever other rows are scored, and a step pays the head (and the
    adapters) for the rows that need an exit only: one tile for up to ``TILE_ROWS`` of them.
    """
    if logit_rows is not None and len(logit_rows) < y.shape[0]:
        picked = np.asarray(logit_rows, dtype=np.int64)
        at = to_device(picked, y.device)
        y = y.index_select(0, at)
        loops = loops.index_select(0, at) if isinstance(loops, Tensor) else np.asarray(loops)[picked]
    out, tile = [], max(1, y.shape[0]) if on_triton(y) else TILE_ROWS  # Triton's kernels take any rows at once
    for start in range(0, y.shape[0], tile):
        part, at_loops = y[start : start + tile], loops[start : start + tile]
        if adapters is not None and isinstance(at_loops, Tensor):  # a staged pass's loops: no host decision
            part = adapters.adapt_heads(part, adapters.heads_of(at_loops))
        elif adapters is not None:
            part = adapters.adapt_rows(part, at_loops)
        out.append(tile_linear(head, rows_norm(norm, part)))
    return out[0] if len(out) == 1 else torch.cat(out)


def exits_for(model: nn.Module, rank: int = 64, loops: Sequence[int] = ()) -> ExitAdapters:
    """Fresh (identity) adapters for ``model``'s early exits, on its device and in its compute dtype."""
    weight = model.lm_head.weight
    config = ExitConfig(model.n_loops, weight.shape[1], rank, tuple(loops))
    return ExitAdapters(config).to(device=weight.device, dtype=model.compute_dtype)


def attach(model: nn.Module, adapters: ExitAdapters | None) -> nn.Module:
    """Give ``model`` these exit adapters (None: plain exits again); ``ValueError`` if they do not fit it."""
    if adapters is not None:
        c, width = adapters.config, model.lm_head.weight.shape[1]
        if (c.n_loops, c.d_model) != (model.n_loops, width):
            raise ValueError(
                f"exit adapters for {c.n_loops} loops of width {c.d_model} do not fit a model of "
                f"{model.n_loops} loops of width {width}"
            )
    model.exit_adapters = adapters
    return model


def count_exit_parameters(model: nn.Module) -> int:
    """Parameters of the model's exit adapters (0 without)."""
    adapters = getattr(model, "exit_adapters", None)
    return 0 if adapters is None else sum(p.numel() for p in adapters.parameters())


def exit_kl(loop_logits: Sequence[Tensor], mask: Tensor, loops: Sequence[int]) -> tuple[Tensor, Tensor]:
    """What trains exit adapters, and how well they do: per adapted loop k (1-based), the mean over the positions
    where ``mask`` (B, T) holds of KL(loop M || loop k), and the share of those positions where loop k's argmax
    is loop M's. ``loop_logits``: M x (B, T, V); loop M's is the target (no gradient). Returns two (len(loops),)."""
    target = F.log_softmax(loop_logits[-1].detach().float()[mask], dim=-1)  # (P, V)
    best = target.argmax(-1)  # (P,)
    kls, agree = [], []
    for k in loops:
        logp = F.log_softmax(loop_logits[k - 1].float()[mask], dim=-1)  # (P, V)
        kls.append(F.kl_div(logp, target, log_target=True, reduction="batchmean"))  # sum_v p_M (log p_M - log p_k)
        agree.append((logp.detach().argmax(-1) == best).float().mean())
    return torch.stack(kls), torch.stack(agree)
