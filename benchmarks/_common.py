"""Helpers shared by the benchmark scripts: the timing loop, interleaved rounds, medians and ratios
paired by round, and the command-line checks.

The scripts run as ``python benchmarks/bench_*.py``, so this directory is on ``sys.path`` and they
import this module as ``_common``.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence

import torch

# The timing loop, interleaved rounds and paired ratios live in the package (``ops-transformer
# bench`` uses them too); the scripts keep importing them from here.
from ops_transformer.profiler.bench import (format_paired, interleave, median_ms,  # noqa: F401
                                            paired_ratio, time_steps)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max absolute difference relative to the largest magnitude of ``ref``."""
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def add_timing_args(parser, *, rounds: int, steps: int | None, steps_help: str,
                    warmup: int | None, warmup_help: str | None = None) -> None:
    """``--rounds``, ``--steps``, ``--warmup`` and ``--json``, the options every benchmark has."""
    parser.add_argument("--rounds", type=int, default=rounds,
                        help=f"interleaved rounds (default {rounds})")
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--warmup", type=int, default=warmup,
                        help=warmup_help or f"untimed steps before each block (default {warmup})")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def check_count_args(parser, args) -> None:
    """``parser.error`` for counts below their minimum (warmup >= 0, rounds and steps >= 1);
    ``None`` means a per-size default."""
    for name in ("rounds", "steps", "warmup"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            parser.error(f"--{name} must be {'>= 0' if name == 'warmup' else '>= 1'}, "
                         f"got {value}")


def check_counts(parser, args, sizes: Sequence[str]) -> None:
    """``parser.error`` for unknown ``--sizes`` or counts below their minimum."""
    unknown = [s for s in args.sizes.split(",") if s not in sizes]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {list(sizes)}")
    check_count_args(parser, args)


def backward_step(module, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """Forward, backward of ``grad_out``, then drop every gradient; returns the output."""
    y = module(x)
    y.backward(grad_out)
    for p in module.parameters():
        p.grad = None
    x.grad = None
    return y


def source_version() -> str:
    """The git commit of this checkout (``+dirty`` with uncommitted changes), or ``unknown``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "src"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


class OtherLoad:
    """CPU time that other processes used while this one (and its children) ran — the machine's
    background load during a benchmark, in cores on average. Linux only (``/proc/stat``); elsewhere
    :meth:`cores` is ``None``.

    >>> load = OtherLoad()          # before the job
    >>> ...                         # run it; its processes must have been joined
    >>> load.cores()                # e.g. 0.4: others kept 0.4 of a core busy meanwhile
    """

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        import resource

        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = sum(fields[:3]) + sum(fields[5:7])  # user nice system, irq softirq
        own = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            usage = resource.getrusage(who)
            own += usage.ru_utime + usage.ru_stime
        return busy / os.sysconf("SC_CLK_TCK"), own, time.monotonic()

    def cores(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None:
            return None
        busy, own, wall = (b - a for a, b in zip(self._start, end))
        return max(busy - own, 0.0) / wall if wall > 0 else None


def method_stats(per_rank_times: Sequence[dict[str, list[list[float]]]], methods: Sequence[str],
                 baseline: str, *, rank0_only: Sequence[str] = ()) -> dict[str, dict]:
    """Rank 0's pooled median (ms) per method, the spread of its per-round medians, the other
    ranks' pooled medians, and each method's ratio to ``baseline``: pooled and paired by round.

    ``per_rank_times``: each rank's ``{method: per-round lists of step times}`` from
    :func:`interleave`, rank 0 first. Methods in ``rank0_only`` have no other-rank medians.
    """
    times = per_rank_times[0]
    stats: dict[str, dict] = {"ms": {}, "round_ms": {}, "other_ranks_ms": {}, "ratio": {},
                              "paired": {}}
    for m in methods:
        stats["ms"][m] = median_ms(times[m])
        per_round = [median_ms([block]) for block in times[m]]
        stats["round_ms"][m] = [min(per_round), max(per_round)]
        if m not in rank0_only:
            stats["other_ranks_ms"][m] = [median_ms(t[m]) for t in per_rank_times[1:]]
        stats["ratio"][m] = stats["ms"][m] / stats["ms"][baseline]
        stats["paired"][m] = paired_ratio(times, m, baseline)
    return stats


def job_meta(rank0: dict, args, **extra) -> dict:
    """The setup of a benchmark job for its report and JSON: versions, backend, CPUs, threads per
    rank (``rank0``: what rank 0 returned, with ``backend`` and ``threads``), the counts in
    ``args`` (``rounds``, ``steps``, ``warmup`` where present), and ``extra``."""
    import platform

    meta = {"torch": torch.__version__, "ops_transformer": source_version(),
            "backend": rank0["backend"], "cpus": os.cpu_count(),
            "threads_per_rank": rank0["threads"], "python": platform.python_version()}
    meta.update({k: getattr(args, k) for k in ("rounds", "steps", "warmup") if hasattr(args, k)})
    meta.update(extra)
    return meta



def finish(t0: float, json_path: str | None, payload: dict,
           other_cores: float | None = None, measured_load: bool = True) -> None:
    """The closing lines every benchmark prints: wall time (and the load other processes put on
    the machine meanwhile), then the JSON results when asked for."""
    import json
    import time as _time

    line = f"\ntotal wall time {_time.perf_counter() - t0:.1f} s"
    if measured_load:
        load = "unknown" if other_cores is None else f"{other_cores:.2f} cores"
        line += f"; other processes kept {load} busy on average meanwhile"
    print(line)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {json_path}")
