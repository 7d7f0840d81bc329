"""Coalescing: many small reductions of a step packed into as few collectives as possible (SPEC F4).

A collective on a few kilobytes costs its latency (α: tens of µs on NVLink, milliseconds on gloo),
not its bytes, so a step that reduced every small tensor on its own — each replicated K/V weight
of every layer, each sequence-parallel norm weight, the overflow flag, the gradient-norm partial,
the logged loss — would pay that latency dozens of times per layer. Two mechanisms pack them:

* :func:`all_reduce_coalesced` — one all-reduce for a list of tensors, flattened into one buffer.
  The training step (:func:`ops_transformer.precision.optimizer_step`) uses it for everything it
  reduces: overflow flag, gradient-norm partial and metrics, in **one** all-reduce per step.
* :func:`mark_partial_grad` — declares a gradient a rank holds only part of, whose sum over a
  group is the gradient of a parameter replicated on that group: K/V weights replicated over
  ``tp / n_kv_heads`` ranks (each replica saw only its query heads), strategy B's replicated output
  projection (each rank saw its rows), sequence-parallel norm weights (each rank saw its part of the
  sequence). :func:`~ops_transformer.parallelize` collects the marked parameters into one
  :class:`~ops_transformer.parallel.grad_reduce.GradSums`, which sums them at the end of each
  backward in one all-reduce per group (per ``bucket_bytes`` of gradients), in
  ``grad_reduce_dtype`` — instead of one all-reduce per parameter per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from . import collectives as C
from .collectives import ProcessGroup, ReduceOp, group_size

from ..schema.choices import DEFAULT_BUCKET_BYTES


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
    data). ``parallelize`` then sums it once per backward through
    :class:`~ops_transformer.parallel.grad_reduce.GradSums`; a module built by hand gets the same
    with :func:`~ops_transformer.parallel.state.attach_grad_sums`. A group of one needs no sum."""
    if group_size(group) > 1:
        param.partial_grad_group = group
    return param


def partial_grad_group(param: torch.Tensor) -> ProcessGroup | None:
    return getattr(param, "partial_grad_group", None)
