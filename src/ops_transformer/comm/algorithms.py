"""Multi-step collectives: in two stages (hierarchical across nodes, staged over the PCIe islands
of a node), point-to-point in a group of two.

:mod:`.collectives` runs these when the engine (:mod:`.engine`) chooses them; each computes what the
flat collective computes (up to the order of a sum) and is recorded once in the ledger, with its
steps. The two-stage forms work on a group of ``p = k·m`` ranks, ``k`` in each of ``m`` parts —
nodes (``hierarchical``) or PCIe islands of one node (``staged``) — numbered part by part; rank
``(part j, local i)`` is the group's rank ``j·k + i``. ``inner``: the ``k`` ranks of this part,
``outer``: the ``m`` ranks at this local index (:class:`~.engine.Stages`). Only the sub-groups and
the ledger's levels differ: ``"intra"`` then ``"inter"`` across nodes, ``"intra"`` then
``"inter_island"`` over islands.

======================= =============================================================================
algorithm               steps
======================= =============================================================================
two-stage all-reduce    reduce-scatter inner (shard ``i`` of the part's sum on local rank ``i``) →
                        all-reduce of that shard outer → all-gather inner
two-stage all-gather    all-gather outer (the shards at this local index, part order) → all-gather
                        inner (→ local-major blocks) → reorder to the group's part-major order
two-stage               reorder the input to local-major blocks → reduce-scatter inner (blocks of
reduce-scatter          local index ``i``, summed over the part) → reduce-scatter outer (this part's)
p2p all-reduce          swap the whole tensor with the peer; ``mine ⊕ theirs`` (⊕ commutative:
                        both ranks get the same bits, and the flat collective's)
p2p all-gather          swap the shards; place both in group order
p2p reduce-scatter      send the peer its half; ``my half ⊕ its half of mine``
======================= =============================================================================

With ``async_op=True`` the first step starts at once and the handle's ``wait()`` runs the others:
callers keep issuing collectives in the same order on every rank, so the steps do too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives as C
from .ledger import CommStep

ReduceOp = dist.ReduceOp
REDUCE_OPS = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN)


def _combine(op, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    if op == ReduceOp.SUM:
        torch.add(a, b, out=out)
    elif op == ReduceOp.MAX:
        torch.maximum(a, b, out=out)
    else:
        torch.minimum(a, b, out=out)


class Pending:
    """The work handle of a multi-step collective: ``wait()`` waits for the started step, then
    runs the remaining ones."""

    def __init__(self, works, finish):
        self._works, self._finish = works, finish

    def wait(self, timeout=None) -> bool:
        if self._finish is not None:
            for work in self._works:
                work.wait()
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


def _contiguous_flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1).clone()


def _write_back(target: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``target`` unless ``flat`` is already a view of it."""
    if not target.is_contiguous():
        target.copy_(flat.view(target.shape))


def _step(kind, elements, tensor, ranks, level, flows: int = 1) -> CommStep:
    return CommStep(kind, elements, elements * tensor.element_size(), ranks, level, flows)


def _inner(st, kind, elements, tensor) -> CommStep:
    return _step(kind, elements, tensor, st.inner_ranks, st.inner_level)


def _outer(st, kind, elements, tensor) -> CommStep:
    return _step(kind, elements, tensor, st.outer_ranks, st.outer_level, st.flows)


