"""ZeRO optimizer state in a checkpoint: each data-parallel rank writes its flat shard, in the dense
coordinates of each parameter, so the state loads at any ``dp × tp`` — and into a plain
``torch.optim`` optimizer — and back.

A :class:`~ops_transformer.memory.zero.ZeroOptimizer` keeps, per flat bucket, the inner optimizer's
state for chunk ``dp_rank`` of the bucket. A parameter at bucket offset ``off`` overlaps that chunk
in a run ``[a, b)`` of its local (row-major) elements, and a run of a row-major tensor is a few
rectangles — at most a partial first row, whole rows, a partial last row per dimension::

    local shard of W [4, 6], elements 9 … 20 owned by this dp rank
    . . . . . .
    . . . x x x      row 1, columns 3–5     → box (1, 3) size (1, 3)
    x x x x x x      rows 2,                → box (2, 0) size (1, 6)
    x x x . . .      row 3, columns 0–2     → box (3, 0) size (1, 3)

Each rectangle is then mapped through the parameter's :class:`~.layout.Entry` (fused sub-blocks,
transposed ``Conv1D`` weights, padded vocabularies, selected experts) to the dense tensor. The
entries have the same keys as :class:`~.optim.TorchOptimizerAdapter`'s (``state/<dense>/<name>``),
so the two write interchangeable checkpoints. Element-wise state (Adam's moments) is written this
way; scalar state (``step``) is replicated under every parameter the rank's chunk touches.

On load each rank reads the rectangles of its own chunk (DCP reads the overlapping parts of
whatever was stored) into fresh buffers, then scatters them into new flat chunks; padding is zero,
as the optimizer has it. A bucket whose parameters have no saved state was never stepped and keeps
none. ZeRO steps a bucket as a whole, so one ``step`` per bucket: loading a ``torch.optim``
checkpoint whose parameters of one bucket were stepped different numbers of times takes the
first parameter's, with a warning.
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

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The rectangles covering elements ``[start, stop)`` of a row-major tensor of ``shape``."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = 1
    for n in shape[1:]:
        inner *= n
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # within one row of the first dimension
        return [((first, *o), (1, *s))
                for o, s in range_boxes(shape[1:], start - first * inner, stop - first * inner)]
    boxes: list[Box] = []
    whole_from, whole_to = first, last + 1
    if start % inner:
        boxes += [((first, *o), (1, *s)) for o, s in
                  range_boxes(shape[1:], start % inner, inner)]
        whole_from = first + 1
    tail: list[Box] = []
    if stop % inner:
        tail = [((last, *o), (1, *s)) for o, s in range_boxes(shape[1:], 0, stop % inner)]
        whole_to = last
    if whole_to > whole_from:
        boxes.append(((whole_from,) + (0,) * (len(shape) - 1),
                      (whole_to - whole_from, *shape[1:])))
    return boxes + tail


def entry_pieces(entry: Entry, local_shape, start: int, stop: int) -> list[tuple[tuple[int, ...],
                                                                                torch.Tensor]]:
    """``(dense offsets, local flat indices)`` of the rectangles of ``entry`` made of the local
    tensor's elements ``[start, stop)``; the index tensor has the rectangle's (dense) shape."""
    index = torch.arange(int(torch.Size(local_shape).numel())).view(local_shape)
    pieces = []
    for offsets, view in entry.chunks(index):
        if view.numel() == 0:
            continue
        # in this order of the view's dimensions its flat indices grow in row-major order
        order = sorted(range(view.dim()), key=lambda d: (-view.stride(d), d))
        ordered = view.permute(order)
        values = ordered.reshape(-1)
        lo = int(torch.searchsorted(values, start))
        hi = int(torch.searchsorted(values, stop))
        for box_off, box_size in range_boxes(tuple(ordered.shape), lo, hi):
            dense_off, dense_size = list(offsets), [0] * view.dim()
            for k, d in enumerate(order):
                dense_off[d] += box_off[k]
                dense_size[d] = box_size[k]
            part = view
            for d in range(view.dim()):
                part = part.narrow(d, dense_off[d] - offsets[d], dense_size[d])
            pieces.append((tuple(dense_off), part.contiguous()))
    return pieces


class FlatShard(ChunkedTensor):
    """The rectangles of one dense tensor held by a flat chunk: ``positions[i]`` are the chunk
    positions of ``chunks[i]``'s elements."""

    def __init__(self, global_shape, chunks, positions: list[torch.Tensor]):
        super().__init__(global_shape, chunks)
        self.positions = positions


