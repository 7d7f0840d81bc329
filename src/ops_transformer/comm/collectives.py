"""Recorded collectives: the only place in the package that calls ``torch.distributed`` collectives.

Each function takes an explicit process group, does nothing on a group of one rank, reports the call
to the :mod:`communication ledger <ops_transformer.comm.ledger>` and, while ``torch.profiler`` is
recording, wraps it in a ``record_function("ops_transformer::<kind>")`` range so the time is
attributable; the handle of an async call then times its ``wait()`` as
``ops_transformer::wait:<kind>`` (:mod:`ops_transformer.profiler` reads both). The autograd-aware
pairs built on them live in :mod:`.primitives`.

``all_reduce``, ``all_gather_into`` and ``reduce_scatter_into`` run with the algorithm the
communication engine (:mod:`.engine`) chose for their group and message — flat, hierarchical across
nodes or point-to-point in a group of two (:mod:`.algorithms`, built on the ``run_*`` calls below);
the result is the flat collective's. An ``async_op`` handle of a multi-step algorithm finishes its
remaining steps in ``wait()``.

Compatibility: torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour
of ``all_gather_single`` / ``reduce_scatter_single``; older releases (>= 2.4) only have the former.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.autograd import _profiler_enabled

from . import algorithms as _A
from . import engine as _engine
from . import ledger as _ledger

ProcessGroup = dist.ProcessGroup
ReduceOp = dist.ReduceOp

_NO_RANGE = contextlib.nullcontext()  # reusable: no profiler range when the profiler is off
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


class _Completed:
    """The handle of an ``async_op`` call inside a compiled graph: the graph ran it synchronously
    (Dynamo cannot trace an async collective; the compiler schedules the graph's collectives), so
    ``wait()`` has nothing to wait for."""

    def wait(self, *args, **kwargs):
        return True


def _async(async_op: bool) -> bool:
    """Whether to issue the call asynchronously: never while ``torch.compile`` traces."""
    return async_op and not torch.compiler.is_compiling()


def _handle(work, kind: str):
    """``work`` (``None`` for a synchronous call), made visible to the profiler when it records."""
    if torch.compiler.is_compiling():
        return _Completed() if work is None else work
    return _ProfiledWork(work, kind) if work is not None and _profiler_enabled() else work


def _recorded(kind: str, tensor: torch.Tensor, elements: int, group: ProcessGroup, label: str,
              *, algorithm: str = "flat", level: str | None = None, steps=()):
    if torch.compiler.is_compiling():  # recorded by the graph on every call, not at trace time
        _ledger.record_compiled(kind, tensor, elements, _compiled_ranks(group), label, "")
        return _NO_RANGE
    if _ledger.ledger_active():
        if level is None:
            found = _engine.lookup(group)
            level = found.level if found is not None else ""
        _ledger.record(kind, tensor, elements, _ranks(group), label, algorithm=algorithm,
                       level=level, steps=steps)
    if _profiler_enabled():
        return torch.profiler.record_function(f"ops_transformer::{kind}")
    return _NO_RANGE


def _compiled_ranks(group: ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _algorithm(group: ProcessGroup, kind: str, tensor: torch.Tensor, elements: int, op):
    """``(name, GroupAlgorithms)`` the engine runs this collective with; ``("flat", …)`` for a
    group it does not know, for empty tensors and for reductions other than sum / max / min."""
    if torch.compiler.is_compiling():  # a traced graph runs its collectives flat
        return "flat", None
    found = _engine.lookup(group)
    if found is None or elements == 0 or op not in _A.REDUCE_OPS:
        return "flat", found
    return found.choose(kind, elements, tensor.dtype), found


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, *, op=ReduceOp.SUM,
               async_op: bool = False, label: str = ""):
    """In-place all-reduce of ``tensor``. Returns a work handle when ``async_op``."""
    if group_size(group) == 1:
        return None
    algorithm, found = _algorithm(group, "all_reduce", tensor, tensor.numel(), op)
    if algorithm != "flat":
        pending = _A.run(algorithm, "all_reduce", found, tensor, None, op, async_op, label)
        return _handle(pending, "all_reduce")
    with _recorded("all_reduce", tensor, tensor.numel(), group, label):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=_async(async_op))
        return _handle(work, "all_reduce")


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, *,
                    async_op: bool = False, label: str = ""):
    """Gather equal-sized ``input`` shards into ``output`` (rank-major along dim 0)."""
    if group_size(group) == 1:
        output.copy_(input.reshape(output.shape))
        return None
    algorithm, found = _algorithm(group, "all_gather", output, output.numel(), ReduceOp.SUM)
    if algorithm != "flat":
        pending = _A.run(algorithm, "all_gather", found, output, input, None, async_op, label)
        return _handle(pending, "all_gather")
    with _recorded("all_gather", output, output.numel(), group, label):
        work = _all_gather_single(output, input, group=group, async_op=_async(async_op))
        return _handle(work, "all_gather")


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, *,
                        op=ReduceOp.SUM, async_op: bool = False, label: str = ""):
    """Reduce ``input`` over the group and keep this rank's (dim-0, rank-major) part in ``output``."""
    if group_size(group) == 1:
        output.copy_(input.reshape(output.shape))
        return None
    algorithm, found = _algorithm(group, "reduce_scatter", input, input.numel(), op)
    if algorithm != "flat":
        pending = _A.run(algorithm, "reduce_scatter", found, output, input, op, async_op, label)
        return _handle(pending, "reduce_scatter")
    with _recorded("reduce_scatter", input, input.numel(), group, label):
        work = _reduce_scatter_single(output, input, op=op, group=group,
                                      async_op=_async(async_op))
        return _handle(work, "reduce_scatter")


# The steps of multi-step algorithms (:mod:`.algorithms`): one torch.distributed call each, not
# recorded on their own (the algorithm records the whole collective once, with its steps), each in
# a profiler range of its own.

def _step_range(name: str):
    if _profiler_enabled():
        return torch.profiler.record_function(f"ops_transformer::{name}")
    return _NO_RANGE


def run_all_reduce(tensor: torch.Tensor, group: ProcessGroup, op, name: str):
    with _step_range(name):
        return dist.all_reduce(tensor, op=op, group=group)


def run_all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, name: str,
                   async_op: bool = False):
    with _step_range(name):
        return _all_gather_single(output, input, group=group, async_op=_async(async_op))


