"""Giving a model built on the ``meta`` device its tensors on ``ctx.device``: each rank's shards,
read from the checkpoint as blocks, in the place the parallel layers' own metadata says.

Where a rank's piece of a dense tensor lies is what a sharded checkpoint needs too, so the loader
asks the same objects (:class:`~ops_transformer.checkpoint.contents.ModelTensors`): every local
tensor lists its dense entries, and each entry's layout gives ``(offsets in the dense tensor, view
of the local tensor)`` chunks — fused sub-blocks, padded vocabularies (padding rows are zero),
replicated key/value heads, GPT-2's transposed ``Conv1D`` weights and experts over ``ep`` alike,
with no model-specific code. A chunk is one :meth:`~.sources.Source.read` of exactly its block,
copied into the local tensor on the device; a replicated tensor is one chunk, the whole tensor.

Non-persistent buffers (rotary ``inv_freq``) are not in checkpoints: :func:`init_buffers` makes
them on the device and lets ``transformers`` compute them (its ``_init_weights``), before the plan.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from ..checkpoint.contents import ModelTensors
from ..checkpoint.errors import CheckpointError
from .sources import Source


@torch.no_grad()
def load_shards(model: nn.Module, sources: dict[str, Source], device: torch.device) -> None:
    """Replace every ``meta`` parameter and persistent buffer of the (parallelised) ``model`` by
    this rank's part of it, read from ``sources`` onto ``device`` in the meta tensor's dtype
    (the model was built in the dtype it runs in, modules ``transformers`` keeps in fp32
    included); then move every other buffer to ``device``."""
    tensors = ModelTensors(model)
    new: dict[int, torch.Tensor] = {}
    for name, tensor in tensors.tensors.items():
        if tensor.device.type != "meta":
            continue
        new[id(tensor)] = _fill(tensors.entries[name], tuple(tensor.shape), tensor.dtype, device,
                                sources)
    _replace(model, new, device)


def _fill(entries, shape, dtype, device, sources) -> torch.Tensor:
    """The local tensor of ``shape`` whose chunks ``entries`` describe."""
    pieces = []
    probe = torch.empty(shape, dtype=dtype, device="meta")  # chunk views, no storage
    for entry in entries:
        source = sources.get(entry.key)
        if source is None:  # only a tensor the dense model did not have (model_sources checks)
            raise CheckpointError(f"no tensor in the checkpoint for {entry.key!r}")
        if tuple(source.shape) != tuple(entry.layout.global_shape):
            raise CheckpointError(f"{source.name} has shape {tuple(source.shape)}, but the "
                                  f"parallel layer holding {entry.key!r} expects "
                                  f"{tuple(entry.layout.global_shape)}")
        for offsets, view in entry.chunks(probe):
            pieces.append((source, offsets, view))
    covered = sum(v.numel() for _, _, v in pieces)
    if len(pieces) == 1 and covered == math.prod(shape) and _is_whole(pieces[0][2], shape):
        source, offsets, _ = pieces[0]  # the whole local tensor in one block: read it straight
        block = source.read(_index(offsets, shape))
        return block.to(device=device, dtype=dtype, copy=True).contiguous()
    local = (torch.empty if covered == math.prod(shape) else torch.zeros)(
        shape, dtype=dtype, device=device)  # zeros: padding rows are part of no chunk
    for source, offsets, view in pieces:
        target = local.as_strided(view.shape, view.stride(), view.storage_offset())
        target.copy_(source.read(_index(offsets, view.shape)))
    return local


def _is_whole(view: torch.Tensor, shape) -> bool:
    return tuple(view.shape) == tuple(shape) and view.is_contiguous()


def _index(offsets, shape) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape))


def _replace(model: nn.Module, new: dict[int, torch.Tensor], device: torch.device) -> None:
    """Swap the loaded tensors in wherever the meta ones were (tied weights together), keeping
    each parameter's attributes (``shard_spec``, ``expert_shard``, partial-gradient group)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None or id(param) not in new:
                continue
            if id(param) not in made:
                fresh = nn.Parameter(new[id(param)], requires_grad=param.requires_grad)
                fresh.__dict__.update(param.__dict__)
                made[id(param)] = fresh
            module._parameters[key] = made[id(param)]
        for key, buffer in list(module._buffers.items()):
            if buffer is None:
                continue
            if id(buffer) in new:
                module._buffers[key] = new[id(buffer)]
            elif buffer.device.type == "meta":
                raise CheckpointError(f"buffer {key!r} of {type(module).__name__} is neither in "
                                      f"the checkpoint nor computed by the model")
            elif buffer.device != device:
                module._buffers[key] = buffer.to(device)


@torch.no_grad()
def init_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers of a ``transformers`` model built on ``meta``, computed on ``device``
    as ``transformers`` does when it loads a checkpoint: allocated there, then filled by the
    ``_init_weights`` of the (sub)model owning them (the rotary embedding's ``inv_freq``, BERT's
    ``position_ids``). Parameters are still on ``meta``, where initialisation does nothing."""
    owners = _init_owners(model)
    for name, module in model.named_modules():
        own = [k for k in getattr(module, "_non_persistent_buffers_set", ()) if
               module._buffers.get(k) is not None and module._buffers[k].device.type == "meta"]
        if not own:
            continue
        for key in own:
            buffer = module._buffers[key]
            fill = float("nan") if buffer.is_floating_point() else 0
            module._buffers[key] = torch.full(buffer.shape, fill, dtype=buffer.dtype,
                                              device=device)
        owner = owners.get(name)
        if owner is not None:
            owner._init_weights(module)
        for key in own:
            if module._buffers[key].is_floating_point() and module._buffers[key].isnan().any():
                warnings.warn(f"buffer {name}.{key} ({type(module).__name__}) is not set by "
                              f"transformers' _init_weights: it stays NaN", stacklevel=3)


def _init_owners(model: nn.Module) -> dict[str, nn.Module]:
    """Module name → the innermost ``transformers`` (sub)model containing it, whose
    ``_init_weights`` initialises it."""
    owners: dict[str, nn.Module] = {}
    for name, module in model.named_modules():  # outer models first: inner ones override
        if hasattr(module, "_init_weights") and hasattr(module, "config"):
            prefix = f"{name}." if name else ""
            for sub, _ in module.named_modules():
                owners[prefix + sub if sub else name] = module
    return owners
