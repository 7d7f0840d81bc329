"""Recorded collectives: the only place in the package that calls ``torch.distributed`` collectives.

Each function takes an explicit process group, does nothing on a group of one rank, reports the call
to the :mod:`communication ledger <ops_transformer.comm.ledger>` and, while ``torch.profiler`` is
recording, wraps it in a ``record_function("ops_transformer::<kind>")`` range so the time is
attributable; the handle of an async call then times its ``wait()`` as
``ops_transformer::wait:<kind>`` (:mod:`ops_transformer.profiler` reads both). The autograd-aware
pairs built on them live in :mod:`.primitives`.

Compatibility: torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour
of ``all_gather_single`` / ``reduce_scatter_single``; older releases (>= 2.4) only have the former.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.autograd import _profiler_enabled

from . import ledger as _ledger

ProcessGroup = dist.ProcessGroup
ReduceOp = dist.ReduceOp

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group``; ``None`` stands for a group of one (no communication)."""
    return 1 if group is None else group.size()


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else group.rank()


def _ranks(group: ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


class _ProfiledWork:
    """An async work handle whose ``wait()`` is a ``record_function`` range named
    ``ops_transformer::wait:<kind>``: a wait leaves no profiler event of its own, and it is where
    communication is exposed."""

    def __init__(self, work, kind: str):
        self._work, self._kind = work, kind

    def wait(self, *args, **kwargs):
        with torch.profiler.record_function(f"ops_transformer::wait:{self._kind}"):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _handle(work, kind: str):
    """``work`` (``None`` for a synchronous call), made visible to the profiler when it records."""
    return _ProfiledWork(work, kind) if work is not None and _profiler_enabled() else work


def _recorded(kind: str, tensor: torch.Tensor, elements: int, group: ProcessGroup, label: str):
    if _ledger.ledger_active():
        _ledger.record(kind, tensor, elements, _ranks(group), label)
    if _profiler_enabled():
        return torch.profiler.record_function(f"ops_transformer::{kind}")
    return contextlib.nullcontext()


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, *, op=ReduceOp.SUM,
               async_op: bool = False, label: str = ""):
    """In-place all-reduce of ``tensor``. Returns a work handle when ``async_op``."""
    if group_size(group) == 1:
        return None
    with _recorded("all_reduce", tensor, tensor.numel(), group, label):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        return _handle(work, "all_reduce")


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, *,
                    async_op: bool = False, label: str = ""):
    """Gather equal-sized ``input`` shards into ``output`` (rank-major along dim 0)."""
    if group_size(group) == 1:
        output.copy_(input.reshape(output.shape))
        return None
    with _recorded("all_gather", output, output.numel(), group, label):
        work = _all_gather_single(output, input, group=group, async_op=async_op)
        return _handle(work, "all_gather")


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, *,
                        op=ReduceOp.SUM, async_op: bool = False, label: str = ""):
    """Reduce ``input`` over the group and keep this rank's (dim-0, rank-major) part in ``output``."""
    if group_size(group) == 1:
        output.copy_(input.reshape(output.shape))
        return None
    with _recorded("reduce_scatter", input, input.numel(), group, label):
        work = _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
        return _handle(work, "reduce_scatter")


def all_to_all_into(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, *,
                    output_split_sizes: list[int] | None = None,
                    input_split_sizes: list[int] | None = None,
                    async_op: bool = False, label: str = ""):
    """All-to-all along dim 0, even (``None`` splits) or uneven."""
    if group_size(group) == 1:
        output.copy_(input)
        return None
    with _recorded("all_to_all", input, input.numel(), group, label):
        return _handle(dist.all_to_all_single(output, input, output_split_sizes,
                                              input_split_sizes, group=group, async_op=async_op),
                       "all_to_all")


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None, *,
              async_op: bool = False, label: str = ""):
    """In-place broadcast from global rank ``src``."""
    if group_size(group) == 1:
        return None
    with _recorded("broadcast", tensor, tensor.numel(), group, label):
        return _handle(dist.broadcast(tensor, src=src, group=group, async_op=async_op), "broadcast")


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None, *, label: str = ""):
    """Point-to-point send to global rank ``dst``; returns a work handle (``isend``)."""
    with _recorded("send", tensor, tensor.numel(), group, label):
        return _handle(dist.isend(tensor, dst=dst, group=group), "send")


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None, *, label: str = ""):
    """Point-to-point receive from global rank ``src``; returns a work handle (``irecv``)."""
    with _recorded("recv", tensor, tensor.numel(), group, label):
        return _handle(dist.irecv(tensor, src=src, group=group), "recv")


def barrier(group: ProcessGroup | None) -> None:
    """Synchronise the group (not recorded: it moves no tensor)."""
    if group_size(group) > 1:
        dist.barrier(group=group)
