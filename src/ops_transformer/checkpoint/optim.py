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
from torch.distributed.tensor import DTensor

from ..parallel.sharding import local_tensor
from .chunked import ChunkedTensor
from .contents import ModelTensors
from .errors import CheckpointError
from .layout import Entry, Replicated


class OptimizerAdapter(Protocol):
    def save_state(self, optimizer, model: ModelTensors, ctx) -> dict[str, Any]:
        """Entries to save: key → :class:`ChunkedTensor` or a picklable plain value."""
        ...

    def load_targets(self, optimizer, model: ModelTensors, saved: Mapping[str, Any],
                     ctx) -> dict[str, Any]:
        """Entries to load, given the saved keys and their DCP metadata: key →
        :class:`ChunkedTensor` over fresh buffers, or ``None`` for a plain value. Raises
        :class:`CheckpointError` when the saved state does not fit this optimizer."""
        ...

    def commit(self, optimizer, model: ModelTensors, loaded: dict[str, Any], ctx) -> None:
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
    """``torch.optim`` optimizers, through their ``state_dict`` / ``load_state_dict``. A
    parameter's state is saved under each dense key the parameter holds (see
    :class:`~.contents.ModelTensors`). Each rank saves its parameter groups (``param_groups/<rank>``:
    hyperparameters and the dense keys of its parameters); a load takes the union of the keys, so
    ranks may hold different parameters (experts over ``ep``)."""

    def save_state(self, optimizer, model: ModelTensors, ctx) -> dict[str, Any]:
        flat = _flat_params(optimizer)
        _check_known(model, flat)
        sd = optimizer.state_dict()
        out: dict[str, Any] = {}
        for index, state in sd["state"].items():
            param = flat[index]
            for name, value in state.items():
                for entry in model.entries_of(param):
                    key = f"state/{entry.key}/{name}"
                    out[key] = (_chunked(param, value, entry, key)
                                if isinstance(value, torch.Tensor) else value)
        out[f"param_groups/{ctx.rank}"] = [
            {**{k: v for k, v in g.items() if k != "params"},
             "params": _group_keys(model, [flat[i] for i in g["params"]])}
            for g in sd["param_groups"]]
        return out

    def load_targets(self, optimizer, model: ModelTensors, saved: Mapping[str, Any],
                     ctx) -> dict[str, Any]:
        groups = saved_group_keys(saved)
        flat = _flat_params(optimizer)
        _check_known(model, flat)
        held = {e.key: (p, e) for p in flat for e in model.entries_of(p)}
        local = set(model.keys())
        buffers: dict[tuple[int, str], torch.Tensor] = {}  # one per parameter and state
        targets: dict[str, Any] = dict.fromkeys(groups)
        for key, md in saved.items():
            if not key.startswith("state/"):
                continue
            dense, name = _split_state_key(key)
            if dense not in held:
                if dense not in local:  # another rank's (its experts): not loaded here
                    continue
                raise CheckpointError(f"the checkpoint has optimizer state {name!r} for parameter "
                                      f"{dense!r}, which this optimizer does not hold")
            if isinstance(md, TensorStorageMetadata):
                targets[key] = _target(*held[dense], md, key, buffers, name)
            else:
                targets[key] = None
        return targets

    def commit(self, optimizer, model: ModelTensors, loaded: dict[str, Any], ctx) -> None:
        flat = _flat_params(optimizer)
        index = {id(p): i for i, p in enumerate(flat)}
        owner = {e.key: p for p in flat for e in model.entries_of(p)}
        saved_groups = _merged_groups(loaded)
        _check_groups(saved_groups, optimizer.param_groups, model)
        state: dict[int, dict] = {}
        for key, value in loaded.items():
            if key.startswith("state/"):
                dense, name = _split_state_key(key)
                param = owner[dense]
                value = value.local if isinstance(value, ChunkedTensor) else value
                state.setdefault(index[id(param)], {})[name] = _like_param(value, param)
        groups = [{**{k: v for k, v in saved.items() if k != "params"},
                   "params": [index[id(p)] for p in current["params"]]}
                  for saved, current in zip(saved_groups, optimizer.param_groups)]
        optimizer.load_state_dict({"state": state, "param_groups": groups})


TORCH_ADAPTER = TorchOptimizerAdapter()


def saved_group_keys(saved: Mapping[str, Any]) -> list[str]:
    """The saved ranks' ``param_groups/<rank>`` keys; none: a :class:`CheckpointError`."""
    groups = [k for k in saved if k.startswith("param_groups/")]
    if not groups:
        raise CheckpointError("the checkpoint holds no optimizer state (it was saved with "
                              "optimizer=None); pass optimizer=None to load the model only")
    return groups


