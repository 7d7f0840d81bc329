"""Sequence parallelism that re-gathers in backward (Megatron-LM's sequence-parallel linear;
Korthikanti et al. 2022, §4.2.2 — the layout behind their ``34·sbh/t``).

Plain sequence parallelism (:mod:`.sequence_parallel`) all-gathers the tokens at each region entry
and the column-parallel linears inside keep the gathered ``(b, s, h)`` input for their weight
gradients. Here each rank keeps only its ``(b, s/t, h)`` share, and backward all-gathers it again::

    forward   share (b, s/t, h) ─ all-gather ─▶ x (b, s, h) ─ Q, K, V (column) ─▶ …
              kept: the share                   not kept
    backward  ∂Q, ∂K, ∂V ─ ∂x = Σ ∂Y·W ─ reduce-scatter ─▶ ∂share
                  │   (overlapped with the re-gather)
                  └── all-gather share again ─▶ x ─ ∂W = ∂Yᵀ x

================================= ================================= ================================
piece                             forward                           backward
================================= ================================= ================================
:func:`gather_sequence_regather`  all-gather (keeps the share)      reduce-scatter of ``∂x``
:class:`RegatherColumnLinear`     its collective matmul (``copy_     all-gather of the share (once
                                  matmul(input_from=)``), keeps no  per region, async, overlapped
                                  input                             with ``∂x = ∂Y·W``)
================================= ================================= ================================

Per region that is the plain layout's all-gather and reduce-scatter of ``b·s·h`` elements plus
**one** all-gather of ``b·s·h`` in backward (the linears of one region — Q, K and V, or gate and
up — share it), for ``sbh·(1 − 1/t)`` fewer values kept per region: the share instead of the
gathered input.

How the linears find the share: the gathered tensor is the output of the entry's autograd node
(:class:`_GatherKeepingShare`, after the plain entry's all-gather op), which keeps the share and the
re-gathered input. A
:class:`RegatherColumnLinear` whose input comes from somewhere else runs as a plain column layer
(it keeps its input): nothing is silently wrong, only less is saved.

That is the ``overlap="none"`` form. Under ``overlap="chunked"`` or ``"auto"`` (the default) the
region's entry is one op with its column layers — :func:`~.collective_matmul.gather_matmul` with
``regather=True`` (:class:`~.overlap_regions.ChunkedGatherSequenceRegion`): it keeps the share,
re-gathers it in backward while the input gradient is computed, and runs its all-gather and
reduce-scatter in the policy's chunks (the re-gather itself is one call).
"""

from __future__ import annotations

import functools

import torch

from ..comm import collectives as C
from .collective_matmul import copy_matmul, gather_matmul
from .linear import ColumnParallelLinear
from .sequence_parallel import SEQ_DIM, _active


def _tokens_gathered(share: torch.Tensor, group, label: str, async_op: bool = False):
    """All-gather the ``(b, s/t, h)`` share into ``(b, s, h)`` (rank-major over the tokens);
    ``(full, handle)``, the handle ``None`` unless ``async_op``."""
    tp = C.group_size(group)
    rows = share.reshape(-1, share.shape[-1])  # (b·s/t, h): a view of a contiguous share
    full = rows.new_empty((tp * rows.shape[0], rows.shape[1]))
    handle = C.all_gather_into(full, rows.contiguous(), group, async_op=async_op, label=label)
    return full.view(share.shape[0], share.shape[SEQ_DIM] * tp, *share.shape[2:]), handle


class _GatherKeepingShare(torch.autograd.Function):
    """Identity on the gathered tokens that keeps only this rank's share for the linears' weight
    gradients; the all-gather before it and the reduce-scatter of the input gradient are the
    plain sequence-parallel entry's op (:func:`~.collective_matmul.gather_matmul`, no column
    weights). Its node also holds the re-gathered input while the region's linears run their
    backward (:func:`regathered`)."""

    @staticmethod
    def forward(ctx, full, share, group):
        ctx.group, ctx.full = group, None
        ctx.save_for_backward(share)
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad):
        ctx.full = None  # the region's linears are done: free the re-gathered input
        return grad, None, None


