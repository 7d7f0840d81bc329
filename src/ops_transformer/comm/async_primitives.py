"""An all-to-all that overlaps computation in forward and in backward: a *start* and a *wait*.

:func:`all_to_all_start` issues the all-to-all and returns its (still arriving) output with a
:class:`Pending` handle; :func:`all_to_all_wait` waits for it, where the output is first needed.
Whatever runs between the two overlaps the transfer. Both are autograd functions, and backward
mirrors forward::

    ============================= =================================== ===========================
    function                      forward                             backward
    ============================= =================================== ===========================
    ``all_to_all_start``          start the all-to-all                wait for the reverse one
    ``all_to_all_wait``           wait for it                         start the reverse all-to-all
                                                                      (splits swapped)
    ============================= =================================== ===========================

Autograd runs a graph's nodes latest-created first, so the reverse all-to-all a wait's backward
starts moves while the gradients of whatever ran between start and wait are computed, and the
start's backward waits for it only when its gradient is needed. The output of a start must be
used by its wait alone (the wait's backward hands the start's backward a tensor it does not
read; the reverse transfer's buffer comes through the shared :class:`Pending`). On a
group of one rank both are the identity, as :func:`~.primitives.all_to_all` is.
"""

from __future__ import annotations

import torch

from . import collectives as C
from .collectives import group_size


class Pending:
    """One all-to-all in flight (forward) and its reverse (backward): the work handles and the
    buffer the reverse one fills."""

    __slots__ = ("group", "output_splits", "input_splits", "work", "reverse_work", "reverse")

    def __init__(self, group, output_splits, input_splits):
        self.group, self.output_splits, self.input_splits = group, output_splits, input_splits
        self.work = self.reverse_work = self.reverse = None


def _start(x: torch.Tensor, group, output_splits, input_splits, label: str):
    x = x.contiguous()
    rows = x.shape[0] if output_splits is None else sum(output_splits)
    out = x.new_empty((rows, *x.shape[1:]))
    work = C.all_to_all_into(out, x, group, output_split_sizes=output_splits,
                             input_split_sizes=input_splits, async_op=True, label=label)
    return out, work, x


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending):
        out, pending.work, _ = _start(x, pending.group, pending.output_splits,
                                      pending.input_splits, "all_to_all.fwd")
        ctx.pending = pending
        return out

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending
        pending.reverse_work.wait()
        reverse, pending.reverse = pending.reverse, None
        pending.reverse_work = None
        return reverse, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, pending):
        pending.work.wait()
        pending.work = None
        ctx.pending = pending
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending
        # the reverse transfer, splits swapped; the start's backward waits for it and returns its
        # buffer (what is handed to it here it ignores: the transfer is still reading ``grad``)
        pending.reverse, pending.reverse_work, sent = _start(
            grad, pending.group, pending.input_splits, pending.output_splits, "all_to_all.bwd")
        return sent, None


def all_to_all_start(x: torch.Tensor, group, *, output_splits: list[int] | None = None,
                     input_splits: list[int] | None = None) -> tuple[torch.Tensor, Pending | None]:
    """Start an all-to-all along dim 0 (splits as in :func:`~.primitives.all_to_all`): returns
    its output, valid only after :func:`all_to_all_wait`, and the handle to pass there."""
    if group_size(group) == 1:
        return x, None
    pending = Pending(group, output_splits, input_splits)
    return _Start.apply(x, pending), pending


def all_to_all_wait(out: torch.Tensor, pending: Pending | None) -> torch.Tensor:
    """Wait for the all-to-all :func:`all_to_all_start` began; returns its output."""
    return out if pending is None else _Wait.apply(out, pending)
