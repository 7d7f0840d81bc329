"""Gradient reduction, one owner: a bucketed reducer and its three variants (SPEC F4, F7, F8).

Every gradient collective that :func:`~ops_transformer.parallelize` and ZeRO set up runs here:

================================ ========= ================================================
variant (ledger label)           group     collective (when)
================================ ========= ================================================
:class:`GradSync`                ``dp``    all-reduce of ``grad / dp`` per bucket, started
(``dp_grads``)                   (dp × ep) as soon as the bucket's gradients are complete
:class:`GradSums`                its own   all-reduce (sum) of what this backward added, per
(``grad_sums``)                  (TP, KV   bucket, at the end of backward
                                 replicas)
:class:`ReduceScatterGradSync`   ``dp``    reduce-scatter of ``grad / dp`` per ZeRO bucket,
(``zero_grads``)                           started as soon as it is complete (ZeRO-2)
:class:`FSDPGradSync`             each      FSDP2's own reduce-scatter per unit (ZeRO-3:
(``fsdp_grads``)                 unit's    :mod:`ops_transformer.memory.fsdp`); in the
                                 dp group  chain so that :func:`no_sync` pauses it
================================ ========= ================================================

The last two live in :mod:`.grad_shard` (sharded data parallelism). All share :class:`BucketedReducer`: ``post_accumulate_grad`` hooks on their parameters, an
``enabled`` flag (what :func:`no_sync` clears: the gradients then accumulate locally, and the next
backward outside it reduces the sum) and ``finish()``, which completes the step's reduction at the
end of backward. A model's reducers sit in order in one :class:`~.state.GradReducers` chain
(``model.parallel_state.reducers``) which queues **one** end-of-backward callback
and finishes them in chain order: data-parallel averaging first, then the partial sums (both are
linear, so they commute; the sums must find gradients that the averaging will not overwrite).
ZeRO-2 swaps the chain's averaging for its reduce-scatter in place; no hook is rebuilt.

Buckets follow PyTorch DDP (Li et al. 2020): parameters in reverse registration order (roughly the
order backward produces their gradients), a new bucket at ``bucket_bytes`` or a change of dtype or
device. ``reduce_dtype`` (``parallelize``'s ``grad_reduce_dtype``) is the dtype a bucket is reduced
in: a bf16 sum over many ranks keeps 8 significant bits, so 16-bit gradients are cast up for it.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.bucketing import DEFAULT_BUCKET_BYTES, partial_grad_group


def dp_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Runs of ``params`` (in the given order) of at most ``bucket_bytes``, one dtype and device
    each: the data-parallel (and ZeRO) bucket layout."""
    buckets, current, size = [], [], 0
    for p in params:
        if current and (size + p.numel() * p.element_size() > bucket_bytes
                        or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        buckets.append(current)
    return buckets


def flat_with_presence(params, dtype: torch.dtype | None) -> torch.Tensor:
    """The gradients of ``params`` in one flat tensor (zeros for a missing one) followed by one
    presence flag per parameter (1 where this rank has its gradient), in ``dtype`` (default: the
    first parameter's). Reduced with the gradients, a flag says whether *any* rank had the
    gradient: a parameter with no gradient on every rank (frozen, unused) keeps ``grad = None`` —
    the optimizer then skips it, as ``torch.optim`` does — at the cost of one element per
    parameter in the same collective."""
    dtype = dtype or params[0].dtype
    numel = sum(p.numel() for p in params)
    flat = torch.empty(numel + len(params), dtype=dtype, device=params[0].device)
    offset = 0
    for p in params:
        if p.grad is None:
            flat[offset:offset + p.numel()].zero_()
        else:
            flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))  # (cast to the dtype)
        offset += p.numel()
    flat[numel:].copy_(torch.tensor([float(p.grad is not None) for p in params]))
    return flat


def presence(flat: torch.Tensor, count: int) -> list[bool]:
    """The reduced presence flags at the end of ``flat`` (see :func:`flat_with_presence`)."""
    return [v > 0 for v in flat[flat.numel() - count:].tolist()]


class BucketedReducer:
    """What every gradient reducer shares (module docstring): hooks, ``enabled``, and the
    end-of-backward ``finish()``, run by its chain (:class:`~.state.GradReducers`) or by a
    callback of its own when it is used alone. ``name`` says which reducer of a chain it is."""

    label = ""

    def __init__(self, name: str):
        self.name, self.enabled, self.chain = name, True, None
        self._pending = False
        self._hooks = []

    def _hook(self, params) -> None:
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        if not self._pending:
            self._pending = True
            if self.chain is not None:
                self.chain.schedule()
            else:
                torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        self.grad_ready(param)

    def grad_ready(self, param: nn.Parameter) -> None:
        """A gradient of this backward is complete (the async variants start buckets here)."""

    def finish_backward(self) -> None:
        if self._pending:
            self._pending = False
            self.finish()

    def finish(self) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _DPBucket:
    def __init__(self, params):
        self.params, self.flat, self.handle, self.ready = params, None, None, set()


