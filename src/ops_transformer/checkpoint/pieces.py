"""A run of a row-major tensor's elements, in the dense coordinates of a checkpoint entry.

Two kinds of local tensor hold only a run of a (tensor-parallel) parameter's elements: a ZeRO
optimizer's piece (elements ``[a, b)`` of the parameter, :mod:`.zero_adapter`) and a parameter
that FSDP2 shards over data-parallel ranks (rows ``[r0, r1)`` of dim 0, that is elements
``[r0·inner, r1·inner)``: :class:`DataShardLayout`). A run of a row-major tensor is a few
rectangles — at most a partial first row, whole rows, a partial last row per dimension::

    local shard of W [4, 6], elements 9 … 20 owned by this rank
    . . . . . .
    . . . x x x      row 1, columns 3–5     → box (1, 3) size (1, 3)
    x x x x x x      rows 2,                → box (2, 0) size (1, 6)
    x x x . . .      row 3, columns 0–2     → box (3, 0) size (1, 3)

and each rectangle is mapped through the parameter's :class:`~.layout.Entry` (fused sub-blocks,
transposed ``Conv1D`` weights, padded vocabularies, selected experts) to the dense tensor — on a
``meta`` tensor of the whole local shape, whose views' ``storage_offset()`` and ``stride()`` then
place each rectangle in the run's own storage (:func:`flat_view`), without a copy.
"""

from __future__ import annotations

import torch

from ..parallel.sharding import data_shard_rows
from .layout import Entry

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


class DataShardLayout:
    """The chunks of ``entry`` held by rows ``[first, first + rows)`` of dim 0 of a local tensor of
    ``local_shape`` (FSDP2's shard of a parameter on this data-parallel rank): the layout of the
    shard itself, in the entry's dense coordinates."""

    def __init__(self, entry: Entry, local_shape, first: int, rows: int):
        self.entry, self.local_shape = entry, tuple(local_shape)
        inner = 1
        for n in self.local_shape[1:]:
            inner *= n
        self.start, self.stop = first * inner, (first + rows) * inner
        self.global_shape = tuple(entry.layout.global_shape)

    def chunks(self, local: torch.Tensor):
        return [(offsets, flat_view(local, part, -self.start))
                for offsets, part in entry_pieces(self.entry, self.local_shape, self.start,
                                                  self.stop)]

    def __repr__(self) -> str:
        return f"DataShardLayout({self.entry.key}, elements {self.start}..{self.stop})"


def data_shard_entry(entry: Entry, param) -> Entry:
    """``entry`` of a parameter sharded over data-parallel ranks (a ``DTensor`` of dim-0 shards):
    the same dense tensor, chunked as this rank's rows hold it."""
    first, rows = data_shard_rows(param)
    return Entry(entry.key, DataShardLayout(entry, param.shape, first, rows))
