"""Multi-step collectives: hierarchical across nodes, point-to-point in a group of two.

:mod:`.collectives` runs these when the engine (:mod:`.engine`) chooses them; each computes what the
flat collective computes (up to the order of a sum) and is recorded once in the ledger, with its
steps. A group of ``p = k·m`` ranks, ``k`` per node on ``m`` nodes, numbered node by node; rank
``(node j, local i)`` is the group's rank ``j·k + i``. ``intra``: the ``k`` ranks of this node,
``inter``: the ``m`` ranks at this local index.

======================= =============================================================================
algorithm               steps
======================= =============================================================================
hierarchical all-reduce reduce-scatter intra (shard ``i`` of the node's sum on local rank ``i``) →
                        all-reduce of that shard inter → all-gather intra
hierarchical all-gather all-gather inter (the shards at this local index, node order) → all-gather
                        intra (→ local-major blocks) → reorder to the group's node-major order
hierarchical            reorder the input to local-major blocks → reduce-scatter intra (blocks of
reduce-scatter          local index ``i``, summed over the node) → reduce-scatter inter (this node's)
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


def _step(kind, elements, tensor, ranks, level) -> CommStep:
    return CommStep(kind, elements, elements * tensor.element_size(), ranks, level)


def _hierarchical_all_reduce(g, tensor, _input, op):
    k = g.per_node
    flat = _contiguous_flat(tensor)
    n = flat.numel()
    chunk = -(-n // k)
    buf = flat if chunk * k == n else torch.cat([flat, flat.new_zeros(chunk * k - n)])
    shard = buf.new_empty(chunk)
    steps = (_step("reduce_scatter", chunk * k, buf, g.intra_ranks, "intra"),
             _step("all_reduce", chunk, buf, g.inter_ranks, "inter"),
             _step("all_gather", chunk * k, buf, g.intra_ranks, "intra"))
    work = C.run_reduce_scatter(shard, buf, g.intra, op, "all_reduce.intra.reduce_scatter",
                                async_op=True)

    def finish():
        C.run_all_reduce(shard, g.inter, op, "all_reduce.inter.all_reduce")
        C.run_all_gather(buf, shard, g.intra, "all_reduce.intra.all_gather")
        if buf is not flat:
            flat.copy_(buf[:n])
        _write_back(tensor, flat)

    return steps, [work], finish


def _hierarchical_all_gather(g, output, input, _op):
    m, k = g.nodes, g.per_node
    shard = _contiguous_flat(input)
    s = shard.numel()
    across = shard.new_empty(m * s)  # this local index on every node, node order
    steps = (_step("all_gather", m * s, shard, g.inter_ranks, "inter"),
             _step("all_gather", k * m * s, shard, g.intra_ranks, "intra"))
    work = C.run_all_gather(across, shard, g.inter, "all_gather.inter.all_gather", async_op=True)

    def finish():
        local_major = shard.new_empty(k * m * s)
        C.run_all_gather(local_major, across, g.intra, "all_gather.intra.all_gather")
        output.copy_(local_major.view(k, m, s).transpose(0, 1).reshape(output.shape))

    return steps, [work], finish


def _hierarchical_reduce_scatter(g, output, input, op):
    m, k = g.nodes, g.per_node
    s = output.numel()
    local_major = input.reshape(m, k, s).transpose(0, 1).reshape(-1)  # a reordered copy
    mine = local_major.new_empty(m * s)
    out = _contiguous_flat(output)
    steps = (_step("reduce_scatter", k * m * s, input, g.intra_ranks, "intra"),
             _step("reduce_scatter", m * s, input, g.inter_ranks, "inter"))
    work = C.run_reduce_scatter(mine, local_major, g.intra, op,
                                "reduce_scatter.intra.reduce_scatter", async_op=True)

    def finish():
        C.run_reduce_scatter(out, mine, g.inter, op, "reduce_scatter.inter.reduce_scatter")
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


_ALGORITHMS = {
    ("hierarchical", "all_reduce"): _hierarchical_all_reduce,
    ("hierarchical", "all_gather"): _hierarchical_all_gather,
    ("hierarchical", "reduce_scatter"): _hierarchical_reduce_scatter,
    ("p2p", "all_reduce"): _p2p_all_reduce,
    ("p2p", "all_gather"): _p2p_all_gather,
    ("p2p", "reduce_scatter"): _p2p_reduce_scatter,
}


def run(algorithm: str, kind: str, g, output: torch.Tensor, input: torch.Tensor | None, op,
        async_op: bool, label: str):
    """Run ``kind`` with ``algorithm`` on the group ``g`` describes (``output`` is the all-reduced
    tensor itself for an all-reduce); record it once with its steps. A :class:`Pending` handle when
    ``async_op``, else ``None`` after every step has finished."""
    logical = output if kind != "reduce_scatter" else input
    steps, works, finish = _ALGORITHMS[algorithm, kind](g, output, input, op)
    with C._recorded(kind, logical, logical.numel(), g.group, label, algorithm=algorithm,
                     level=g.level, steps=steps):
        pending = Pending(works, finish)
        if async_op:
            return pending
        pending.wait()
        return None
