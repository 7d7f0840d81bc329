"""What a checkpoint holds, as DCP keys, and how each part goes back into the job.

=========================  =================================================  ==================
key                        value                                              written by
=========================  =================================================  ==================
``model/<name>``           each parameter and persistent buffer, dense name   the ranks holding
                           and shape (tied weights once: the others are       its chunks (once
                           aliases in the manifest)                           per distinct chunk)
``optim/…``                the optimizer adapter's entries (:mod:`.optim`)    idem
``rng/<rank>``             that rank's RNG states                             that rank
``extra``, ``scaler``,     the caller's ``extra``; ``state_dict()`` of the    rank 0
``stateful/<name>``        loss scaler and other stateful objects
=========================  =================================================  ==================
"""

from __future__ import annotations

import io
import json
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .chunked import ChunkedTensor
from .errors import CheckpointError
from .layout import layout_of

MODEL, OPTIM, RNG = "model/", "optim/", "rng/"


def model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(name → tensor, alias → name)``: the parameters and persistent buffers under their
    dense-model names, each tensor once (tied weights become aliases)."""
    tensors, aliases, seen = {}, {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            aliases[name] = seen[id(tensor)]
        else:
            seen[id(tensor)] = name
            tensors[name] = tensor
    return tensors, aliases


def parameters(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters among :func:`model_tensors` (what an optimizer may hold)."""
    return {name: t for name, t in tensors.items() if isinstance(t, torch.nn.Parameter)}


def model_entries(tensors: Mapping[str, torch.Tensor]) -> dict[str, ChunkedTensor]:
    return {MODEL + name: ChunkedTensor.of(layout_of(t), t.detach()) for name, t in tensors.items()}


def model_targets(tensors: Mapping[str, torch.Tensor],
                  saved: Mapping[str, Any]) -> dict[str, ChunkedTensor]:
    """Fresh zero buffers shaped like each local tensor, to load into; a key or dense shape that
    differs from the checkpoint's is a :class:`CheckpointError`."""
    saved_names = {k[len(MODEL):] for k in saved if k.startswith(MODEL)}
    missing, unexpected = sorted(set(tensors) - saved_names), sorted(saved_names - set(tensors))
    if missing or unexpected:
        raise CheckpointError(
            f"the checkpoint does not fit this model: {len(missing)} tensor(s) of the model are not "
            f"in it (e.g. {missing[:3]}), {len(unexpected)} of its tensors are not in the model "
            f"(e.g. {unexpected[:3]})")
    targets = {}
    for name, tensor in tensors.items():
        layout, md = layout_of(tensor), saved[MODEL + name]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(layout.global_shape):
            shape = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
            raise CheckpointError(f"model tensor {name!r}: the checkpoint's dense shape is {shape}, "
                                  f"this model's is {tuple(layout.global_shape)} (a different "
                                  f"model configuration?)")
        targets[MODEL + name] = ChunkedTensor.of(layout, torch.zeros_like(tensor.detach()))
    return targets


@torch.no_grad()
def commit_model(tensors: Mapping[str, torch.Tensor], loaded: Mapping[str, Any]) -> None:
    for name, tensor in tensors.items():
        tensor.copy_(loaded[MODEL + name].local)


def describe_model(model: torch.nn.Module) -> dict:
    """Enough to rebuild the dense model for export: its class and configuration."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):  # Hugging Face
        return {"kind": "huggingface", "class": type(model).__name__,
                "config": json.loads(config.to_json_string(use_diff=False))}
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        return {"kind": "gpt", "class": type(model).__name__, "config": cfg.to_dict()}
    return {"kind": "module", "class": type(model).__name__}


def check_picklable(value, what: str) -> None:
    """``value`` must load back with ``torch.load(weights_only=True)`` (tensors, numbers,
    strings, lists, tuples, dicts): checked at save time rather than discovered at load."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as exc:
        raise ValueError(f"{what} must hold only tensors, numbers, strings, booleans, None, lists, "
                         f"tuples and dicts (it is loaded with weights_only=True): {exc}") from None
