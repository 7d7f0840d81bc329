"""``profile_step``: where the time of a training step goes on every rank (SPEC F12).

``profile_step(step_fn, ctx, steps=5, warmup=2)`` runs ``step_fn`` ``warmup`` times, then
``steps`` times under ``torch.profiler`` and a :class:`~ops_transformer.comm.CommLedger`, each step
inside a ``record_function("ops_transformer::step#<i>")`` range. Every rank of the job must call it
(``step_fn`` communicates, and the ranks exchange their results at the end). Each rank splits its
steps (:mod:`.timeline`) and the :class:`Profile` it returns holds every rank's split, so
:meth:`Profile.summary` is the same dict on every rank:

- ``per_rank``: step time, compute (matmul / other, and of the other the host's Python between
  operators), communication, exposed and overlapped communication, idle time (GPU: the device
  waiting for the host), the compute/communication ratio and the device utilisation
  (compute / step); per collective kind the calls, bytes (ledger) and element counts per step,
  the mean latency and the achieved bus bandwidth (ring wire bytes / latency, the convention of
  nccl-tests' ``busbw``); under context parallelism ``cp_collectives``, per ``cp.*`` ledger label
  (``cp.ring.fwd``, ``cp.allgather_kv.bwd``, ``cp.loss.fwd``, ``cp.moe_stats``) its calls, elements
  and bytes per step; the top operators by self time; one step's timeline.
- ``collectives``, ``top_operators``: the same, averaged over ranks; ``critical_path``: the chain
  of operators and collectives of the slowest rank's median step (the rank that sets the length).

Times are per step (means over the profiled steps), in seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import collectives as C
from ..comm.ledger import CommLedger, wire_elements
from . import timeline as T
from .critical import critical_path, step_timeline

TOP_OPERATORS = 12


def world_group(ctx):
    """The group of every rank of the job (the default group), ``None`` for one process."""
    return dist.group.WORLD if ctx.world_size > 1 else None


_BANNER = re.compile(rb"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\] ")


@contextlib.contextmanager
def without_kineto_banners():
    """Kineto (torch.profiler's C++ side) prints ``USDT:… profiler_start`` / ``profiler_stop`` and
    ``STAGE:…`` lines straight to the process's stderr, at any ``KINETO_LOG_LEVEL``: hold them
    back while the block runs (the profiler's start or stop), and pass on everything else."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = b"".join(line for line in held.read().splitlines(keepends=True)
                            if not _BANNER.match(line))
            if rest:
                os.write(2, rest)


def profile_step(step_fn, ctx, steps: int = 5, warmup: int = 2) -> Profile:
    """Profile ``steps`` calls of ``step_fn()`` after ``warmup`` unprofiled ones, on every rank
    of ``ctx`` (module docstring)."""
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    for _ in range(warmup):
        step_fn()
    world = world_group(ctx)
    C.barrier(world)  # the ranks start the profiled steps together
    cuda = ctx.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ledgers, walls = [], []
    prof = torch.profiler.profile(activities=activities)
    with without_kineto_banners():
        prof.start()
    try:
        for i in range(steps):
            with CommLedger() as ledger, torch.profiler.record_function(f"{T.STEP_PREFIX}{i}"):
                start = time.perf_counter()
                step_fn()
                if cuda:
                    torch.cuda.synchronize(ctx.device)
                walls.append(time.perf_counter() - start)
            ledgers.append(ledger)
    finally:
        with without_kineto_banners():
            prof.stop()
    mine = _rank_summary(prof, ledgers, walls, ctx)
    return Profile(rank=ctx.rank, per_rank=gather_objects(mine, world, ctx.device), steps=steps,
                   warmup=warmup, torch_profile=prof)


def events_of(prof) -> list[T.Event]:
    """The profiler's events as :class:`~.timeline.Event` on the wall clock (µs since the epoch),
    so that the ranks of one machine share a time axis."""
    base = prof.profiler.kineto_results.trace_start_ns() / 1e3
    return [T.Event(e.name, int(e.thread) if not _on_device(e) else -1 - int(e.device_index),
                    base + e.time_range.start, base + e.time_range.end, _on_device(e))
            for e in prof.events()]


def _on_device(e) -> bool:
    return e.device_type != torch.autograd.DeviceType.CPU


def _rank_summary(prof, ledgers: list[CommLedger], walls: list[float], ctx) -> dict:
    events = events_of(prof)
    steps = sorted((e.start, e.end) for e in events if e.name.startswith(T.STEP_PREFIX)
                   and not e.device)
    splits = [T.split_step(events, a, b) for a, b in steps]
    n = len(splits)
    mean = {k: sum(getattr(s, k) for s in splits) / n
            for k in ("step", "compute", "matmul", "host", "exposed_comm", "comm", "idle",
                      "overlapped_comm")}
    median = sorted(range(n), key=lambda i: splits[i].step)[n // 2]
    return {
        "rank": ctx.rank, "tp_rank": ctx.tp_rank, "dp_rank": ctx.dp_rank,
        "step_time_s": mean["step"], "step_times_s": [s.step for s in splits],
        "wall_step_times_s": walls,
        "compute_s": mean["compute"], "matmul_s": mean["matmul"],
        "other_compute_s": mean["compute"] - mean["matmul"], "host_s": mean["host"],
        "comm_s": mean["comm"], "exposed_comm_s": mean["exposed_comm"],
        "overlapped_comm_s": mean["overlapped_comm"], "idle_s": mean["idle"],
        "compute_comm_ratio": mean["compute"] / mean["comm"] if mean["comm"] else None,
        "device_utilisation": mean["compute"] / mean["step"] if mean["step"] else None,
        "collectives": _collectives(events, steps, ledgers),
        "cp_collectives": _labelled(ledgers, "cp."),
        "top_operators": _top_operators(prof, n),
        "timeline": step_timeline(events, *steps[median]),
        "critical_path": critical_path(events, *steps[median]),
        "device": str(ctx.device),
    }


def _collectives(events, steps, ledgers: list[CommLedger]) -> dict[str, dict]:
    """Per ledger kind: calls, elements and bytes per step (the ledger), mean latency (s), time
    per step (s) and the achieved bus bandwidth (wire bytes / latency, bytes/s). The time is
    gloo's or NCCL's transfers when every collective ran flat, else our call and wait ranges
    (the steps of a hierarchical or point-to-point algorithm are transfers of other kinds)."""
    n = len(ledgers)
    records = [r for ledger in ledgers for r in ledger.records]
    flat = all(getattr(r, "algorithm", "flat") == "flat" for r in records)
    latencies = T.kind_latencies(events, steps, transfers=flat)
    out = {}
    for kind in sorted({r.kind for r in records}):
        mine = [r for r in records if r.kind == kind]
        wire = sum(wire_elements(kind, r.elements, r.group_size) * r.bytes / max(r.elements, 1)
                   for r in mine)
        times = latencies.get(kind, [])
        total = sum(times)
        out[kind] = {"calls": len(mine) / n, "elements": sum(r.elements for r in mine) / n,
                     "bytes": sum(r.bytes for r in mine) / n,
                     "time_s": total / n, "mean_latency_s": total / len(mine) if times else 0.0,
                     "bus_bandwidth_Bps": wire / total if total else None,
                     "group_sizes": sorted({r.group_size for r in mine})}
    return out


def _labelled(ledgers: list[CommLedger], prefix: str) -> dict[str, dict]:
    """Per ledger label starting with ``prefix`` (context parallelism's ``cp.*``): its kind, and
    calls, elements and bytes per step."""
    n = len(ledgers)
    out: dict[str, dict] = {}
    for r in (r for ledger in ledgers for r in ledger.records if r.label.startswith(prefix)):
        row = out.setdefault(r.label, {"kind": r.kind, "calls": 0.0, "elements": 0.0,
                                       "bytes": 0.0})
        row["calls"] += 1 / n
        row["elements"] += r.elements / n
        row["bytes"] += r.bytes / n
    return dict(sorted(out.items()))


def _top_operators(prof, steps: int) -> list[dict]:
    rows = [a for a in prof.key_averages() if not a.key.startswith(T.STEP_PREFIX)]
    rows.sort(key=lambda a: a.self_cpu_time_total + a.self_device_time_total, reverse=True)
    return [{"name": a.key, "calls": a.count / steps,
             "self_s": (a.self_cpu_time_total + a.self_device_time_total) * 1e-6 / steps,
             "total_s": a.cpu_time_total * 1e-6 / steps}
            for a in rows[:TOP_OPERATORS]]


def gather_objects(mine, group, device: torch.device | str = "cpu") -> list:
    """Every rank's ``mine`` in rank order (JSON over two all-gathers: lengths, then bytes). The
    buffers live on ``device`` (the ranks' ``ctx.device``: NCCL moves CUDA tensors only) and are
    read back once, at the end."""
    if group is None:
        return [mine]
    data = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8)
    p = dist.get_world_size(group)
    sizes = torch.zeros(p, dtype=torch.int64, device=device)
    C.all_gather_into(sizes, torch.tensor([data.numel()], device=device), group, label="profile")
    sizes = sizes.cpu()
    width = int(sizes.max())
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data.to(device)
    out = torch.zeros(p * width, dtype=torch.uint8, device=device)
    C.all_gather_into(out, padded, group, label="profile")
    out = out.cpu()
    return [json.loads(bytes(out[r * width: r * width + int(sizes[r])].tolist()).decode())
            for r in range(p)]


@dataclass
class Profile:
    """The profile of a step on every rank (:func:`profile_step`); ``rank`` is this rank."""

    rank: int
    per_rank: list[dict]
    steps: int
    warmup: int
    torch_profile: object = field(default=None, repr=False)

    def summary(self) -> dict:
        """The same dict on every rank (module docstring)."""
        ranks = self.per_rank
        slowest = max(ranks, key=lambda r: r["step_time_s"])
        return {
            "ranks": len(ranks), "steps": self.steps, "warmup": self.warmup,
            "step_time_s": statistics.median(r["step_time_s"] for r in ranks),
            "per_rank": [{k: v for k, v in r.items() if k not in ("timeline", "critical_path")}
                         for r in ranks],
            "collectives": _mean_collectives(ranks),
            "cp_collectives": ranks[0].get("cp_collectives", {}),  # the same on every cp rank
            "top_operators": _mean_operators(ranks),
            "critical_path": {"rank": slowest["rank"], **slowest["critical_path"]},
            "timelines": [{"rank": r["rank"], **r["timeline"]} for r in ranks],
        }

    def export_chrome_trace(self, path) -> Path:
        """This rank's Chrome trace (``chrome://tracing`` or https://ui.perfetto.dev)."""
        path = Path(path)
        self.torch_profile.export_chrome_trace(str(path))
        return path


def _mean_collectives(ranks: list[dict]) -> dict[str, dict]:
    kinds = sorted({k for r in ranks for k in r["collectives"]})
    out = {}
    for kind in kinds:
        rows = [r["collectives"][kind] for r in ranks if kind in r["collectives"]]
        bw = [x["bus_bandwidth_Bps"] for x in rows if x["bus_bandwidth_Bps"]]
        out[kind] = {k: statistics.fmean(x[k] for x in rows)
                     for k in ("calls", "elements", "bytes", "time_s", "mean_latency_s")}
        out[kind]["bus_bandwidth_Bps"] = statistics.fmean(bw) if bw else None
        out[kind]["ranks"] = len(rows)
    return out


def _mean_operators(ranks: list[dict]) -> list[dict]:
    merged: dict[str, dict] = {}
    for r in ranks:
        for op in r["top_operators"]:
            m = merged.setdefault(op["name"], {"name": op["name"], "calls": 0.0, "self_s": 0.0,
                                               "total_s": 0.0})
            for k in ("calls", "self_s", "total_s"):
                m[k] += op[k] / len(ranks)
    return sorted(merged.values(), key=lambda m: m["self_s"], reverse=True)[:TOP_OPERATORS]