class GradSync(BucketedReducer):
    """Averages the gradients of ``params`` over ``group`` during backward (label ``dp_grads``)."""

    label = "dp_grads"

    def __init__(self, params, group, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 reduce_dtype: torch.dtype | None = None, name: str = "dp"):
        super().__init__(name)
        self.group, self.world = group, C.group_size(group)
        self.reduce_dtype = reduce_dtype  # None: each bucket in its parameters' dtype
        unique = list(dict.fromkeys(p for p in params if p.requires_grad))  # tied weights once
        self.buckets = [_DPBucket(b) for b in dp_buckets(list(reversed(unique)), bucket_bytes)]
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        if self.world > 1:
            self._hook(unique)

    def grad_ready(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[param]
        bucket.ready.add(param)
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _DPBucket) -> None:
        bucket.flat = flat_with_presence(bucket.params, self.reduce_dtype).div_(self.world)
        bucket.handle = C.all_reduce(bucket.flat, self.group, async_op=True, label=self.label)

    def finish(self) -> None:
        for bucket in self.buckets:
            if bucket.handle is None:  # some parameter got no gradient in this backward
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
            present = None  # read only when this rank lacks a gradient (a host sync)
            offset = 0
            for i, p in enumerate(bucket.params):
                averaged = bucket.flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is not None:
                    p.grad.copy_(averaged)
                    continue
                if present is None:
                    present = presence(bucket.flat, len(bucket.params))
                if present[i]:  # another rank has one: the average holds it
                    p.grad = averaged.to(p.dtype, copy=True)
            bucket.flat = bucket.handle = None
            bucket.ready = set()

    def __repr__(self) -> str:
        return f"GradSync({self.name}: all-reduce/{self.world}, {len(self.buckets)} buckets)"


class _SumBucket:
    def __init__(self, group, dtype):
        self.group, self.dtype, self.params = group, dtype, []


class GradSums(BucketedReducer):
    """Sums the gradients of ``params`` — each over its own group (``params_and_groups``: pairs,
    see :func:`~ops_transformer.comm.bucketing.mark_partial_grad`) — at the end of every backward:
    one all-reduce per group and per ``bucket_bytes``, in ``dtype`` (default: the parameters').

    For a parameter ``p`` marked with group ``G``, after ``loss.backward()`` (outside
    :func:`no_sync`) ``p.grad`` is ``Σ_G`` of what this backward added to it, plus what it held
    before: accumulation over several backwards gives the dense model's accumulated gradient,
    with or without ``no_sync`` (sums are linear: summing the accumulated gradient once is exact).
    Every rank of ``G`` marks the same parameters in the same order with the same shapes."""

    label = "grad_sums"

    def __init__(self, params_and_groups, *, dtype: torch.dtype | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, name: str = "partial_sums"):
        super().__init__(name)
        self.dtype = dtype
        pairs = list(dict(params_and_groups).items())  # one entry per parameter, in order
        self.buckets = self._make_buckets(pairs, bucket_bytes)
        self._summed: dict[nn.Parameter, tuple[weakref.ref, int]] = {}  # p -> (grad, version)
        self._before: dict[nn.Parameter, torch.Tensor] = {}  # p -> summed gradient it had
        for p, _ in pairs:
            self._hooks.append(p.register_hook(self._capture_before(p)))
        self._hook([p for p, _ in pairs])

    def _make_buckets(self, pairs, bucket_bytes) -> list[_SumBucket]:
        buckets, open_bucket = [], {}  # (group, dtype) -> (bucket, bytes)
        for p, group in pairs:
            dtype = self.dtype or p.dtype
            size = p.numel() * torch.empty((), dtype=dtype).element_size()
            bucket, used = open_bucket.get((id(group), dtype), (None, 0))
            if bucket is None or (used + size > bucket_bytes and bucket.params):
                bucket, used = _SumBucket(group, dtype), 0
                buckets.append(bucket)
            bucket.params.append(p)
            open_bucket[(id(group), dtype)] = (bucket, used + size)
        return buckets

    @classmethod
    def of_module(cls, module: nn.Module, **kwargs) -> GradSums | None:
        """A ``GradSums`` over every parameter of ``module`` marked by ``mark_partial_grad``, or
        ``None`` when there is none."""
        pairs = [(p, partial_grad_group(p)) for p in dict.fromkeys(module.parameters())
                 if p.requires_grad and partial_grad_group(p) is not None]
        return cls(pairs, **kwargs) if pairs else None

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for b in self.buckets for p in b.params]

    def _capture_before(self, param: nn.Parameter):
        """Before a backward accumulates into ``param.grad``: if it still holds what the last sum
        wrote (no ``zero_grad`` since), remember it, so that only the new part is summed."""

        def hook(grad):
            last = self._summed.get(param)
            if (self.enabled and last is not None and param.grad is not None
                    and last[0]() is param.grad and param.grad._version == last[1]):
                self._before[param] = param.grad.detach().clone()
            else:  # a fresh gradient (zeroed, set to None, or accumulated under no_sync)
                self._before.pop(param, None)
            return None

        return hook

    def finish(self) -> None:
        for bucket in self.buckets:
            self._sum(bucket)
        self._before.clear()

    def _sum(self, bucket: _SumBucket) -> None:
        parts = []
        for p in bucket.params:
            if p.grad is None:
                parts.append(torch.zeros(p.numel(), dtype=bucket.dtype, device=p.device))
                continue
            before = self._before.get(p)
            new = p.grad if before is None else p.grad - before
            parts.append(new.detach().reshape(-1).to(bucket.dtype))
        flat = torch.cat(parts)
        C.all_reduce(flat, bucket.group, label=self.label)
        for p, total in zip(bucket.params, flat.split([p.numel() for p in bucket.params])):
            if p.grad is None:
                continue
            before = self._before.get(p)
            p.grad.copy_(total.view_as(p) if before is None else total.view_as(p) + before)
            self._summed[p] = (weakref.ref(p.grad), p.grad._version)

    def __repr__(self) -> str:
        return f"GradSums({self.name}: {len(self.params)} params, {len(self.buckets)} buckets)"
