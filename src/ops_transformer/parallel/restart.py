"""``torchrun --max-restarts`` for local ranks: :func:`launch` again after a failed rank.

Like torchrun's elastic agent, a failure of any rank ends the whole attempt (``launch`` already
stops every rank and names the one that failed) and a new attempt starts all ranks afresh; the job
function is expected to resume from its last checkpoint (``train --resume``). Unlike torchrun, user
errors — a ``ValueError`` on a rank, such as a bad setting or a :class:`CheckpointError` — are not
retried: they would fail the same way every time.
"""

from __future__ import annotations

import logging

from .launch import RankError, launch

log = logging.getLogger("ops_transformer")


def launch_with_restarts(fn, nprocs: int, *args, max_restarts: int = 0, launcher=launch,
                         **kwargs) -> list:
    """``launcher(fn, nprocs, *args, **kwargs)`` (default :func:`launch`), started again up to
    ``max_restarts`` times after a rank fails (killed, crashed, timed out); returns the results
    of the attempt that finished."""
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a non-negative integer, got {max_restarts!r}")
    for attempt in range(max_restarts + 1):
        try:
            return launcher(fn, nprocs, *args, **kwargs)
        except RankError as exc:
            if attempt == max_restarts or isinstance(exc, ValueError):
                raise
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("%s; restarting all %d ranks (restart %d of %d)", reason, nprocs,
                        attempt + 1, max_restarts)
    raise AssertionError("unreachable")