def _flat_params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _check_known(model: ModelTensors, flat: list[torch.Tensor]) -> None:
    missing = [i for i, p in enumerate(flat) if model.name_of(p) is None]
    if missing:
        raise ValueError(f"the optimizer holds {len(missing)} tensor(s) that are not parameters "
                         f"of the model (first: index {missing[0]}, shape "
                         f"{tuple(flat[missing[0]].shape)}); an optimizer over other tensors (a "
                         f"ZeRO flat shard, say) needs its own adapter: see "
                         f"register_optimizer_adapter")


def _group_keys(model: ModelTensors, params: list[torch.Tensor]) -> list[str]:
    return [e.key for p in params for e in model.entries_of(p)]


def _chunked(param: torch.Tensor, value: torch.Tensor, entry: Entry, key: str) -> ChunkedTensor:
    value = value.detach()
    if value.dim() > 0 and value.shape == param.shape:  # (a DTensor: its rows, as its param's)
        return ChunkedTensor.of_entry(entry, local_tensor(value).detach())
    value = local_tensor(value)
    if value.dim() == 0 or (isinstance(entry.layout, Replicated)
                            and tuple(entry.layout.global_shape) == tuple(param.shape)):
        return ChunkedTensor.of(Replicated(value.shape), value)
    raise ValueError(f"optimizer state {key!r} has shape {tuple(value.shape)}, neither its sharded "
                     f"parameter's local shape {tuple(param.shape)} nor a scalar: its layout is "
                     f"unknown; register an adapter with register_optimizer_adapter")


def _target(param: torch.Tensor, entry: Entry, md: TensorStorageMetadata, key: str,
            buffers: dict, name: str) -> ChunkedTensor:
    dtype, size = md.properties.dtype, tuple(md.size)
    if size and size == tuple(entry.layout.global_shape):
        buffer = buffers.get((id(param), name))
        if buffer is None:
            buffer = buffers[(id(param), name)] = torch.zeros(local_tensor(param).shape,
                                                              dtype=dtype, device=param.device)
        return ChunkedTensor.of_entry(entry, buffer)
    replicated = isinstance(entry.layout, Replicated) and \
        tuple(entry.layout.global_shape) == tuple(param.shape)
    if not size or replicated:
        # a 0-d state (AdamW's ``step``) loads on the CPU, where a non-fused, non-capturable
        # optimizer keeps it (on a GPU it would cost a host sync per parameter per step);
        # ``Optimizer.load_state_dict`` moves it to the parameter for fused/capturable ones
        device = param.device if size else torch.device("cpu")
        return ChunkedTensor.of(Replicated(size), torch.zeros(size, dtype=dtype, device=device))
    raise CheckpointError(f"optimizer state {key!r} was saved with shape {size}, which does not "
                          f"fit its parameter (dense shape {tuple(entry.layout.global_shape)})")


def _like_param(value, param: torch.Tensor):
    """A loaded state tensor of a data-parallel ``DTensor`` parameter (its rows) as a ``DTensor``
    placed like the parameter, as ``torch.optim`` keeps it; anything else as it is."""
    if (isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0
            and tuple(value.shape) == tuple(local_tensor(param).shape)):
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value


def _merged_groups(loaded: dict[str, Any]) -> list[dict]:
    """The saved ranks' parameter groups: rank 0's hyperparameters, every rank's keys."""
    per_rank = [v for k, v in sorted(loaded.items(), key=lambda kv: kv[0])
                if k.startswith("param_groups/")]
    merged = [dict(g, params=set()) for g in per_rank[0]]
    for groups in per_rank:
        if len(groups) != len(merged):
            raise CheckpointError("the saved ranks' optimizers have different numbers of "
                                  "parameter groups")
        for target, group in zip(merged, groups):
            target["params"].update(group["params"])
    return merged


def _check_groups(saved_groups: list[dict], current_groups: list[dict],
                  model: ModelTensors) -> None:
    if len(saved_groups) != len(current_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} parameter "
                              f"groups, this one has {len(current_groups)}")
    for i, current in enumerate(current_groups):
        for key in _group_keys(model, current["params"]):
            where = [j for j, g in enumerate(saved_groups) if key in g["params"]]
            if where != [i]:
                raise CheckpointError(f"optimizer parameter {key!r} is in group {i} here but "
                                      f"{'in group ' + str(where[0]) if where else 'in no group'} "
                                      f"of the checkpoint's optimizer")
