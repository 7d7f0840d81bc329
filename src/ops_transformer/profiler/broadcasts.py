"""``implicit_broadcast``: a statistic of this rank's slice broadcast back over a sharded dimension
(see :mod:`.diagnose`; the tracking rules are :mod:`.shards`).

Inside a tensor-parallel region an activation holds ``n/tp`` of a dimension's ``n`` entries (the
features after a column-parallel linear, the tokens under sequence parallelism). A model written
for one device that reduces over that dimension and combines the result element-wise with the
activation — ``h * rsqrt(h.pow(2).mean(-1, keepdim=True))``, a norm or a softmax over it — computes
the statistic of the local slice and broadcasts it back over the slice, where the dense model
means all ``n``: a silent numerical change, and a pass over the shard spent computing it. The
seed calls unaligned dimensions causing implicit broadcasts its most common performance trap.

:func:`implicit_broadcasts` runs a callable (a forward, or a whole step) on this rank under a
:class:`~.shards.ShardTracker` and returns one diagnostic per module pattern, operation and pair
of shapes; :func:`broadcast_checks` does it on every rank and returns the union, the same on every
rank.
"""

from __future__ import annotations

import re

from .profile import gather_objects, world_group
from .shards import NORMS, SOFTMAXES, ShardTracker

CODE = "implicit_broadcast"


def _pattern(module: str) -> str:
    """``layers.3.mlp`` → ``layers.*.mlp`` (one finding per repeated module)."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", module)


def _shape(shape) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ")"


def _diagnostic(op: str, modules: list[str], shapes, dim: int, local: int, full: int) -> dict:
    a, b = (_shape(s) for s in shapes)
    where = ", ".join(modules[:3]) + (f" (+{len(modules) - 3} more)" if len(modules) > 3 else "")
    if op in NORMS or op in SOFTMAXES:
        what = (f"{op} over dim {dim} of a tensor of shape {a}, which the plan shards "
                f"({local} of {full} on this rank): its statistic (shape {b}) covers the local "
                f"slice only")
    else:
        what = (f"{op} broadcasts a tensor of shape {b} over one of shape {a} along dim {dim}, "
                f"which the plan shards ({local} of {full} on this rank): the size-1 operand is a "
                f"statistic computed over this rank's slice")
    return {"code": CODE, "severity": "error", "where": where,
            "message": (f"{what}, where the model means all {full} — a silent numerical change "
                        f"against the dense model, and a pass over the shard spent computing it "
                        f"({len(modules)}× per forward)"),
            "suggestion": (f"compute the statistic over the whole dimension: reduce its partial "
                           f"sums over the TP group first (e.g. the sum of squares through "
                           f"ops_transformer.reduce_from_tp_region, then divide by {full}); or "
                           f"keep {_pattern(modules[0])} outside the tensor-parallel region (a "
                           f"gathered output, gather_output=True / the gather_in style, before "
                           f"it)"),
            "estimated_saving_s": None}


def implicit_broadcasts(model, ctx, run) -> list[dict]:
    """Run ``run()`` (e.g. a forward of ``model``, or a training step) on this rank and return the
    implicit broadcasts over sharded dimensions it made, as diagnostic dicts (one per module
    pattern, operation and shapes; a recomputed forward counts once)."""
    with ShardTracker(model, ctx.tp_size) as tracker:
        run()
    grouped: dict[tuple, dict] = {}
    for f in tracker.findings:
        key = (_pattern(f["module"]), f["op"], str(f["shapes"]), f["dim"])
        entry = grouped.setdefault(key, {**f, "modules": []})
        if f["module"] not in entry["modules"]:
            entry["modules"].append(f["module"])
    return [_diagnostic(f["op"], f["modules"], f["shapes"], f["dim"], f["local"], f["full"])
            for f in grouped.values()]


def broadcast_checks(model, ctx, step_fn) -> list[dict]:
    """Every rank: one step of ``step_fn`` watched; the union of every rank's findings."""
    found = gather_objects(implicit_broadcasts(model, ctx, step_fn), world_group(ctx), ctx.device)
    union: list[dict] = []
    for rank in found:
        union += [d for d in rank if d not in union]
    return union
