"""Coalescing: many small reductions of a step packed into as few collectives as possible (SPEC F4).

A collective on a few kilobytes costs its latency (α: tens of µs on NVLink, milliseconds on gloo),
not its bytes, so a step that reduced every small tensor on its own — each replicated K/V weight
of every layer, each sequence-parallel norm weight, the overflow flag, the gradient-norm partial,
the logged loss — would pay that latency dozens of times per layer. Two mechanisms pack them:

* :func:`all_reduce_coalesced` — one all-reduce for a list of tensors, flattened into one buffer.
  The training step (:func:`ops_transformer.precision.optimizer_step`) uses it for everything it
  reduces: overflow flag, gradient-norm partial and metrics, in **one** all-reduce per step.
* :class:`GradSums` — gradients a rank holds only part of, whose sum over a group is the gradient
  of a parameter replicated on that group: K/V weights replicated over ``tp / n_kv_heads`` ranks
  (each replica saw only its query heads), strategy B's replicated output projection (each rank
  saw its rows), sequence-parallel norm weights (each rank saw its part of the sequence). A layer
  marks such a parameter with :func:`mark_partial_grad`; :func:`~ops_transformer.parallelize`
  collects the marked parameters of the model into one ``GradSums``, which sums them at the end of
  each backward in one all-reduce per group (per ``bucket_bytes`` of gradients), in
  ``grad_reduce_dtype`` — instead of one all-reduce per parameter per layer.

``GradSums`` semantics, for a parameter ``p`` marked with group ``G``:

* After ``loss.backward()`` (outside :func:`~ops_transformer.no_sync`), ``p.grad`` is
  ``Σ_G`` of what this backward added to it, plus what ``p.grad`` held before: gradient
  accumulation over several backwards gives the dense model's accumulated gradient, with or
  without ``no_sync``. Inside ``no_sync`` the sums wait, like data-parallel averaging, for the
  first backward outside it (sums are linear, so summing the accumulated gradient once is exact).
* It runs after data-parallel averaging (``parallelize`` builds it after the ``GradSync``, so its
  end-of-backward callback is queued after the averaging's: both reductions are linear and
  commute, and the averaging then never overwrites a summed gradient).
* Every rank of ``G`` must mark the same parameters in the same order with the same shapes (the
  ranks of a TP group build the same layers, so they do).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from . import collectives as C
from .collectives import ProcessGroup, ReduceOp, group_size

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # as data-parallel buckets (DDP's bucket_cap_mb)


def all_reduce_coalesced(tensors: list[torch.Tensor], group: ProcessGroup | None, *,
                         op=ReduceOp.SUM, dtype: torch.dtype | None = None,
                         label: str = "coalesced") -> list[torch.Tensor]:
    """Reduce every tensor of ``tensors`` over ``group`` with **one** all-reduce.

    The tensors are flattened into one buffer of ``dtype`` (default: their common dtype, float32
    when they differ) and the results come back as new tensors of that dtype, shaped like the
    inputs. On a group of one rank nothing is communicated and the inputs are returned as they
    are (cast to ``dtype``).
    """
    if not tensors:
        return []
    if dtype is None:
        dtypes = {t.dtype for t in tensors}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    if group_size(group) == 1:
        return [t.to(dtype) for t in tensors]
    flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
    C.all_reduce(flat, group, op=op, label=label)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]),
                                                  tensors)]


def mark_partial_grad(param: nn.Parameter, group: ProcessGroup | None) -> nn.Parameter:
    """Declare that this rank's gradient of ``param`` is a partial sum whose total over ``group``
    is the parameter's gradient (``param`` is replicated on ``group``; each rank saw part of the
    data). ``parallelize`` then sums it once per backward through :class:`GradSums`; a module
    built by hand gets the same with :func:`attach_grad_sums`. A group of one needs no sum."""
    if group_size(group) > 1:
        param.partial_grad_group = group
    return param


def partial_grad_group(param: torch.Tensor) -> ProcessGroup | None:
    return getattr(param, "partial_grad_group", None)


@dataclass
class _Bucket:
    group: ProcessGroup
    dtype: torch.dtype
    params: list[nn.Parameter]


class GradSums:
    """Sums the gradients of ``params`` (each over its own group, see :func:`mark_partial_grad`)
    at the end of every backward: one all-reduce per group and per ``bucket_bytes``, in ``dtype``
    (default: the parameters' own). ``enabled = False`` (what ``no_sync`` sets) defers the sums."""

    def __init__(self, params_and_groups, *, dtype: torch.dtype | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.enabled = True
        self.dtype = dtype
        self._queued = False
        pairs = list(dict(params_and_groups).items())  # one entry per parameter, in order
        self.buckets = self._make_buckets(pairs, bucket_bytes)
        self._summed: dict[nn.Parameter, tuple[weakref.ref, int]] = {}  # p -> (grad, version)
        self._before: dict[nn.Parameter, torch.Tensor] = {}  # p -> summed gradient it had
        self._hooks = []
        for p, _ in pairs:
            self._hooks.append(p.register_hook(self._capture_before(p)))
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _make_buckets(self, pairs, bucket_bytes) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        open_bucket: dict[tuple, tuple[_Bucket, int]] = {}  # (group, dtype) -> (bucket, bytes)
        for p, group in pairs:
            dtype = self.dtype or p.dtype
            size = p.numel() * torch.empty((), dtype=dtype).element_size()
            key = (id(group), dtype)
            bucket, used = open_bucket.get(key, (None, 0))
            if bucket is None or (used + size > bucket_bytes and bucket.params):
                bucket, used = _Bucket(group, dtype, []), 0
                buckets.append(bucket)
            bucket.params.append(p)
            open_bucket[key] = (bucket, used + size)
        return buckets

    @classmethod
    def of_module(cls, module: nn.Module, **kwargs) -> GradSums | None:
        """A ``GradSums`` over every parameter of ``module`` marked by :func:`mark_partial_grad`,
        or ``None`` when there is none."""
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

    def _on_grad(self, param: nn.Parameter) -> None:
        if self.enabled and not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True

    def _finish(self) -> None:
        self._queued = False
        for bucket in self.buckets:
            self._sum(bucket)
        self._before.clear()

    def _sum(self, bucket: _Bucket) -> None:
        parts = []
        for p in bucket.params:
            if p.grad is None:
                parts.append(torch.zeros(p.numel(), dtype=bucket.dtype, device=p.device))
                continue
            before = self._before.get(p)
            new = p.grad if before is None else p.grad - before
            parts.append(new.detach().reshape(-1).to(bucket.dtype))
        flat = torch.cat(parts)
        C.all_reduce(flat, bucket.group, label="grad_sums")
        for p, total in zip(bucket.params, flat.split([p.numel() for p in bucket.params])):
            if p.grad is None:
                continue
            total = total.view_as(p)
            before = self._before.get(p)
            p.grad.copy_(total if before is None else total + before)
            self._summed[p] = (weakref.ref(p.grad), p.grad._version)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def attach_grad_sums(module: nn.Module, *, dtype: torch.dtype | None = None) -> GradSums | None:
    """Sum the marked partial gradients of a module built by hand (``parallelize`` does this for
    the models it prepares); call it after any data-parallel wrapper is attached."""
    sums = GradSums.of_module(module, dtype=dtype)
    if sums is not None:
        add_grad_reducer(module, sums)
    return sums


def add_grad_reducer(model: nn.Module, reducer) -> None:
    """Register an end-of-backward gradient reducer (anything with an ``enabled`` flag) on
    ``model`` so that :func:`~ops_transformer.no_sync` pauses it."""
    reducers = getattr(model, "_ops_transformer_grad_reducers", None)
    if reducers is None:
        reducers = []
        model._ops_transformer_grad_reducers = reducers
    reducers.append(reducer)
