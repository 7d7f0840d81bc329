"""Optimizer state in a checkpoint: a small protocol, a registry, and the adapter for ``torch.optim``.

An adapter turns an optimizer's state into checkpoint entries — :class:`ChunkedTensor` values for
tensors (sharded or replicated, in the dense coordinates of :mod:`.layout`) and plain values for
the rest — and back. Keys are relative to ``optim/`` and parameters are named by their dense-model
names, so the state loads at any other layout.

:class:`TorchOptimizerAdapter` covers ``torch.optim`` optimizers (SGD, Adam, AdamW, …): a state
tensor shaped like its parameter's local tensor (momentum, ``exp_avg``, ``exp_avg_sq``) follows the
parameter's layout; a 0-d tensor (``step``) and any state of a replicated parameter is replicated.

Extension point: an optimizer that shards its state differently (ZeRO over ``dp``) provides its own
adapter, either as a ``checkpoint_adapter`` attribute or with
:func:`register_optimizer_adapter` for its class.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .chunked import ChunkedTensor
from .errors import CheckpointError
from .layout import Replicated, layout_of

Params = Mapping[str, torch.Tensor]  # dense-model name → parameter


class OptimizerAdapter(Protocol):
    def save_state(self, optimizer, params: Params) -> dict[str, Any]:
        """Entries to save: key → :class:`ChunkedTensor` or a picklable plain value."""
        ...

    def load_targets(self, optimizer, params: Params, saved: Mapping[str, Any]) -> dict[str, Any]:
        """Entries to load, given the saved keys and their DCP metadata: key →
        :class:`ChunkedTensor` over fresh buffers, or ``None`` for a plain value. Raises
        :class:`CheckpointError` when the saved state does not fit this optimizer."""
        ...

    def commit(self, optimizer, params: Params, loaded: dict[str, Any]) -> None:
        """Install the loaded entries (check everything first: raise before changing anything)."""
        ...


_REGISTRY: dict[type, OptimizerAdapter] = {}


def register_optimizer_adapter(optimizer_type: type, adapter: OptimizerAdapter) -> None:
    """Use ``adapter`` for optimizers of ``optimizer_type`` (and its subclasses)."""
    _REGISTRY[optimizer_type] = adapter


def adapter_for(optimizer) -> OptimizerAdapter:
    custom = getattr(optimizer, "checkpoint_adapter", None)
    if custom is not None:
        return custom
    for cls in type(optimizer).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    if isinstance(optimizer, torch.optim.Optimizer):
        return TORCH_ADAPTER
    raise ValueError(f"no checkpoint adapter for optimizer {type(optimizer).__name__}: pass a "
                     f"torch.optim.Optimizer or register one with register_optimizer_adapter")


def _split_state_key(key: str) -> tuple[str, str]:
    fqn, _, name = key[len("state/"):].rpartition("/")
    return fqn, name


class TorchOptimizerAdapter:
    """``torch.optim`` optimizers, through their ``state_dict`` / ``load_state_dict``."""

    def save_state(self, optimizer, params: Params) -> dict[str, Any]:
        flat = _flat_params(optimizer)
        names = _names(params, flat)
        sd = optimizer.state_dict()
        out: dict[str, Any] = {}
        for index, state in sd["state"].items():
            fqn, param = names[index], flat[index]
            for name, value in state.items():
                key = f"state/{fqn}/{name}"
                out[key] = _chunked(param, value, key) if isinstance(value, torch.Tensor) else value
        out["param_groups"] = [{**{k: v for k, v in g.items() if k != "params"},
                                "params": [names[i] for i in g["params"]]}
                               for g in sd["param_groups"]]
        return out

    def load_targets(self, optimizer, params: Params, saved: Mapping[str, Any]) -> dict[str, Any]:
        if "param_groups" not in saved:
            raise CheckpointError("the checkpoint holds no optimizer state (it was saved with "
                                  "optimizer=None); pass optimizer=None to load the model only")
        held = {id(p) for p in _flat_params(optimizer)}
        targets: dict[str, Any] = {"param_groups": None}
        for key, md in saved.items():
            if not key.startswith("state/"):
                continue
            fqn, name = _split_state_key(key)
            param = params.get(fqn)
            if param is None or id(param) not in held:
                raise CheckpointError(f"the checkpoint has optimizer state {name!r} for parameter "
                                      f"{fqn!r}, which this optimizer does not hold")
            targets[key] = (_buffer_for(param, md, key) if isinstance(md, TensorStorageMetadata)
                            else None)
        return targets

    def commit(self, optimizer, params: Params, loaded: dict[str, Any]) -> None:
        flat = _flat_params(optimizer)
        index = {id(p): i for i, p in enumerate(flat)}
        saved_groups = loaded["param_groups"]
        _check_groups(saved_groups, optimizer.param_groups, _names(params, flat))
        state: dict[int, dict] = {}
        for key, value in loaded.items():
            if key.startswith("state/"):
                fqn, name = _split_state_key(key)
                state.setdefault(index[id(params[fqn])], {})[name] = (
                    value.local if isinstance(value, ChunkedTensor) else value)
        groups = [{**{k: v for k, v in saved.items() if k != "params"},
                   "params": [index[id(p)] for p in current["params"]]}
                  for saved, current in zip(saved_groups, optimizer.param_groups)]
        optimizer.load_state_dict({"state": state, "param_groups": groups})


TORCH_ADAPTER = TorchOptimizerAdapter()


def _flat_params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _names(params: Params, flat: list[torch.Tensor]) -> list[str]:
    by_id = {id(p): name for name, p in params.items()}
    missing = [i for i, p in enumerate(flat) if id(p) not in by_id]
    if missing:
        raise ValueError(f"the optimizer holds {len(missing)} tensor(s) that are not parameters "
                         f"of the model (first: index {missing[0]}, shape "
                         f"{tuple(flat[missing[0]].shape)}); an optimizer over other tensors (a "
                         f"ZeRO flat shard, say) needs its own adapter: see "
                         f"register_optimizer_adapter")
    return [by_id[id(p)] for p in flat]


def _chunked(param: torch.Tensor, value: torch.Tensor, key: str) -> ChunkedTensor:
    value = value.detach()
    layout = layout_of(param)
    if value.dim() > 0 and value.shape == param.shape:
        return ChunkedTensor.of(layout, value)
    if value.dim() == 0 or isinstance(layout, Replicated):
        return ChunkedTensor.of(Replicated(value.shape), value)
    raise ValueError(f"optimizer state {key!r} has shape {tuple(value.shape)}, neither its sharded "
                     f"parameter's local shape {tuple(param.shape)} nor a scalar: its layout is "
                     f"unknown; register an adapter with register_optimizer_adapter")


def _buffer_for(param: torch.Tensor, md: TensorStorageMetadata, key: str) -> ChunkedTensor:
    layout = layout_of(param)
    dtype, size = md.properties.dtype, tuple(md.size)
    if size and size == tuple(layout.global_shape):
        return ChunkedTensor.of(layout, torch.zeros(param.shape, dtype=dtype, device=param.device))
    if not size or isinstance(layout, Replicated):
        return ChunkedTensor.of(Replicated(size), torch.zeros(size, dtype=dtype,
                                                              device=param.device))
    raise CheckpointError(f"optimizer state {key!r} was saved with shape {size}, which does not "
                          f"fit its parameter (dense shape {tuple(layout.global_shape)})")


def _check_groups(saved_groups: list[dict], current_groups: list[dict], names: list[str]) -> None:
    if len(saved_groups) != len(current_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} parameter "
                              f"groups, this one has {len(current_groups)}")
    start = 0
    for i, (saved, current) in enumerate(zip(saved_groups, current_groups)):
        mine = set(names[start:start + len(current["params"])])
        start += len(current["params"])
        theirs = set(saved["params"])
        if mine != theirs:
            diff = sorted(mine ^ theirs)
            raise CheckpointError(f"optimizer parameter group {i} differs from the checkpoint's: "
                                  f"{len(diff)} parameter(s) in one but not the other, e.g. "
                                  f"{diff[:3]}")
