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
    """Reduce-scatters the gradients of the stage-2 buckets over ``group`` during backward."""

    def __init__(self, buckets, group):
        self.group, self.world = group, C.group_size(group)
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
        flat = torch.zeros(bucket.padded, dtype=bucket.flat.dtype, device=bucket.flat.device)
        for p, off in zip(bucket.params, bucket.offsets):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
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
