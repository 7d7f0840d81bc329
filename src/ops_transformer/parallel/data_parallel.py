"""Data-parallel gradient averaging: bucketed, started during backward, finished at its end.

Like PyTorch DDP (Li et al. 2020), parameters are grouped into buckets in reverse registration order
(roughly the order backward produces their gradients). When every gradient of a bucket has been
accumulated, the bucket is flattened, pre-divided by the number of data-parallel ranks and
all-reduced asynchronously over the ``dp`` group while backward goes on; a callback queued on the
autograd engine waits for the buckets and copies the averages back at the end of backward. The
collectives go through the communication ledger like every other.

Each backward averages the gradients it accumulated. For gradient accumulation over micro-batches,
run all but the last backward inside :func:`no_sync`.

``reduce_dtype`` is the dtype the buckets are averaged in (``parallelize``'s ``grad_reduce_dtype``:
float32 by default when the parameters are 16-bit): a bf16 sum of many ranks' gradients keeps 8
significant bits, so the gradients are cast up for the all-reduce and back when copied out.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import collectives as C

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    pending: int = 0
    flat: torch.Tensor | None = None
    handle: object | None = None
    ready: set = field(default_factory=set)


class GradSync:
    """Averages the gradients of ``params`` over ``group`` during backward."""

    def __init__(self, params, group, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 reduce_dtype: torch.dtype | None = None):
        self.group, self.world = group, C.group_size(group)
        self.reduce_dtype = reduce_dtype  # None: each bucket in its parameters' dtype
        self.enabled = True
        self._queued = False
        unique = list(dict.fromkeys(p for p in params if p.requires_grad))  # tied weights once
        self.buckets = self._make_buckets(list(reversed(unique)), bucket_bytes)
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in unique]

    @staticmethod
    def _make_buckets(params, bucket_bytes) -> list[_Bucket]:
        buckets, current, size = [], [], 0
        for p in params:
            if current and (size + p.numel() * p.element_size() > bucket_bytes
                            or p.dtype != current[0].dtype or p.device != current[0].device):
                buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            buckets.append(_Bucket(current))
        return buckets

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.enabled or self.world == 1:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        bucket = self._bucket_of[param]
        bucket.ready.add(param)
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        bucket.flat = flat.to(self.reduce_dtype or flat.dtype).div_(self.world)
        bucket.handle = C.all_reduce(bucket.flat, self.group, async_op=True, label="dp_grads")

    def _finish(self) -> None:
        for bucket in self.buckets:
            if bucket.handle is None:  # some parameter got no gradient in this backward
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
            offset = 0
            for p in bucket.params:
                n = p.numel()
                averaged = bucket.flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = averaged.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(averaged)
                offset += n
            bucket.flat = bucket.handle = None
            bucket.ready = set()
        self._queued = False

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def grad_sync_of(model: nn.Module) -> GradSync | None:
    return getattr(model, "_ops_transformer_grad_sync", None)


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Accumulate gradients locally inside this context: no data-parallel averaging, and no
    end-of-backward sums of partial gradients (:class:`~ops_transformer.comm.bucketing.GradSums`);
    the first backward outside it reduces everything accumulated."""
    syncs = [s for s in (grad_sync_of(model),
                         getattr(model, "_ops_transformer_expert_grad_sync", None),
                         *getattr(model, "_ops_transformer_grad_reducers", ())) if s is not None]
    previous = [s.enabled for s in syncs]
    for sync in syncs:
        sync.enabled = False
    try:
        yield
    finally:
        for sync, enabled in zip(syncs, previous):
            sync.enabled = enabled
