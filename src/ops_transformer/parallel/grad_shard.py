"""The gradient reducers of sharded data parallelism: ZeRO-2's reduce-scatter and FSDP2's.

Two variants of :class:`~.grad_reduce.BucketedReducer` (see the table in :mod:`.grad_reduce`):
:class:`ReduceScatterGradSync` reduce-scatters each ZeRO bucket over its data-parallel group
(:mod:`ops_transformer.memory.zero`, stage 2), :class:`FSDPGradSync` stands in the model's chain for
the reduce-scatters FSDP2 runs itself (:mod:`ops_transformer.memory.fsdp`, ZeRO-3), so that
:func:`~.state.no_sync` pauses them like every other reducer.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import collectives as C
from .grad_reduce import BucketedReducer


class ReduceScatterGradSync(BucketedReducer):
    """ZeRO stage 2 (:class:`~ops_transformer.memory.zero.ZeroOptimizer`): reduce-scatters each
    complete bucket's ``grad / n`` over the bucket's own data-parallel group (``bucket.group``, of
    ``n`` ranks) in ``reduce_dtype`` (default: the parameters'), frees the full gradients at once,
    and at the end of backward adds this rank's chunk into the bucket's ``grad_shard``.
    ``buckets``: the optimizer's padded ZeRO buckets (those with ``reduce_scattered``).

    Each rank's part of the input is its chunk followed by one presence flag per parameter of the
    bucket (as in :func:`~.grad_reduce.flat_with_presence`), so that ``grad_shard`` ends with the reduced flags: a
    parameter without a gradient on every rank is then skipped by the optimizer."""

    label = "zero_grads"

    def __init__(self, buckets, *, reduce_dtype: torch.dtype | None = None, name: str = "dp"):
        super().__init__(name)
        self.reduce_dtype = reduce_dtype
        self.buckets = [b for b in buckets if b.reduce_scattered]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._ready: dict[int, set[int]] = {id(b): set() for b in self.buckets}
        self._started: dict[int, tuple] = {}
        self.unclaimed: str | None = None  # why a backward is refused until an optimizer claims
        self._hook([p for b in self.buckets for p in b.params])

    def grad_ready(self, param: nn.Parameter) -> None:
        if self.unclaimed is not None:  # the gradients would vanish into buckets nobody steps
            raise RuntimeError(self.unclaimed)
        bucket = self._bucket_of[id(param)]
        ready = self._ready[id(bucket)]
        ready.add(id(param))
        if len(ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket) -> None:
        world, k, width = C.group_size(bucket.group), len(bucket.params), bucket.chunk
        dtype = self.reduce_dtype or bucket.flat.dtype
        # rank r's part of the input: [chunk r of the bucket | the k presence flags]
        blocks = torch.zeros(world, width + k, dtype=dtype, device=bucket.flat.device)
        for p, off in zip(bucket.params, bucket.offsets):
            if p.grad is not None:
                grad, at = p.grad.reshape(-1), off
                while at < off + p.numel():  # the runs of the parameter in each chunk
                    row, col = divmod(at, width)
                    n = min(width - col, off + p.numel() - at)
                    blocks[row, col:col + n].copy_(grad[at - off:at - off + n])  # (cast)
                    at += n
        blocks[:, width:] = torch.tensor([float(p.grad is not None) for p in bucket.params],
                                         dtype=dtype, device=blocks.device)
        for p in bucket.params:
            p.grad = None  # the full gradient is not kept: this rank gets its chunk below
        blocks = blocks.view(-1).div_(world)
        chunk = torch.empty(width + k, dtype=dtype, device=blocks.device)
        handle = C.reduce_scatter_into(chunk, blocks, bucket.group, async_op=True,
                                       label=self.label)
        self._started[id(bucket)] = (blocks, chunk, handle)  # (blocks alive until the wait)

    def finish(self) -> None:
        for bucket in self.buckets:
            if id(bucket) not in self._started:  # some parameter got no gradient this backward
                self._launch(bucket)
        for bucket in self.buckets:
            _, chunk, handle = self._started.pop(id(bucket))
            if handle is not None:
                with torch.profiler.record_function("ops_transformer::wait"):
                    handle.wait()
            shard = bucket.grad_shard
            bucket.grad_shard = chunk if shard is None else shard.add_(chunk)
            self._ready[id(bucket)] = set()

    def __repr__(self) -> str:
        sizes = sorted({C.group_size(b.group) for b in self.buckets})
        return (f"ReduceScatterGradSync({self.name}: reduce-scatter/"
                f"{'|'.join(map(str, sizes)) or 1}, {len(self.buckets)} buckets)")


class FSDPGradSync(BucketedReducer):
    """The reduce-scatters FSDP2 runs for the parameters it shards (ZeRO-3,
    :func:`~ops_transformer.memory.fsdp.shard_parameters`), as a member of the model's chain: FSDP2
    hooks, buckets and finishes them itself (its collectives go through
    :mod:`ops_transformer.comm.fsdp_comm`, label ``fsdp_grads``); ``enabled`` is its
    ``set_requires_gradient_sync`` — what :func:`no_sync` clears: the units then accumulate their
    unsharded gradients locally, and the next backward outside it reduce-scatters the sum.
    ``root``: the outermost FSDP module; ``units``: every FSDP module."""

    label = "fsdp_grads"

    def __init__(self, root: nn.Module, units, *, name: str = "fsdp"):
        self.root, self.units = root, tuple(units)
        super().__init__(name)

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)
        for unit in self.units:  # (recurse=False: each unit once)
            unit.set_requires_gradient_sync(self._enabled, recurse=False)

    def finish(self) -> None:
        """Nothing: FSDP2 waits for its reduce-scatters in its own end-of-backward callback."""

    def __repr__(self) -> str:
        return f"FSDPGradSync({self.name}: reduce-scatter per unit, {len(self.units)} units)"
