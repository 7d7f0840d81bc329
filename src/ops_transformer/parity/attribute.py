"""Which module a parity failure is blamed on, and why (pure: rows in, a verdict out).

In this order, the first that applies:

1. **an error** — the module running when it was raised (the innermost);
2. **initial weights** that differ — the parameter's module (``build_model`` did not give every
   rank the same model);
3. **the forward** — the first module, in the order modules finish their forward, whose output
   exceeds its bound (the row's ``bound``: the precision's tolerance, in 16 bits at least a
   multiple of the dense model's own rounding there, :mod:`.noise`). If that module's *inputs* already differ, the difference arose in code
   of the enclosing module that is not a module itself (the attention core between Q/K/V and the
   output projection, a reshape into heads): the nearest enclosing module whose inputs still
   match is named;
4. **the backward** — in the order gradients arrive: the first module output whose gradient
   differs is named through the module whose backward computed it (the innermost module that
   took that output as input, else the enclosing one); a parameter gradient that differs while
   its module's output gradient matches names that module (its own weight gradient, or a partial
   gradient that was not summed);
5. the loss, the logits, the losses of later steps (no module to name).
"""

from __future__ import annotations

from .record import ROOT


def _over(value, bound) -> bool:
    return value is not None and bound is not None and value > bound


def _parent(rows: list[dict], i: int) -> int | None:
    """The row of the call that encloses row ``i`` (the parent module's next finishing call)."""
    name = rows[i]["module"]
    while name != ROOT:
        name = name.rpartition(".")[0] or ROOT
        for j in range(i + 1, len(rows)):
            if rows[j]["module"] == name and rows[j].get("max_rel") is not None:
                return j
    return None


def _forward(rows: list[dict]):
    first = next((i for i, r in enumerate(rows) if _over(r.get("max_rel"), r.get("bound"))), None)
    if first is None:
        return None
    culprit, child = first, None
    while _over(rows[culprit].get("input_rel"), rows[culprit].get("input_bound")):
        parent = _parent(rows, culprit)
        if parent is None:
            break
        culprit, child = parent, culprit
    r = rows[culprit]
    if child is None:
        reason = f"its output differs from the dense model's (relative {r['max_rel']:.1e} > " \
                 f"{r['bound']:.1e})"
    else:
        reason = f"the input of {rows[child]['name']} already differs (relative " \
                 f"{rows[child]['input_rel']:.1e}): it is computed in {r['name']}'s own code"
    return r["module"], r.get("style"), reason, rows[first]["name"]


def _innermost(consumers: list[dict]) -> list[dict]:
    """The consumers that contain no other consumer."""
    def inside(a: str, b: str) -> bool:  # module a strictly inside module b
        return a != b and (b == ROOT or a.startswith(b + "."))

    return [c for c in consumers
            if not any(inside(o["module"], c["module"]) for o in consumers)]


def _backward(rows: list[dict], params: list[dict]):
    events = []
    order = {}
    for i, r in enumerate(rows):
        if r.get("grad_order") is not None:
            order.setdefault(r["module"], r["grad_order"])
            if _over(r.get("grad_rel"), r.get("grad_bound")):
                events.append((r["grad_order"], 0, i))
    for p in params:
        if not p["ok"]:
            events.append((order.get(p["module"], float("inf")), 1, p))
    if not events:
        return None
    _, kind, what = min(events, key=lambda e: (e[0], e[1]))
    if kind == 1:
        style = next((r.get("style") for r in rows if r["module"] == what["module"]),
                     what.get("style"))
        rel = what.get("max_rel")
        return what["module"], style, (f"the gradient of {what['name']} differs"
                                       + (f" (relative {rel:.1e} > {what['bound']:.1e})"
                                          if rel else "")
                                       + " while its output's gradient matches"), what["module"]
    r = rows[what]
    consumers = _innermost([c for c in rows if r["name"] in c.get("inputs_from", [])])
    if consumers:
        blamed = consumers[-1]  # rows are in finish order: the last one's backward ran first
        others = [c["name"] for c in consumers[:-1]]
        how = f"by the backward of {blamed['name']}, which takes it as input" + \
            (f" (as do {', '.join(others)})" if others else "")
    else:
        parent = _parent(rows, what)
        blamed = rows[parent] if parent is not None else r
        how = f"in the backward of {blamed['name']}'s own code"
    reason = (f"the gradient of {r['name']}'s output differs (relative {r['grad_rel']:.1e} > "
              f"{r['grad_bound']:.1e}): computed {how}")
    return blamed["module"], blamed.get("style"), reason, r["name"]


def attribute(rows: list[dict], params: list[dict], weights: list[dict],
              error: dict | None = None):
    """``(module, style, reason, first differing row)`` of the failure, or ``None``."""
    if error is not None:
        return (error["module"], error.get("style"),
                f"{error['phase']} raised {error['type']}: {error['message']}", error["module"])
    bad = next((w for w in weights if not w["ok"]), None)
    if bad is not None:
        return (bad["module"], bad.get("style"),
                f"the initial weight {bad['name']} differs from the dense model's: build_model "
                f"must return the same model on every rank (seed it)", bad["name"])
    return _forward(rows) or _backward(rows, params)
