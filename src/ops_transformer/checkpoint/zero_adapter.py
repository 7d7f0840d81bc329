"""ZeRO optimizer state in a checkpoint: each data-parallel rank writes its pieces, in the dense
coordinates of each parameter, so the state loads at any ``dp × tp`` — and into a plain
``torch.optim`` optimizer — and back.

A :class:`~ops_transformer.memory.zero.ZeroOptimizer` keeps the inner optimizer's state per
**piece**: a parameter's run ``[a, b)`` of its local (row-major) elements inside this rank's chunk
of the bucket, which :func:`~.pieces.entry_pieces` cuts into rectangles of the dense tensor. The
entries have the same keys as :class:`~.optim.TorchOptimizerAdapter`'s (``state/<dense>/<name>``),
so the two write interchangeable checkpoints. Element-wise state (Adam's moments) is written this
way; scalar state (``step``) is replicated under each parameter the rank holds a piece of.

Each rectangle is a strided view of the piece's state (:func:`flat_view`): saved without a copy,
and on load DCP reads the overlapping parts of whatever was stored straight into views of a fresh
piece, installed once everything is read. A parameter without saved state was never stepped and
keeps none.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .chunked import ChunkedTensor
from .contents import ModelTensors
from .errors import CheckpointError
from .layout import Entry, Replicated
from .optim import _check_groups, _merged_groups, _split_state_key, saved_group_keys
from .pieces import entry_pieces, flat_view, range_boxes  # noqa: F401 (importable from here)

def _pieces(optimizer, model: ModelTensors):
    """``(j, parameter, start, stop, entries)`` of the inner optimizer's parameters (pieces)."""
    return [(j, b.params[piece.index], piece.start, piece.stop,
             model.entries_of(b.params[piece.index]))
            for j, (b, piece) in enumerate(optimizer.pieces)]


def _piece_of(optimizer, model: ModelTensors) -> dict[str, int]:
    """Dense key → index of this rank's piece of the parameter holding it."""
    return {e.key: j for j, _, _, _, entries in _pieces(optimizer, model) for e in entries}


def _all_keys(optimizer, model: ModelTensors) -> list[str]:
    return [e.key for b in optimizer.buckets for p in b.params for e in model.entries_of(p)]


def _check_known(optimizer, model: ModelTensors) -> None:
    unknown = [n for b in optimizer.buckets for n, p in zip(b.names, b.params)
               if model.name_of(p) is None]
    if unknown:
        raise ValueError(f"the ZeRO optimizer holds parameters the model passed to the checkpoint "
                         f"does not (e.g. {unknown[:3]}): pass the model it was built on")


class PieceState(ChunkedTensor):
    """Load target: the rectangles of one dense tensor, as views into ``flat``, the new state
    ``name`` of piece ``piece`` (shared by the dense tensors the parameter holds)."""

    def __init__(self, global_shape, chunks, piece: int, name: str, flat: torch.Tensor):
        super().__init__(global_shape, chunks)
        self.piece, self.name, self.flat = piece, name, flat


