"""ZeRO stage 2's gradient reduction: a reduce-scatter per bucket in place of the all-reduce.

The counterpart of :class:`~ops_transformer.parallel.data_parallel.GradSync` for
:class:`~ops_transformer.memory.zero.ZeroOptimizer` at stage 2. When every parameter of a bucket has
its gradient (``post_accumulate_grad`` hooks, as in DDP), the bucket's gradients are flattened into
the bucket's padded layout, pre-divided by ``dp`` and reduce-scattered asynchronously over the
``dp`` group — each rank receives only its chunk of the average — and the parameters' full
gradients are freed right away. At the end of backward the chunks are waited for and accumulated
into the bucket's ``grad_shard``. Inside :func:`~ops_transformer.no_sync` nothing is reduced and
the gradients accumulate as usual; the next synchronised backward reduces their sum.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import collectives as C


class ReduceScatterGradSync:
    """Reduce-scatters the gradients of the stage-2 buckets over ``group`` during backward, in
    ``reduce_dtype`` (default: the parameters')."""

    def __init__(self, buckets, group, *, reduce_dtype: torch.dtype | None = None):
        self.group, self.world = group, C.group_size(group)
        self.reduce_dtype = reduce_dtype
        self.enabled = True
        self.buckets = [b for b in buckets if b.reduce_scattered]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._ready: dict[int, set[int]] = {id(b): set() for b in self.buckets}
        self._pending: dict[int, tuple] = {}
        self._queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for b in self.buckets for p in b.params]

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        bucket = self._bucket_of[id(param)]
        ready = self._ready[id(bucket)]
        ready.add(id(param))
        if len(ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket) -> None:
        dtype = self.reduce_dtype or bucket.flat.dtype
        flat = torch.zeros(bucket.padded, dtype=dtype, device=bucket.flat.device)
        for p, off in zip(bucket.params, bucket.offsets):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))  # (cast to dtype)
            p.grad = None  # the full gradient is not kept: this rank gets its chunk below
        flat.div_(self.world)
        chunk = torch.empty(bucket.chunk, dtype=flat.dtype, device=flat.device)
        handle = C.reduce_scatter_into(chunk, flat, self.group, async_op=True, label="zero_grads")
        self._pending[id(bucket)] = (flat, chunk, handle)

    def _finish(self) -> None:
        for bucket in self.buckets:
            if id(bucket) not in self._pending:  # some parameter got no gradient this backward
                self._launch(bucket)
        for bucket in self.buckets:
            _, chunk, handle = self._pending.pop(id(bucket))
            if handle is not None:
                with torch.profiler.record_function("ops_transformer::wait"):
                    handle.wait()
            bucket.grad_shard = chunk if bucket.grad_shard is None else bucket.grad_shard.add_(chunk)
            self._ready[id(bucket)] = set()
        self._queued = False

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def install_reduce_scatter(model: nn.Module, buckets, group, bucket_bytes: int) -> None:
    """Replace ``model``'s data-parallel averaging by stage 2's reduction: reduce-scatter for the
    plain buckets, the usual all-reduce for the partial-gradient buckets (whose TP sums run at the
    end of backward and must find their gradients), and rebuild the model's
    :class:`~ops_transformer.comm.bucketing.GradSums` after both, so that its sums run last."""
    from ..comm.bucketing import GradSums
    from ..parallel.data_parallel import GradSync, grad_sync_of

    old = grad_sync_of(model)
    reduce_dtype = getattr(old, "reduce_dtype", None)
    if old is not None:
        old.remove()
    model._ops_transformer_grad_sync = ReduceScatterGradSync(buckets, group,
                                                             reduce_dtype=reduce_dtype)
    reducers = getattr(model, "_ops_transformer_grad_reducers", [])
    sums = [r for r in reducers if isinstance(r, GradSums)]
    for r in sums:
        r.remove()
        reducers.remove(r)
    partial = [p for b in buckets if not b.reduce_scattered for p in b.params]
    if partial and C.group_size(group) > 1:
        reducers.append(GradSync(reversed(partial), group, bucket_bytes=bucket_bytes,
                                 reduce_dtype=reduce_dtype))
    for r in sums:
        reducers.append(GradSums(list(zip(r.params, (b.group for b in r.buckets
                                                     for _ in b.params))),
                                 dtype=r.dtype, bucket_bytes=bucket_bytes))
    model._ops_transformer_grad_reducers = reducers
