"""Where this rank's piece of a tensor sits in the checkpoint's dense tensor.

A checkpoint stores every tensor in its *dense* form — the key, shape and orientation it has in the
model before :func:`~ops_transformer.parallelize` (GPT-2's ``Conv1D`` weights ``[in, out]``, an
unpadded vocabulary) — cut into chunks. A :class:`Layout` says which rectangular chunks of that
dense tensor a rank holds, as views into its local tensor::

    ShardSpec(full_shape=(12, 4), split_dim=0, tp=2, sub_blocks=(4, 4, 4))     Q | K | V fused
    rank 0 local rows [q0 q1 k0 k1 v0 v1]  →  chunks at rows 0, 4, 8  (2 rows each)
    rank 1 local rows [q2 q3 k2 k3 v2 v3]  →  chunks at rows 2, 6, 10

Padding rows of a vocabulary are not part of the dense tensor and are never saved; key/value heads
held by several replicas give identical chunks, which the checkpoint writes once. Because the
chunks are expressed in dense coordinates, a checkpoint saved at one layout loads at any other:
each rank reads the parts of the stored chunks that overlap its own (DCP's resharding).

Extension points: a tensor with a ``checkpoint_layout`` attribute (any object with
``global_shape`` and ``chunks(local)``) uses it instead of its ``shard_spec``; a module whose local
tensors hold several dense tensors, or dense tensors under other names (the experts of an
expert-parallel layer), maps each of its tensors to :class:`Entry` objects
(:func:`~ops_transformer.checkpoint.contents.register_module_entries`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..parallel.sharding import ShardSpec, shard_spec

Chunk = tuple[tuple[int, ...], torch.Tensor]  # (offsets in the dense tensor, view of local data)


@runtime_checkable
class Layout(Protocol):
    """The dense shape of a tensor and the chunks of it that a local tensor holds."""

    global_shape: tuple[int, ...]

    def chunks(self, local: torch.Tensor) -> list[Chunk]:
        """``(offsets, view)`` pairs; ``view`` is a view of ``local`` in dense orientation."""
        ...


class Replicated:
    """Every rank holds the whole tensor (norms, row-parallel biases, replicated heads)."""

    def __init__(self, shape):
        self.global_shape = tuple(shape)

    def chunks(self, local: torch.Tensor) -> list[Chunk]:
        _check_shape(local, self.global_shape, "replicated tensor")
        return [((0,) * local.dim(), local)]

    def __repr__(self) -> str:
        return f"Replicated{self.global_shape}"


class SpecLayout:
    """The chunks described by a :class:`~ops_transformer.parallel.sharding.ShardSpec`: one per
    fused sub-block, padding rows dropped, transposed (``Conv1D``) weights in dense orientation."""

    def __init__(self, spec: ShardSpec):
        if spec.padded_size and spec.sub_blocks and len(spec.sub_blocks) > 1:
            raise ValueError(f"a ShardSpec cannot combine padding and sub-blocks: {spec}")
        if spec.transposed and len(spec.full_shape) != 2:
            raise ValueError(f"only 2-D weights can be transposed: {spec}")
        self.spec = spec
        shape = spec.full_shape
        self.global_shape = tuple(reversed(shape)) if spec.transposed else tuple(shape)

    def chunks(self, local: torch.Tensor) -> list[Chunk]:
        spec = self.spec
        _check_shape(local, spec.local_shape, f"shard of {spec}")
        dim, real = spec.split_dim, spec.full_shape[spec.split_dim]
        out, pos = [], 0
        for start, length in spec.slices():
            piece = local.narrow(dim, pos, length)
            pos += length
            keep = min(length, real - start)  # rows past the real vocabulary are padding
            if keep <= 0:
                continue
            piece = piece.narrow(dim, 0, keep)
            offsets = [0] * local.dim()
            offsets[dim] = start
            if spec.transposed:
                piece, offsets = piece.t(), offsets[::-1]
            out.append((tuple(offsets), piece))
        return out

    def __repr__(self) -> str:
        return f"SpecLayout({self.spec})"


def layout_of(tensor: torch.Tensor) -> Layout:
    """The tensor's ``checkpoint_layout``, else the layout of its ``shard_spec``, else
    :class:`Replicated`."""
    custom = getattr(tensor, "checkpoint_layout", None)
    if custom is not None:
        return custom
    if getattr(tensor, "expert_shard", None) is not None:  # differs across EP ranks
        raise ValueError("a tensor holding this rank's experts needs a checkpoint layout (its "
                         "module's entries, or a checkpoint_layout attribute); as a replicated "
                         "tensor only one EP rank's experts would be saved")
    spec = shard_spec(tensor)
    return SpecLayout(spec) if spec is not None else Replicated(tensor.shape)


def _whole(local: torch.Tensor) -> torch.Tensor:
    return local


@dataclass(frozen=True)
class Entry:
    """One dense tensor of the checkpoint (``key``: its name in the dense model) and where it
    lives in a local tensor: ``select(local)`` is the view holding it (the whole tensor, or one
    expert of a stacked tensor) and ``layout`` gives that view's chunks."""

    key: str
    layout: Layout
    select: Callable[[torch.Tensor], torch.Tensor] = _whole

    def chunks(self, local: torch.Tensor) -> list[Chunk]:
        return self.layout.chunks(self.select(local))


def _check_shape(local: torch.Tensor, expected, what: str) -> None:
    if tuple(local.shape) != tuple(expected):
        raise ValueError(f"{what}: expected a local tensor of shape {tuple(expected)}, got "
                         f"{tuple(local.shape)}")
