"""Measured activation memory: the bytes autograd keeps for backward, per Transformer layer.

:func:`activation_memory` runs one forward pass under :func:`torch.autograd.graph.saved_tensors_hooks`
and records every tensor saved for backward. It counts **storages**, not tensors: views of one
storage (chunks of a fused projection, a transposed view) and repeated saves of one tensor are
counted once, at the size of the whole storage (what stays alive). Parameters and buffers are
excluded (they live anyway; so are the parameters FSDP2 gathers for the forward of a ZeRO-3
model). The recorded storages are held until the measurement ends, so no
address can be freed and reused by another tensor in between — which is why a storage's address is
a safe key here, and only here.

Tensors kept by activation checkpointing (a layer's inputs) are saved through the same hooks and
counted. The int8 cache (:class:`~ops_transformer.memory.Int8ActivationCache`) installs its own,
inner hooks; it reports what it keeps (codes and scales, or the tensor as is) to every open meter.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from ..models.hf import is_hf, transformer_layers
from ..parallel.sharding import local_tensor

_open_meters: list[ActivationMeter] = []
_lock = threading.Lock()


def notify_saved(*tensors: torch.Tensor) -> None:
    """Report tensors kept for backward by an inner saved-tensor hook to every open meter."""
    if _open_meters:
        for meter in list(_open_meters):
            meter.add(*tensors)


class ActivationMeter:
    """Records the storages saved for backward while open (a context manager); ``layer`` is the
    index the next saves are attributed to (``None``: outside the Transformer layers)."""

    def __init__(self, exclude=()):
        self._excluded = {local_tensor(t).untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, tuple[torch.UntypedStorage | None, int, int | None]] = {}
        self.layer: int | None = None
        self._hooks = None

    def add(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
                continue  # a parameter FSDP2 gathered for this forward (ZeRO-3), or a view of it
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in self._excluded or key in self._storages:
                continue
            self._storages[key] = (storage, storage.nbytes(), self.layer)  # held: key stays valid

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @property
    def total_bytes(self) -> int:
        return sum(nbytes for _, nbytes, _ in self._storages.values())

    def per_layer(self, n_layers: int) -> list[int]:
        out = [0] * n_layers
        for _, nbytes, layer in self._storages.values():
            if layer is not None:
                out[layer] += nbytes
        return out

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        with _lock:
            _open_meters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _open_meters.remove(self)
        self._hooks.__exit__(*exc)
        self._hooks = None

    def release(self) -> None:
        """Drop the references to the recorded storages (the totals stay)."""
        self._storages = {k: (None, n, layer) for k, (_, n, layer) in self._storages.items()}


def _attribute(meter: ActivationMeter, layers: list[nn.Module]) -> list:
    handles = []
    for index, layer in enumerate(layers):
        def enter(module, args, index=index):
            meter.layer = index

        def leave(module, args, output):
            meter.layer = None

        handles.append(layer.register_forward_pre_hook(enter))
        handles.append(layer.register_forward_hook(leave))
    return handles


def run_forward(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor | None = None):
    """``model(idx, targets)`` for the reference GPT; ``input_ids=`` / ``labels=`` for Hugging
    Face models."""
    if is_hf(model):
        return model(input_ids=idx, labels=targets) if targets is not None else model(input_ids=idx)
    return model(idx, targets)


def activation_memory(model: nn.Module, idx: torch.Tensor,
                      targets: torch.Tensor | None = None) -> dict:
    """Run one forward pass and return the bytes it keeps for backward::

        {"total_bytes": int,        # every storage saved; parameters and buffers excluded
         "per_layer": [int, ...]}   # the part saved inside each Transformer layer

    What the techniques in use keep is what counts: checkpointed layer inputs under recompute, int8
    codes and scales under the 8-bit cache, each rank's sequence slice under sequence parallelism.
    A storage saved by several layers counts in the first. On a parallel model this is a collective
    call (the forward communicates): every rank must make it; each gets its own bytes.

    On a CUDA device the allocator's view is added, which also holds workspaces, communication
    buffers, transients and rounding::

         "cuda_max_memory_allocated": int,  # torch.cuda.max_memory_allocated during the forward
         "cuda_forward_peak_bytes": int}    # that peak less what was allocated before it
    """
    layers = transformer_layers(model)
    meter = ActivationMeter(exclude=list(model.parameters()) + list(model.buffers()))
    handles = _attribute(meter, layers)
    cuda = idx.device if idx.device.type == "cuda" else None
    if cuda is not None:
        torch.cuda.synchronize(cuda)
        torch.cuda.reset_peak_memory_stats(cuda)
        before = torch.cuda.memory_allocated(cuda)
    try:
        with torch.enable_grad(), meter:
            out = run_forward(model, idx, targets)
        result = {"total_bytes": meter.total_bytes, "per_layer": meter.per_layer(len(layers))}
        if cuda is not None:
            peak = torch.cuda.max_memory_allocated(cuda)
            result.update(cuda_max_memory_allocated=peak, cuda_forward_peak_bytes=peak - before)
        del out
    finally:
        for h in handles:
            h.remove()
        meter.release()
    return result