def entry_of(x: torch.Tensor):
    """The region entry that produced ``x`` (its autograd node), or ``None``."""
    node = x.grad_fn
    return node if isinstance(node, _GatherKeepingShare._backward_cls) else None


def regathered(entry) -> tuple[torch.Tensor, object]:
    """The region's gathered input, all-gathered again from the kept share — started by the first
    linear of the region to ask (asynchronously: ``(full, handle)``, the caller waits on
    ``handle`` when it needs ``full``), shared by the others (``handle`` ``None``)."""
    if entry.full is None:
        (share,) = entry.saved_tensors
        entry.full, pending = _tokens_gathered(share, entry.group, "sequence_regather.bwd",
                                               async_op=True)
        return entry.full, pending
    return entry.full, None  # the first asker waited for it before any other could ask


def gather_sequence_regather(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region: ``(b, s/t, h)`` → ``(b, s, h)`` by an all-gather, keeping only the share
    for backward (backward: reduce-scatter; the region's :class:`RegatherColumnLinear` layers
    all-gather the share again)."""
    if not _active(group):
        return x
    full, _ = gather_matmul(x.reshape(-1, x.shape[-1]), [], [], group, 1,
                            ("sequence_region.fwd", "sequence_region.bwd"))
    full = full.view(x.shape[0], x.shape[SEQ_DIM] * C.group_size(group), *x.shape[2:])
    return _GatherKeepingShare.apply(full, x, group)


def linear_regathering_input(x: torch.Tensor, weight, bias, entry) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for an ``x`` made by the region entry ``entry``
    (:func:`entry_of`), keeping nothing of ``x`` for backward: the column layer's collective matmul
    (:func:`~.collective_matmul.copy_matmul`) with ``input_from`` the region's re-gather
    (overlapped with ``∂x = ∂Y·W``) and no all-reduce (the entry reduce-scatters ``∂x``)."""
    _, (y,) = copy_matmul(x.reshape(-1, x.shape[-1]), [weight], [bias], None, 1,
                          input_from=functools.partial(regathered, entry))
    return y.view(*x.shape[:-1], y.shape[-1])


class RegatherColumnLinear(ColumnParallelLinear):
    """A :class:`ColumnParallelLinear` inside a re-gathering sequence-parallel region: its input,
    made by :func:`gather_sequence_regather`, is not kept for backward; the weight gradient uses
    the region's re-gathered input. No input-gradient all-reduce (the entry reduce-scatters it).
    Outside such a region (another input, no autograd, one rank) it is the plain layer. Under
    ``overlap="chunked"`` / ``"auto"`` the region's entry computes these layers itself
    (:func:`~.collective_matmul.gather_matmul` with ``regather=True``, the layers fed): this
    class is the ``overlap="none"`` form."""

    @classmethod
    def from_column(cls, layer: ColumnParallelLinear) -> RegatherColumnLinear:
        """``layer`` (a plain column-parallel layer of a sequence-parallel region, with its
        parameters and their shard metadata) as a re-gathering one."""
        if type(layer) is not ColumnParallelLinear or layer.gather_output \
                or layer.reduce_input_grad:
            raise ValueError(f"a re-gathering column layer replaces a ColumnParallelLinear of a "
                             f"sequence-parallel region (reduce_input_grad=False, no gathered "
                             f"output); got {layer!r}")
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)  # the same parameters, buffers and hooks
        return new

    def local_output(self, x: torch.Tensor, weight, bias) -> torch.Tensor:
        entry = entry_of(x) if self.tp_size > 1 else None
        if entry is None or not torch.is_grad_enabled():
            return super().local_output(x, weight, bias)
        return linear_regathering_input(x, weight, bias, entry)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", sequence_parallel='regather'"
