"""FSDP2 for both families (``--strategy fsdp``), and its sharded checkpoints.

One ``fully_shard`` unit per block (a looped LM's prelude, core and coda blocks; a T5's encoder and decoder
layers, each decoder layer's cross-attention a unit of its own: its keys and values of the encoder output are
computed before the layer runs, by ``keys_values``, which FSDP is told to treat as a forward) and the root for
the rest (embeddings, head, norms, adapter, gate, relative biases), on a one-dimensional mesh over the
Ray Train workers. Each worker keeps 1/world of every parameter, gradient and optimizer state; a unit's
parameters are gathered for its forward and backward and freed after (a looped core block is gathered once per
loop). On a GPU with ``train.bf16`` the gathered parameters are bfloat16 and gradients are reduced in float32
(``MixedPrecisionPolicy``); on the CPU (gloo) everything stays float32, so that FSDP's losses equal DDP's.

A sharded checkpoint holds ``sharded/``, a ``torch.distributed.checkpoint`` directory with the model's and the
optimizer's state (every worker writes its own shard; ``.metadata`` says where each piece is), in place of
``model.pt`` and ``train_state.pt``'s optimizer. It resumes on any number of workers (the checkpoint reader
reshards), bit for bit on the same number; ``load_sharded_weights`` reads the whole model on one process
(``speed.models.checkpoint.load_model``, so evaluation, serving and ``jobs/export.py`` read it as any other).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from speed.models.checkpoint import SHARDED_DIR
from speed.models.looped_lm import LoopedLM
from speed.models.t5 import CrossAttention, SpeedT5


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one, inner ones first: a looped LM's prelude, core and coda blocks; a T5's
    encoder layers, its decoder layers' cross-attentions, its decoder layers."""
    if isinstance(model, LoopedLM):
        return [*model.prelude, *model.core, *model.coda]
    if isinstance(model, SpeedT5):
        return [*model.encoder_layers, *(layer.cross_attn for layer in model.decoder_layers), *model.decoder_layers]
    raise TypeError(f"no FSDP units for a {type(model).__name__}")


FORWARD_METHODS = {CrossAttention: ("keys_values",)}  # methods a unit runs outside its forward


def precision_policy(device: torch.device, bf16: bool) -> MixedPrecisionPolicy:
    """bfloat16 parameters in compute and float32 gradient reduction on a GPU with ``bf16``; else all float32 (gloo
    on the CPU: the losses then equal DDP's)."""
    if device.type == "cuda" and bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(model: nn.Module, world: int, device: torch.device, bf16: bool) -> nn.Module:
    """``model`` (the same weights on every worker) moved to ``device`` and sharded in place over ``world`` workers:
    one unit per block, then the root."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the mesh and the collectives use the current device
    model.to(device)
    mesh = init_device_mesh(device.type, (world,))
    policy = precision_policy(device, bf16)
    for unit in shard_units(model):
        methods = FORWARD_METHODS.get(type(unit), ())  # read before fully_shard changes the unit's class
        fully_shard(unit, mesh=mesh, mp_policy=policy)
        for method in methods:
            register_fsdp_forward_method(unit, method)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP (its parameters are DTensors)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def local_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes this worker holds of ``tensors`` (a DTensor's local shard alone)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer state's tensors of more than one value (moments, factors; not step counts)."""
    return [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]


def save_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every worker writes its shard of the model's and the optimizer's state into ``directory``/``SHARDED_DIR``
    (a collective: all workers call it)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(Path(directory) / SHARDED_DIR))


def load_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read a sharded checkpoint's model and optimizer state into ``model`` (sharded or not) and ``optimizer``
    (a collective: all workers call it; each reads what its shards need)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(Path(directory) / SHARDED_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def grad_norm_value(norm: torch.Tensor) -> float:
    """``clip_grad_norm_``'s total norm as a float (a DTensor's, over every shard)."""
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