def run_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, op,
                       name: str, async_op: bool = False):
    with _step_range(name):
        return _reduce_scatter_single(output, input, op=op, group=group,
                                      async_op=_async(async_op))


def run_swap(send: torch.Tensor, recv: torch.Tensor, peer: int, group: ProcessGroup, name: str):
    """Post a send of ``send`` to and a receive into ``recv`` from global rank ``peer``, as one
    batch (``batch_isend_irecv``: on NCCL a send blocks until its peer's receive is posted, and a
    concurrent send and receive must be grouped, or two ranks that both send first can deadlock
    once the message outgrows NCCL's buffers); returns the work handles."""
    with _step_range(name):
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer, group),
                                       dist.P2POp(dist.irecv, recv, peer, group)])


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
                                              input_split_sizes, group=group,
                                              async_op=_async(async_op)),
                       "all_to_all")


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None, *,
              async_op: bool = False, label: str = ""):
    """In-place broadcast from global rank ``src``."""
    if group_size(group) == 1:
        return None
    with _recorded("broadcast", tensor, tensor.numel(), group, label):
        return _handle(dist.broadcast(tensor, src=src, group=group, async_op=_async(async_op)),
                       "broadcast")


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None, *, label: str = ""):
    """Point-to-point send to global rank ``dst``; returns a work handle (``isend``)."""
    with _recorded("send", tensor, tensor.numel(), group, label):
        return _handle(dist.isend(tensor, dst=dst, group=group), "send")


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None, *, label: str = ""):
    """Point-to-point receive from global rank ``src``; returns a work handle (``irecv``)."""
    with _recorded("recv", tensor, tensor.numel(), group, label):
        return _handle(dist.irecv(tensor, src=src, group=group), "recv")


def send_recv(send: torch.Tensor, recv: torch.Tensor, dst: int, src: int,
              group: ProcessGroup | None, *, label: str = ""):
    """Post a send of ``send`` to global rank ``dst`` and a receive into ``recv`` from global rank
    ``src`` as one batch (``batch_isend_irecv``, so two ranks that both send first cannot
    deadlock on NCCL); returns a handle whose ``wait()`` waits for both. Recorded once, as a
    ``send_recv`` of the elements sent (as many arrive). The step of a ring
    (:mod:`.ring`)."""
    if group_size(group) == 1:
        recv.copy_(send)
        return None
    with _recorded("send_recv", send, send.numel(), group, label):
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, dst, group),
                                        dist.P2POp(dist.irecv, recv, src, group)])
        return _handle(_Works(works), "send_recv")


class _Works:
    """Several work handles waited on as one."""

    def __init__(self, works):
        self._works = works

    def wait(self, *args, **kwargs):
        for work in self._works:
            work.wait(*args, **kwargs)
        return True


def ring_neighbours(group: ProcessGroup) -> tuple[int, int]:
    """``(next, previous)``: the global ranks after and before this one in ``group``'s ring."""
    ranks, me = _ranks(group), group_rank(group)
    return ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]


def p2p_op(kind: str, tensor: torch.Tensor, peer: int, group: ProcessGroup, *,
           label: str = "") -> dist.P2POp:
    """A point-to-point ``send`` or ``recv`` of ``tensor`` with global rank ``peer`` as a
    ``dist.P2POp``, recorded in the ledger now: for a runtime that posts the ops itself in one
    ``batch_isend_irecv`` (``torch.distributed.pipelining``'s schedules: a stage boundary)."""
    if kind not in ("send", "recv"):
        raise ValueError(f"kind must be 'send' or 'recv', got {kind!r}")
    with _recorded(kind, tensor, tensor.numel(), group, label):
        return dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, group)


def broadcast_object(obj, src: int, group: ProcessGroup | None, *, label: str = ""):
    """``obj`` of global rank ``src`` on every rank of the group (pickled). Every rank passes
    something (ignored except on ``src``). Not recorded: a set-up exchange of Python objects (the
    agreed profile and layout, a plan), not a tensor collective of the computation."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    with _step_range("broadcast_object"):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: ProcessGroup | None) -> None:
    """Synchronise the group (not recorded: it moves no tensor)."""
    if group_size(group) > 1:
        dist.barrier(group=group)
