"""Expert all-to-alls overlapped with the experts' computation: chunked dispatch and combine.

The token-slots of one MoE call move in ``chunks`` pieces: piece ``j`` of every block of rows
that goes from one EP rank to one expert (rows ``[⌊n·j/c⌋ …)`` of its ``n``, sizes known to every
rank from the one all-gather of the per-expert counts). While the experts compute piece ``j``,
piece ``j + 1`` is being dispatched and piece ``j − 1`` combined::

    dispatch 0 ─ dispatch 1 ─ dispatch 2 ─ …
                 experts 0 ── experts 1 ── experts 2 ─ …
                              combine 0 ── combine 1 ── combine 2

Backward mirrors it (:mod:`ops_transformer.comm.async_primitives`: a wait's backward starts the
reverse all-to-all, its start's backward waits for it). Per call: the same one all-gather of the
counts, ``chunks`` dispatch and ``chunks`` combine all-to-alls moving together exactly the rows
of the unchunked pair (forward and backward), and — experts split over TP — ``chunks``
all-reduces of the experts' outputs (and of their input gradients) instead of one. Every row is
computed as without chunks: the result is exact.
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from ..comm.async_primitives import all_to_all_start, all_to_all_wait


def piece(n: int, chunks: int, j: int) -> tuple[int, int]:
    """``(offset, size)`` of piece ``j`` of ``n`` rows in ``chunks`` pieces (the larger first;
    empty pieces when ``n < chunks``)."""
    base, extra = divmod(n, chunks)
    return j * base + min(j, extra), base + (j < extra)


def gather_counts(counts: torch.Tensor, group, ep: int, local: int) -> list:
    """Every EP rank's slots per expert: ``[source][destination][local expert]`` (one
    all-gather of ``ep·E`` integers, as the unchunked dispatch)."""
    everyone = counts.new_empty(ep * counts.numel())
    C.all_gather_into(everyone, counts, group, label="moe_counts")
    return everyone.view(ep, ep, local).tolist()


def chunk_routes(everyone: list, me: int, chunks: int, j: int, device) -> dict:
    """Piece ``j`` of one dispatch: which of this rank's expert-sorted slots it sends
    (``index``), the split sizes to and from each rank, and the received rows regrouped
    expert-major for the local experts (``to_expert_major``, ``per_expert``)."""
    ep, local = len(everyone), len(everyone[0][0])
    index, send, offset = [], [], 0
    for dst in range(ep):
        sent = 0
        for e in range(local):
            n = everyone[me][dst][e]
            start, size = piece(n, chunks, j)
            index.append(torch.arange(offset + start, offset + start + size))
            offset, sent = offset + n, sent + size
        send.append(sent)
    got = [[piece(everyone[src][me][e], chunks, j)[1] for e in range(local)] for src in range(ep)]
    starts, at = [], 0  # where each (source, local expert) block begins in the received rows
    for src in range(ep):
        starts.append([])
        for n in got[src]:
            starts[src].append(at)
            at += n
    regroup = [torch.arange(starts[src][e], starts[src][e] + got[src][e])
               for e in range(local) for src in range(ep)]
    return {"index": torch.cat(index).to(device), "send": send,
            "recv": [sum(row) for row in got],
            "to_expert_major": torch.cat(regroup).to(device),
            "per_expert": [sum(got[src][e] for src in range(ep)) for e in range(local)]}


def dispatch_combine_chunked(experts, rows: torch.Tensor, everyone: list,
                             chunks: int) -> torch.Tensor:
    """The experts' outputs for ``rows`` (this rank's token-slots, expert-sorted), dispatched and
    combined in ``chunks`` pieces pipelined with the experts' computation (module docstring)."""
    me, group = experts.shard.ep_rank, experts.ep_group
    routes = [chunk_routes(everyone, me, chunks, j, rows.device) for j in range(chunks)]

    def dispatch(j):
        r = routes[j]
        return all_to_all_start(rows[r["index"]], group, output_splits=r["recv"],
                                input_splits=r["send"])

    started, combines = dispatch(0), []
    for j, r in enumerate(routes):
        following = dispatch(j + 1) if j + 1 < chunks else None
        received = all_to_all_wait(*started)[r["to_expert_major"]]  # expert-major
        started = following
        y = experts._experts(received, r["per_expert"])
        y = y[torch.argsort(r["to_expert_major"])]  # back to source-major
        combines.append(all_to_all_start(y, group, output_splits=r["send"],
                                         input_splits=r["recv"]))
    back = torch.cat([all_to_all_wait(*c) for c in combines])  # piece by piece
    return back[torch.argsort(torch.cat([r["index"] for r in routes]))]  # expert-sorted