class ZeroOptimizerAdapter:
    """The :class:`~.optim.OptimizerAdapter` of ``ZeroOptimizer`` (see the module docstring)."""

    def save_state(self, optimizer, model: ModelTensors, ctx) -> dict[str, Any]:
        _check_known(optimizer, model)
        inner = optimizer.inner.state_dict()
        out: dict[str, Any] = {}
        for j, p, a, b, entries in _pieces(optimizer, model):
            state = inner["state"].get(j)
            if not state:
                continue  # never stepped
            _check_state(state, b - a)
            for entry in entries:
                pieces = entry_pieces(entry, p.shape, a, b)
                for name, value in state.items():
                    out[f"state/{entry.key}/{name}"] = _saved(value, entry, pieces, -a)
        out[f"param_groups/{ctx.rank}"] = [{**{k: v for k, v in g.items() if k != "params"},
                                            "params": _all_keys(optimizer, model)}
                                           for g in inner["param_groups"]]
        return out

    def load_targets(self, optimizer, model: ModelTensors, saved: Mapping[str, Any],
                     ctx) -> dict[str, Any]:
        groups = saved_group_keys(saved)
        _check_known(optimizer, model)
        names: dict[str, list[str]] = {}
        for key in saved:
            if key.startswith("state/"):
                dense, name = _split_state_key(key)
                names.setdefault(dense, []).append(name)
        held, local = set(_all_keys(optimizer, model)), set(model.keys())
        stray = sorted(d for d in names if d not in held and d in local)
        if stray:
            raise CheckpointError(f"the checkpoint has optimizer state for parameter {stray[0]!r}, "
                                  f"which this optimizer does not hold")
        targets: dict[str, Any] = dict.fromkeys(groups)
        for j, p, a, b, entries in _pieces(optimizer, model):
            stepped = [e.key in names for e in entries]
            if not any(stepped):
                continue  # never stepped: keeps no state
            if not all(stepped):
                missing = next(e.key for e in entries if e.key not in names)
                raise CheckpointError(f"the checkpoint has no optimizer state for {missing!r}, "
                                      f"but has some for the other dense tensors of its "
                                      f"parameter")
            flats: dict[str, torch.Tensor] = {}
            for entry in entries:
                pieces = entry_pieces(entry, p.shape, a, b)
                for name in names[entry.key]:
                    key = f"state/{entry.key}/{name}"
                    targets[key] = _target(saved[key], entry, pieces, -a, j, b - a, p.device,
                                           name, flats, key)
        return targets

    def commit(self, optimizer, model: ModelTensors, loaded: dict[str, Any], ctx) -> None:
        saved_groups = _merged_groups(loaded)
        _check_groups(saved_groups, [{"params": [p for b in optimizer.buckets
                                                 for p in b.params]}], model)
        piece_of = _piece_of(optimizer, model)
        state: dict[int, dict] = {}
        scalars: dict[tuple[int, str], list] = {}
        for key, value in loaded.items():
            if not key.startswith("state/"):
                continue
            if isinstance(value, PieceState):
                state.setdefault(value.piece, {})[value.name] = value.flat
                continue
            dense, name = _split_state_key(key)
            if dense in piece_of:  # (others: another rank's pieces, or another rank's experts)
                value = value.local if isinstance(value, ChunkedTensor) else value
                scalars.setdefault((piece_of[dense], name), []).append((dense, value))
        for (j, name), values in scalars.items():
            first = values[0][1]
            if any(not _same(v, first) for _, v in values[1:]):
                warnings.warn(f"optimizer state {name!r} differs between dense tensors that one "
                              f"parameter of the ZeRO optimizer holds; using {values[0][0]!r}'s",
                              stacklevel=3)
            state.setdefault(j, {})[name] = first
        count = max(1, len(optimizer.pieces))  # (1: the placeholder of a rank without pieces)
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": list(range(count))} for g in saved_groups]
        optimizer.load_state_dict({"state": state, "param_groups": groups,
                                   "zero": optimizer.layout()})


def _check_state(state: dict, numel: int) -> None:
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) != (numel,):
            raise ValueError(f"ZeRO optimizer state {name!r} has shape {tuple(value.shape)}, "
                             f"neither one value per element of the piece ({numel}) nor a "
                             f"scalar: its layout is unknown")


def _saved(value, entry: Entry, pieces, shift: int):
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    if value.dim() == 0:
        return ChunkedTensor.of(Replicated(()), value)
    return ChunkedTensor(entry.layout.global_shape,
                         [(o, flat_view(value, part, shift)) for o, part in pieces])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _target(md, entry: Entry, pieces, shift: int, index: int, numel: int, device, name: str,
            flats: dict, key: str):
    if not isinstance(md, TensorStorageMetadata):
        return None
    dtype, size = md.properties.dtype, tuple(md.size)
    if not size:
        return ChunkedTensor.of(Replicated(()), torch.zeros((), dtype=dtype))
    if size != tuple(entry.layout.global_shape):
        raise CheckpointError(f"optimizer state {key!r} was saved with shape {size}, which does "
                              f"not fit its parameter (dense shape "
                              f"{tuple(entry.layout.global_shape)})")
    flat = flats.get(name)
    if flat is None:
        flat = flats[name] = torch.zeros(numel, dtype=dtype, device=device)
    return PieceState(size, [(o, flat_view(flat, part, shift)) for o, part in pieces], index, name,
                      flat)


ZERO_ADAPTER = ZeroOptimizerAdapter()