def _overlap(bucket, off: int, numel: int) -> tuple[int, int]:
    """The run of a parameter's local elements inside this rank's chunk of the bucket."""
    return max(0, bucket.lo - off), min(numel, bucket.lo + bucket.chunk - off)


def _params(bucket, model: ModelTensors):
    """``(parameter, offset, entries)`` of a bucket's parameters."""
    return [(p, off, model.entries_of(p)) for p, off in zip(bucket.params, bucket.offsets)]


def _check_known(optimizer, model: ModelTensors) -> None:
    unknown = [n for b in optimizer.buckets for n, p in zip(b.names, b.params)
               if model.name_of(p) is None]
    if unknown:
        raise ValueError(f"the ZeRO optimizer holds parameters the model passed to the checkpoint "
                         f"does not (e.g. {unknown[:3]}): pass the model it was built on")


class ZeroOptimizerAdapter:
    """The :class:`~.optim.OptimizerAdapter` of ``ZeroOptimizer`` (see the module docstring)."""

    def save_state(self, optimizer, model: ModelTensors, ctx) -> dict[str, Any]:
        _check_known(optimizer, model)
        inner = optimizer.inner.state_dict()
        out: dict[str, Any] = {}
        for i, bucket in enumerate(optimizer.buckets):
            state = inner["state"].get(i)
            if not state:
                continue  # never stepped
            for p, off, entries in _params(bucket, model):
                a, b = _overlap(bucket, off, p.numel())
                if a >= b:
                    continue
                for entry in entries:
                    for name, value in state.items():
                        key = f"state/{entry.key}/{name}"
                        out[key] = self._entry(bucket, p, off, entry, name, value, a, b)
        groups = inner["param_groups"]
        keys = [e.key for b in optimizer.buckets for p, _, es in _params(b, model) for e in es]
        out[f"param_groups/{ctx.rank}"] = [{**{k: v for k, v in g.items() if k != "params"},
                                            "params": keys} for g in groups]
        return out

    @staticmethod
    def _entry(bucket, p, off: int, entry: Entry, name: str, value, a: int, b: int):
        if not isinstance(value, torch.Tensor):
            return value
        value = value.detach()
        if value.dim() == 0:
            return ChunkedTensor.of(Replicated(()), value)
        if tuple(value.shape) != (bucket.chunk,):
            raise ValueError(f"ZeRO optimizer state {name!r} has shape {tuple(value.shape)}, "
                             f"neither one value per element of the chunk ({bucket.chunk}) nor a "
                             f"scalar: its layout is unknown")
        chunks = [(o, value[idx + (off - bucket.lo)])
                  for o, idx in entry_pieces(entry, p.shape, a, b)]
        return ChunkedTensor(entry.layout.global_shape, chunks)

    def load_targets(self, optimizer, model: ModelTensors, saved: Mapping[str, Any],
                     ctx) -> dict[str, Any]:
        groups = saved_group_keys(saved)
        _check_known(optimizer, model)
        names: dict[str, list[str]] = {}
        for key in saved:
            if key.startswith("state/"):
                dense, name = _split_state_key(key)
                names.setdefault(dense, []).append(name)
        held = {e.key for b in optimizer.buckets for _, _, es in _params(b, model) for e in es}
        stray = sorted(d for d in names if d not in held and d in set(model.keys()))
        if stray:
            raise CheckpointError(f"the checkpoint has optimizer state for parameter {stray[0]!r}, "
                                  f"which this optimizer does not hold")
        targets: dict[str, Any] = dict.fromkeys(groups)
        for bucket in optimizer.buckets:
            params = _params(bucket, model)
            if not any(e.key in names for _, _, es in params for e in es):
                continue  # never stepped: keeps no state
            for p, off, entries in params:
                a, b = _overlap(bucket, off, p.numel())
                for entry in entries:
                    if entry.key not in names:
                        raise CheckpointError(f"the checkpoint has no optimizer state for "
                                              f"parameter {entry.key!r}, but has some for the "
                                              f"parameters stepped with it")
                    for name in names[entry.key]:
                        key = f"state/{entry.key}/{name}"
                        targets[key] = _load_target(saved[key], entry, p, a, b, off, bucket, key)
        return targets

    def commit(self, optimizer, model: ModelTensors, loaded: dict[str, Any], ctx) -> None:
        saved_groups = _merged_groups(loaded)
        params = [p for b in optimizer.buckets for p in b.params]
        _check_groups(saved_groups, [{"params": params}], model)
        state: dict[int, dict] = {}
        for i, bucket in enumerate(optimizer.buckets):
            chunk: dict[str, Any] = {}
            scalars: dict[str, list] = {}
            for p, off, entries in _params(bucket, model):
                for entry in entries:
                    prefix = f"state/{entry.key}/"
                    for key, value in loaded.items():
                        if not key.startswith(prefix):
                            continue
                        name = key[len(prefix):]
                        if isinstance(value, FlatShard):
                            flat = chunk.get(name)
                            if flat is None:
                                dtype = value.chunks[0][1].dtype if value.chunks else \
                                    bucket.flat.dtype
                                flat = chunk[name] = torch.zeros(bucket.chunk, dtype=dtype,
                                                                 device=bucket.flat.device)
                            for (_, data), pos in zip(value.chunks, value.positions):
                                flat[pos] = data.to(flat.dtype)
                        else:
                            scalars.setdefault(name, []).append(
                                (entry.key, value.local if isinstance(value, ChunkedTensor)
                                 else value))
            for name, values in scalars.items():
                first = values[0][1]
                if any(not _same(v, first) for _, v in values[1:]):
                    warnings.warn(f"optimizer state {name!r} differs between parameters that the "
                                  f"ZeRO optimizer steps together (bucket {i}); using "
                                  f"{values[0][0]!r}'s", stacklevel=3)
                chunk[name] = first
            if chunk:
                state[i] = chunk
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": list(range(len(optimizer.buckets)))} for g in saved_groups]
        optimizer.load_state_dict({"state": state, "param_groups": groups,
                                   "zero": optimizer.layout()})


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _load_target(md, entry: Entry, p: torch.Tensor, a: int, b: int, off: int, bucket, key: str):
    if not isinstance(md, TensorStorageMetadata):
        return None
    dtype, size = md.properties.dtype, tuple(md.size)
    if not size:
        return ChunkedTensor.of(Replicated(()), torch.zeros((), dtype=dtype))
    if size != tuple(entry.layout.global_shape):
        raise CheckpointError(f"optimizer state {key!r} was saved with shape {size}, which does "
                              f"not fit its parameter (dense shape "
                              f"{tuple(entry.layout.global_shape)})")
    pieces = entry_pieces(entry, p.shape, a, b) if a < b else []
    chunks = [(o, torch.zeros(idx.shape, dtype=dtype, device=bucket.flat.device))
              for o, idx in pieces]
    return FlatShard(size, chunks, [idx + (off - bucket.lo) for _, idx in pieces])


ZERO_ADAPTER = ZeroOptimizerAdapter()
