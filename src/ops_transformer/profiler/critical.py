"""One step as a chain: the timeline picture's segments and the critical path.

A rank's step threads run one operator or collective after another (the autograd engine runs a
CPU backward on the calling thread), so the top-level events of the step, in time order, with the
host's gaps between them, are the chain whose durations add up to the step. The slowest rank's
chain sets the step's length (the others wait for it inside their collectives): that chain is the
critical path :func:`ops_transformer.profiler.profile_step` reports.
"""

from __future__ import annotations

from . import timeline as T

FOLD_SHARE = 0.01  # segments shorter than this share of the step are folded together
MIN_GAP_US = 5.0  # host gaps shorter than this are not segments of their own


def _pieces(e: T.Event, comm: list[T.Event]):
    """``e`` cut around the collective calls and waits nested in it:
    ``(name, type, start, end)`` pieces."""
    if T.comm_kind(e.name) is not None:
        yield e.name, "comm", e.start, e.end
        return
    t = e.start
    for c in comm:
        if c.thread == e.thread and c.start >= t and c.end <= e.end:
            if c.start > t:
                yield e.name, T.segment_type(e), t, c.start
            yield c.name, "comm", c.start, c.end
            t = c.end
    if e.end > t:
        yield e.name, T.segment_type(e), t, e.end


def _chain(events: list[T.Event], s0: float, s1: float) -> list[dict]:
    """The top-level segments of ``[s0, s1]`` with the host gaps, times in ms from ``s0``."""
    comm = T.comm_calls(events, s0, s1)
    out, t = [], s0

    def add(name, kind, a, b):
        out.append({"name": name, "type": kind, "start_ms": (a - s0) / 1e3, "ms": (b - a) / 1e3})

    for e in T.top_level(events, s0, s1):
        if e.start - t >= MIN_GAP_US:
            add(HOST, "host", t, e.start)
        for name, kind, a, b in _pieces(e, comm):
            if b > max(a, t):
                add(name, kind, max(a, t), b)
        t = max(t, e.end)
    if s1 - t >= MIN_GAP_US:
        add(HOST, "host", t, s1)
    return out


HOST = "host (Python, between operators)"


def _merge(segments: list[dict], same) -> list[dict]:
    out: list[dict] = []
    for s in segments:
        if out and same(out[-1], s):
            out[-1]["ms"] = s["start_ms"] + s["ms"] - out[-1]["start_ms"]
            out[-1]["count"] = out[-1].get("count", 1) + s.get("count", 1)
        else:
            out.append(dict(s))
    return out


def step_timeline(events: list[T.Event], s0: float, s1: float) -> dict:
    """Segments for the timeline picture: the step threads' chain by type (matmul, compute,
    comm, host) and the communication threads' busy intervals, ms from the step's start."""
    chain = _merge(_chain(events, s0, s1), lambda a, b: a["type"] == b["type"])
    busy = T.union((max(e.start, s0), min(e.end, s1)) for e in events
                   if T.is_background_comm(e) and e.end > s0 and e.start < s1)
    return {"step_ms": (s1 - s0) / 1e3,
            "segments": [[round(s["start_ms"], 4), round(s["ms"], 4), s["type"]] for s in chain],
            "comm_threads": [[round((a - s0) / 1e3, 4), round((b - a) / 1e3, 4)]
                             for a, b in busy]}


def critical_path(events: list[T.Event], s0: float, s1: float) -> dict:
    """The step's chain (module docstring): consecutive segments of one name merged, segments
    under :data:`FOLD_SHARE` of the step folded into ``"… n operators"``; the time on the path
    by type and the operators that take most of it."""
    step_ms = (s1 - s0) / 1e3
    chain = _merge(_chain(events, s0, s1), lambda a, b: a["name"] == b["name"])
    by_name: dict[str, float] = {}
    by_type: dict[str, float] = {}
    for s in chain:
        by_name[s["name"]] = by_name.get(s["name"], 0.0) + s["ms"]
        by_type[s["type"]] = by_type.get(s["type"], 0.0) + s["ms"]
    small = step_ms * FOLD_SHARE

    def folded(s):
        return s if s["ms"] >= small else {**s, "name": "(short operators)", "type": "mixed"}

    path = _merge([folded(s) for s in chain],
                  lambda a, b: a["name"] == b["name"] == "(short operators)")
    heaviest = sorted(by_name.items(), key=lambda kv: kv[1], reverse=True)[:8]
    return {"step_s": step_ms / 1e3,
            "segments": [{"name": s["name"], "type": s["type"], "start_ms": round(s["start_ms"], 4),
                          "ms": round(s["ms"], 4), "count": s.get("count", 1)} for s in path],
            "by_type_s": {k: v / 1e3 for k, v in sorted(by_type.items())},
            "heaviest": [{"name": k, "s": v / 1e3, "share": v / step_ms if step_ms else 0.0}
                         for k, v in heaviest]}
