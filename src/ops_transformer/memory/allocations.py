"""What a block of code allocates in tensor storage, op by op (a ``TorchDispatchMode``).

:class:`AllocationTracker` sees every operation that reaches the dispatcher. An output whose
storage is none of its inputs' is an allocation: its bytes are added to ``live`` (and to
``created``) and subtracted again when the storage is freed (a finalizer on the storage object),
so ``peak`` is the most bytes the block held at once in storage it created itself. What was not
allocated by an operation is not counted: views of memory-mapped files (safetensors' tensors are
page cache until copied), tensors that existed before the block. On a GPU,
``torch.cuda.max_memory_allocated`` says the same for the caching allocator; on a CPU, where the
allocator keeps no statistics and a memory-mapped file counts as an allocation to the profiler,
this is the measure of the private memory a load makes.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationTracker(TorchDispatchMode):
    """``with AllocationTracker(device) as t: ...`` — then ``t.peak``, ``t.created`` (bytes),
    ``t.largest`` and ``t.allocations`` (``(shape, bytes)`` in order). ``device``: count only
    storages there (a ``torch.device`` or its type, ``"cpu"``, ``"cuda"``); ``None``: every
    device but ``meta``."""

    def __init__(self, device=None):
        super().__init__()
        self.device = None if device is None else torch.device(device).type
        self.live = self.peak = self.created = self.largest = 0
        self.allocations: list[tuple[tuple[int, ...], int]] = []

    def _counts(self, t) -> bool:
        return (isinstance(t, torch.Tensor) and t.device.type != "meta"
                and (self.device is None or t.device.type == self.device))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if self._counts(t)}
        for t in tree_flatten(out)[0]:
            if not self._counts(t):
                continue
            storage = t.untyped_storage()
            size = storage.nbytes()
            if size and storage.data_ptr() not in inputs:
                inputs.add(storage.data_ptr())  # one output storage counted once
                self._allocated(storage, tuple(t.shape), size)
        return out

    def _allocated(self, storage, shape, size: int) -> None:
        self.allocations.append((shape, size))
        self.created += size
        self.largest = max(self.largest, size)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, size)

    def _freed(self, size: int) -> None:
        self.live -= size
