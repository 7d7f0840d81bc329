"""The bridge to ``torch.distributed.checkpoint`` (DCP): a tensor as a list of dense chunks.

:class:`ChunkedTensor` implements DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``): on save each chunk becomes one write item
indexed by ``(key, offsets)`` in the dense tensor — identical chunks written by several ranks
(replicated tensors, key/value replicas) are deduplicated by DCP and stored once — and on load DCP
reads, for each chunk, the overlapping parts of whatever chunks were stored (resharding). The two
planners only teach DCP's defaults to look chunks up by their offsets, and load pickled values
with ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
import io

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .layout import Chunk, Layout


class ChunkedTensor:
    """A dense tensor of ``global_shape`` of which this rank holds ``chunks``."""

    def __init__(self, global_shape, chunks: list[Chunk], local: torch.Tensor | None = None):
        self.global_shape = torch.Size(global_shape)
        self.chunks = chunks
        self.local = local  # the tensor the chunks are views of, if any
        self._by_offset = {tuple(off): t for off, t in chunks}

    @classmethod
    def of(cls, layout: Layout, local: torch.Tensor) -> ChunkedTensor:
        """The chunks ``layout`` gives ``local`` (a parameter, a state tensor, a load buffer)."""
        return cls(layout.global_shape, layout.chunks(local), local)

    @classmethod
    def of_entry(cls, entry, local: torch.Tensor) -> ChunkedTensor:
        """The chunks of one dense tensor (an :class:`~.layout.Entry`) in ``local``."""
        return cls(entry.layout.global_shape, entry.chunks(local), local)

    def size(self) -> torch.Size:  # DCP compares it with the stored size on load
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        items = []
        for offsets, piece in self.chunks:
            offsets = torch.Size(offsets)
            items.append(WriteItem(
                index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=piece.size()),
                    properties=TensorProperties.create_from_tensor(piece),
                    size=self.global_shape)))
        return items

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size())
                for off, t in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        piece = self._by_offset[tuple(index.offset)]
        # DCP's writer saves a view's whole storage; hand it compact, contiguous data.
        return piece if piece.is_contiguous() else piece.contiguous()

    def __repr__(self) -> str:
        return f"ChunkedTensor({tuple(self.global_shape)}, {len(self.chunks)} chunks)"


ITEM_OVERHEAD, BYTES_ITEM = 2 << 10, 64 << 10  # per stored tensor (its zip records); per value


def planned_bytes(plans) -> int:
    """About the bytes a save of DCP's global ``plans`` writes: every stored chunk's data plus
    :data:`ITEM_OVERHEAD`, :data:`BYTES_ITEM` for each pickled value, the metadata."""
    total = 0
    for plan in plans:
        for item in plan.items:
            data = item.tensor_data
            if data is None:
                total += BYTES_ITEM
            else:
                numel = 1
                for n in data.chunk.sizes:
                    numel *= n
                total += numel * data.properties.dtype.itemsize + ITEM_OVERHEAD
    return total + 256 * sum(len(p.items) for p in plans)


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner on a flat state dict holding :class:`ChunkedTensor` values.

    ``check(needed_bytes)``, when given, runs on the coordinator once the global plan is known
    (deduplicated: what will be written) and may raise to stop the save before any file is
    written; every rank then finds ``needed_bytes`` in :attr:`needed_bytes`."""

    def __init__(self, check=None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.check, self.needed_bytes = check, None

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        needed = planned_bytes(plans)
        if self.check is not None:
            self.check(needed)
        return [dataclasses.replace(p, planner_data=needed) for p in plans], metadata

    def finish_plan(self, new_plan):
        self.needed_bytes = new_plan.planner_data
        return super().finish_plan(new_plan)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ChunkedTensor):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner on a flat state dict holding :class:`ChunkedTensor` values;
    pickled values are loaded with ``weights_only=True``."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default first maps meta tensors to real ones over the whole state dict, turning
        # every value of a type it does not know (ours) into None: there are no meta tensors here.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ChunkedTensor):
            return obj._by_offset[tuple(index.offset)]
        return super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # CPU first: what rank 0 wrote from cuda:0 must not land on cuda:0 of every rank (nor
        # fail on a machine without a GPU); consumers move what they need
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True,
                                                               map_location="cpu")
