"""``torchrun --max-restarts`` for local ranks: :func:`launch` again after a failed rank, and
``torchrun --nnodes MIN:MAX`` for them: an elastic restart without the node that died.

Like torchrun's elastic agent, a failure of any rank ends the whole attempt (``launch`` already
stops every rank and names the one that failed) and a new attempt starts all ranks afresh; the job
function is expected to resume from its last checkpoint (``train --resume``). Unlike torchrun, user
errors — a ``ValueError`` on a rank, such as a bad setting or a :class:`CheckpointError` — are not
retried: they would fail the same way every time.

``elastic=True`` treats each run of ``ranks_per_node`` consecutive ranks as a node (as
``torchrun`` numbers them): when ranks *died* (killed, or gone without a word — not a Python
error, which a rank survives to report), their nodes are dropped and the next attempt runs on the
ranks of the other nodes, as torchrun continues with the agents that are left. ``resize(n)`` then
gives the arguments for ``n`` ranks (``train`` re-plans its layout there, :mod:`ops_transformer
.rebalance`).
"""

from __future__ import annotations

import logging

from .local import RankError, launch

log = logging.getLogger("ops_transformer")


def launch_with_restarts(fn, nprocs: int, *args, max_restarts: int = 0, launcher=launch,
                         elastic: bool = False, ranks_per_node: int | None = None, resize=None,
                         **kwargs) -> list:
    """``launcher(fn, nprocs, *args, **kwargs)`` (default :func:`launch`), started again up to
    ``max_restarts`` times after a rank fails (killed, crashed, timed out); returns the results
    of the attempt that finished (one per rank of that attempt). ``elastic``, ``ranks_per_node``
    and ``resize``: see the module docstring."""
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a non-negative integer, got {max_restarts!r}")
    if elastic:
        check_elastic(nprocs, ranks_per_node)
    for attempt in range(max_restarts + 1):
        try:
            return launcher(fn, nprocs, *args, **kwargs)
        except RankError as exc:
            if attempt == max_restarts or isinstance(exc, ValueError):
                raise
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            lost = lost_nodes(exc, nprocs, ranks_per_node) if elastic else []
            if lost and len(lost) * ranks_per_node >= nprocs:
                raise  # no node is left
            if lost:
                nprocs -= len(lost) * ranks_per_node
                log.warning("%s; node%s %s lost: continuing on the %d ranks of the other nodes "
                            "(restart %d of %d)", reason, "s" if len(lost) > 1 else "",
                            ", ".join(map(str, lost)), nprocs, attempt + 1, max_restarts)
                if resize is not None:
                    args = tuple(resize(nprocs))
                continue
            log.warning("%s; restarting all %d ranks (restart %d of %d)", reason, nprocs,
                        attempt + 1, max_restarts)
    raise AssertionError("unreachable")


def check_elastic(nprocs: int, ranks_per_node: int | None) -> None:
    """An elastic job needs nodes to drop: ``ranks_per_node`` below and dividing ``nprocs``."""
    if ranks_per_node is None or not 0 < ranks_per_node < nprocs or nprocs % ranks_per_node:
        got = "none given" if ranks_per_node is None else f"got {ranks_per_node}"
        raise ValueError(f"--elastic drops the node whose ranks die: it needs --ranks-per-node "
                         f"smaller than --nproc ({nprocs}) and dividing it ({got})")


def lost_nodes(exc: RankError, nprocs: int, ranks_per_node: int) -> list[int]:
    """The nodes (``rank // ranks_per_node``) of the ranks that died in the failed attempt."""
    return sorted({r // ranks_per_node for r in getattr(exc, "dead_ranks", ()) if r < nprocs})
