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

Each rectangle is a strided view of the flat chunk (:func:`flat_view`): saved without a copy, and
on load DCP reads the overlapping parts of whatever was stored straight into views of a fresh flat
chunk (its padding zero, as the optimizer keeps it), installed once everything is read. A bucket whose parameters have no saved state was never stepped and keeps
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


def _count_below(bound: int, base: int, sizes, strides) -> int:
    """How many elements of a strided view (strides decreasing and nested, as those of views of a
    contiguous tensor in that order) sit at flat positions below ``bound``; ``base``: the first's."""
    if not sizes:
        return int(base < bound)
    n, stride = sizes[0], strides[0]
    reach = sum((m - 1) * st for m, st in zip(sizes[1:], strides[1:]))
    inner = 1
    for m in sizes[1:]:
        inner *= m
    full = min(n, max(0, -(-(bound - base - reach) // stride))) if stride else (
        n if base + reach < bound else 0)
    if full == n:
        return n * inner
    return full * inner + _count_below(bound, base + full * stride, sizes[1:], strides[1:])


def entry_pieces(entry: Entry, local_shape, start: int, stop: int) -> list[tuple[tuple[int, ...],
                                                                                torch.Tensor]]:
    """``(dense offsets, view)`` of the rectangles of ``entry`` made of the local tensor's
    elements ``[start, stop)``. ``view`` is a view of a meta tensor of ``local_shape``, in dense
    orientation: its ``storage_offset()`` and ``stride()`` place the rectangle in the local
    tensor's row-major elements (:func:`flat_view` turns it into a view of a flat chunk)."""
    local = torch.empty(local_shape, device="meta")
    pieces = []
    for offsets, view in entry.chunks(local):
        if view.numel() == 0:
            continue
        # in this order of the view's dimensions its elements' positions grow in row-major order
        order = sorted(range(view.dim()), key=lambda d: (-view.stride(d), d))
        sizes = [view.shape[d] for d in order]
        strides = [view.stride(d) for d in order]
        base = view.storage_offset()
        lo = _count_below(start, base, sizes, strides)
        hi = _count_below(stop, base, sizes, strides)
        for box_off, box_size in range_boxes(tuple(sizes), lo, hi):
            part = view
            dense_off = list(offsets)
            for k, d in enumerate(order):
                part = part.narrow(d, box_off[k], box_size[k])
                dense_off[d] += box_off[k]
            pieces.append((tuple(dense_off), part))
    return pieces


def flat_view(flat: torch.Tensor, part: torch.Tensor, shift: int) -> torch.Tensor:
    """The elements of the meta view ``part`` (from :func:`entry_pieces`) in ``flat``, where local
    element ``j`` sits at ``flat[j + shift]``."""
    return flat.as_strided(part.shape, part.stride(), flat.storage_offset()
                           + part.storage_offset() + shift)


def _overlap(bucket, off: int, numel: int) -> tuple[int, int]:
    """The run of a parameter's local elements inside this rank's chunk of the bucket."""
    return max(0, bucket.lo - off), min(numel, bucket.lo + bucket.chunk - off)


def _params(bucket, model: ModelTensors):
    """``(parameter, offset, entries)`` of a bucket's parameters."""
    return [(p, off, model.entries_of(p)) for p, off in zip(bucket.params, bucket.offsets)]


def _bucket_of(optimizer, model: ModelTensors) -> dict[str, int]:
    """Dense key → index of the bucket holding it."""
    return {e.key: i for i, b in enumerate(optimizer.buckets)
            for _, _, entries in _params(b, model) for e in entries}


def _check_known(optimizer, model: ModelTensors) -> None:
    unknown = [n for b in optimizer.buckets for n, p in zip(b.names, b.params)
               if model.name_of(p) is None]
    if unknown:
        raise ValueError(f"the ZeRO optimizer holds parameters the model passed to the checkpoint "
                         f"does not (e.g. {unknown[:3]}): pass the model it was built on")


class FlatShard(ChunkedTensor):
    """Load target: the rectangles of one dense tensor, as views into ``flat``, the new chunk of
    state ``name`` of bucket ``bucket`` (shared by the bucket's parameters)."""

    def __init__(self, global_shape, chunks, bucket: int, name: str, flat: torch.Tensor):
        super().__init__(global_shape, chunks)
        self.bucket, self.name, self.flat = bucket, name, flat


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
            _check_state(state, bucket)
            for p, off, entries in _params(bucket, model):
                a, b = _overlap(bucket, off, p.numel())
                if a >= b:
                    continue
                for entry in entries:
                    pieces = entry_pieces(entry, p.shape, a, b)
                    for name, value in state.items():
                        out[f"state/{entry.key}/{name}"] = _saved(value, entry, pieces,
                                                                  off - bucket.lo)
        keys = list(_bucket_of(optimizer, model))
        out[f"param_groups/{ctx.rank}"] = [{**{k: v for k, v in g.items() if k != "params"},
                                            "params": keys} for g in inner["param_groups"]]
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
        held, local = _bucket_of(optimizer, model), set(model.keys())
        stray = sorted(d for d in names if d not in held and d in local)
        if stray:
            raise CheckpointError(f"the checkpoint has optimizer state for parameter {stray[0]!r}, "
                                  f"which this optimizer does not hold")
        targets: dict[str, Any] = dict.fromkeys(groups)
        for i, bucket in enumerate(optimizer.buckets):
            params = _params(bucket, model)
            if not any(e.key in names for _, _, es in params for e in es):
                continue  # never stepped: keeps no state
            flats: dict[str, torch.Tensor] = {}
            for p, off, entries in params:
                a, b = _overlap(bucket, off, p.numel())
                for entry in entries:
                    if entry.key not in names:
                        raise CheckpointError(f"the checkpoint has no optimizer state for "
                                              f"parameter {entry.key!r}, but has some for the "
                                              f"parameters stepped with it")
                    pieces = entry_pieces(entry, p.shape, a, b) if a < b else []
                    for name in names[entry.key]:
                        key = f"state/{entry.key}/{name}"
                        targets[key] = _target(saved[key], entry, pieces, off - bucket.lo, i,
                                               bucket, name, flats, key)
        return targets

    def commit(self, optimizer, model: ModelTensors, loaded: dict[str, Any], ctx) -> None:
        saved_groups = _merged_groups(loaded)
        _check_groups(saved_groups, [{"params": [p for b in optimizer.buckets
                                                 for p in b.params]}], model)
        bucket_of = _bucket_of(optimizer, model)
        state: dict[int, dict] = {}
        scalars: dict[tuple[int, str], list] = {}
        for key, value in loaded.items():
            if not key.startswith("state/"):
                continue
            if isinstance(value, FlatShard):
                state.setdefault(value.bucket, {})[value.name] = value.flat
                continue
            dense, name = _split_state_key(key)
            if dense in bucket_of:  # (another rank's experts are not this optimizer's)
                value = value.local if isinstance(value, ChunkedTensor) else value
                scalars.setdefault((bucket_of[dense], name), []).append((dense, value))
        for (i, name), values in scalars.items():
            first = values[0][1]
            if any(not _same(v, first) for _, v in values[1:]):
                warnings.warn(f"optimizer state {name!r} differs between parameters that the "
                              f"ZeRO optimizer steps together (bucket {i}); using "
                              f"{values[0][0]!r}'s", stacklevel=3)
            state.setdefault(i, {})[name] = first
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": list(range(len(optimizer.buckets)))} for g in saved_groups]
        optimizer.load_state_dict({"state": state, "param_groups": groups,
                                   "zero": optimizer.layout()})


def _check_state(state: dict, bucket) -> None:
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) != \
                (bucket.chunk,):
            raise ValueError(f"ZeRO optimizer state {name!r} has shape {tuple(value.shape)}, "
                             f"neither one value per element of the chunk ({bucket.chunk}) nor a "
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


def _target(md, entry: Entry, pieces, shift: int, index: int, bucket, name: str,
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
    if flat is None:  # zeros: the padding, as the optimizer keeps it
        flat = flats[name] = torch.zeros(bucket.chunk, dtype=dtype, device=bucket.flat.device)
    return FlatShard(size, [(o, flat_view(flat, part, shift)) for o, part in pieces], index, name,
                     flat)


ZERO_ADAPTER = ZeroOptimizerAdapter()