def _two_stage_all_reduce(st, tensor, _input, op):
    k, inner, outer = st.per_part, st.inner_level, st.outer_level
    flat = _contiguous_flat(tensor)
    n = flat.numel()
    chunk = -(-n // k)
    buf = flat if chunk * k == n else torch.cat([flat, flat.new_zeros(chunk * k - n)])
    shard = buf.new_empty(chunk)
    steps = (_inner(st, "reduce_scatter", chunk * k, buf), _outer(st, "all_reduce", chunk, buf),
             _inner(st, "all_gather", chunk * k, buf))
    work = C.run_reduce_scatter(shard, buf, st.inner, op, f"all_reduce.{inner}.reduce_scatter",
                                async_op=True)

    def finish():
        C.run_all_reduce(shard, st.outer, op, f"all_reduce.{outer}.all_reduce")
        C.run_all_gather(buf, shard, st.inner, f"all_reduce.{inner}.all_gather")
        if buf is not flat:
            flat.copy_(buf[:n])
        _write_back(tensor, flat)

    return steps, [work], finish


def _two_stage_all_gather(st, output, input, _op):
    m, k = st.parts, st.per_part
    shard = _contiguous_flat(input)
    s = shard.numel()
    across = shard.new_empty(m * s)  # this local index in every part, part order
    steps = (_outer(st, "all_gather", m * s, shard), _inner(st, "all_gather", k * m * s, shard))
    work = C.run_all_gather(across, shard, st.outer, f"all_gather.{st.outer_level}.all_gather",
                            async_op=True)

    def finish():
        local_major = shard.new_empty(k * m * s)
        C.run_all_gather(local_major, across, st.inner, f"all_gather.{st.inner_level}.all_gather")
        output.copy_(local_major.view(k, m, s).transpose(0, 1).reshape(output.shape))

    return steps, [work], finish


def _two_stage_reduce_scatter(st, output, input, op):
    m, k = st.parts, st.per_part
    s = output.numel()
    local_major = input.reshape(m, k, s).transpose(0, 1).reshape(-1)  # a reordered copy
    mine = local_major.new_empty(m * s)
    out = _contiguous_flat(output)
    steps = (_inner(st, "reduce_scatter", k * m * s, input),
             _outer(st, "reduce_scatter", m * s, input))
    work = C.run_reduce_scatter(mine, local_major, st.inner, op,
                                f"reduce_scatter.{st.inner_level}.reduce_scatter", async_op=True)

    def finish():
        C.run_reduce_scatter(out, mine, st.outer, op,
                             f"reduce_scatter.{st.outer_level}.reduce_scatter")
        _write_back(output, out)

    return steps, [work], finish


def _p2p_all_reduce(g, tensor, _input, op):
    mine = _contiguous_flat(tensor)
    theirs = torch.empty_like(mine)
    n = mine.numel()
    steps = (_step("send", n, mine, g.ranks, g.level), _step("recv", n, mine, g.ranks, g.level))
    works = C.run_swap(mine, theirs, g.peer(g.rank), g.group, "all_reduce.p2p")

    def finish():
        _combine(op, mine, theirs, mine)
        _write_back(tensor, mine)

    return steps, list(works), finish


def _p2p_all_gather(g, output, input, _op):
    me = g.ranks.index(g.rank)
    rows = output.view(2, -1) if output.is_contiguous() else output.new_empty(2, input.numel())
    rows[me].copy_(input.reshape(-1))
    s = rows.shape[1]
    steps = (_step("send", s, input, g.ranks, g.level), _step("recv", s, input, g.ranks, g.level))
    works = C.run_swap(rows[me], rows[1 - me], g.peer(g.rank), g.group, "all_gather.p2p")

    def finish():
        if not output.is_contiguous():
            output.copy_(rows.view(output.shape))

    return steps, list(works), finish


def _p2p_reduce_scatter(g, output, input, op):
    me = g.ranks.index(g.rank)
    halves = _contiguous_flat(input).view(2, -1)
    theirs = halves.new_empty(halves.shape[1])
    s = theirs.numel()
    steps = (_step("send", s, input, g.ranks, g.level), _step("recv", s, input, g.ranks, g.level))
    works = C.run_swap(halves[1 - me], theirs, g.peer(g.rank), g.group, "reduce_scatter.p2p")
    out = _contiguous_flat(output)

    def finish():
        _combine(op, halves[me], theirs, out)
        _write_back(output, out)

    return steps, list(works), finish


_TWO_STAGE = {"all_reduce": _two_stage_all_reduce, "all_gather": _two_stage_all_gather,
              "reduce_scatter": _two_stage_reduce_scatter}
_P2P = {"all_reduce": _p2p_all_reduce, "all_gather": _p2p_all_gather,
        "reduce_scatter": _p2p_reduce_scatter}


def run(algorithm: str, kind: str, g, output: torch.Tensor, input: torch.Tensor | None, op,
        async_op: bool, label: str):
    """Run ``kind`` with ``algorithm`` on the group ``g`` describes (``output`` is the all-reduced
    tensor itself for an all-reduce); record it once with its steps. A :class:`Pending` handle when
    ``async_op``, else ``None`` after every step has finished."""
    logical = output if kind != "reduce_scatter" else input
    if algorithm == "p2p":
        steps, works, finish = _P2P[kind](g, output, input, op)
    else:  # "hierarchical" (nodes) or "staged" (PCIe islands)
        steps, works, finish = _TWO_STAGE[kind](g.stages(algorithm), output, input, op)
    with C._recorded(kind, logical, logical.numel(), g.group, label, algorithm=algorithm,
                     level=g.level, steps=steps):
        pending = Pending(works, finish)
        if async_op:
            return pending
        pending.wait()
        return None
