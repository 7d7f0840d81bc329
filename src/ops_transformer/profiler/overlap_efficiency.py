"""How much of a collective running beside compute this machine really hides: the overlap
efficiency ``η`` of the cost model (:mod:`ops_transformer.planner.overlap`), measured for
``ops-transformer calibrate``.

Two ranks, one intra-op thread each (as in training). For a message of ``n`` bytes: the
all-reduce alone (``t_comm``), a block of fp32 matmuls sized to take about as long alone
(``t_comp``), and the two together — the all-reduce started asynchronously, the matmuls run, then
its wait (``t_both``); each the median of several runs, the slowest rank's. Then::

    η = (t_comm + t_comp − t_both) / min(t_comm, t_comp)      clamped to [0, 1]

1 when the pair takes as long as the longer of the two (the transfer fully hidden), 0 when it
takes their sum or more (nothing hidden: on a CPU whose cores the compute fills, gloo's threads
take the time they need from it). The profile records every point and the median ``η``.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..comm import collectives as C
from ..parallel.context import init_parallel

MESSAGE_BYTES = (1 << 20, 4 << 20)
QUICK_MESSAGE_BYTES = (1 << 20,)
MATMUL = 256  # the matmuls are (MATMUL × MATMUL) @ (MATMUL × MATMUL) products, repeated


def efficiency(t_comm: float, t_comp: float, t_both: float) -> float:
    """``η`` of one measurement (module docstring), in [0, 1]."""
    shorter = min(t_comm, t_comp)
    if shorter <= 0:
        return 0.0
    return min(max((t_comm + t_comp - t_both) / shorter, 0.0), 1.0)


def _timed(op, group, repeats: int) -> float:
    op()
    times = []
    for _ in range(repeats):
        C.barrier(group)
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(message_bytes, repeats: int) -> list[dict]:
    ctx = init_parallel(tp=1)
    group = ctx.dp_group
    a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)
    points = []
    for nbytes in message_bytes:
        buf = torch.zeros(nbytes // 4)
        t_comm = _timed(lambda: C.all_reduce(buf, group), group, repeats)
        one = _timed(lambda: a @ b, group, repeats)
        # the same number of products on every rank: rank 0's choice
        count = int(C.broadcast_object(max(1, round(t_comm / max(one, 1e-9))), 0, group))

        def compute():
            for _ in range(count):
                a @ b

        def both():
            work = C.all_reduce(buf, group, async_op=True)
            compute()
            work.wait()

        points.append({"bytes": nbytes, "matmuls": count, "t_comm": t_comm,
                       "t_comp": _timed(compute, group, repeats), "t_both": _timed(both, group,
                                                                                  repeats)})
    return points


def measure_overlap(launch, *, quick: bool = False, timeout: float = 900.0) -> dict:
    """``{"efficiency", "points"}`` of this machine (two local ranks through ``launch``): per
    message size the slowest rank's times and its ``η``; ``efficiency`` their median."""
    sizes = QUICK_MESSAGE_BYTES if quick else MESSAGE_BYTES
    per_rank = launch(_worker, 2, sizes, 5 if quick else 15, timeout=timeout)
    points = []
    for i, first in enumerate(per_rank[0]):
        slowest = {k: max(r[i][k] for r in per_rank) for k in ("t_comm", "t_comp", "t_both")}
        points.append({"bytes": first["bytes"], "matmuls": first["matmuls"], **slowest,
                       "efficiency": efficiency(slowest["t_comm"], slowest["t_comp"],
                                                slowest["t_both"])})
    return {"efficiency": statistics.median(p["efficiency"] for p in points), "points": points}
