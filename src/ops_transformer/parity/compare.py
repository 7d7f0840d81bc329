"""The comparisons of a parity check, in dense coordinates, on rank 0.

* :func:`compare_calls` — per module call, in forward-finish order: its inputs, its outputs and
  the gradients of its outputs, each laid out as :mod:`.layout` infers and gathered over the TP
  group of data rank 0 (collective there; the other ranks take no part);
* :func:`compare_params` — per parameter: the gradient gathered to dense coordinates by
  :func:`~ops_transformer.parallel.sharding.gather_full_state_dict` (collective on every rank), and
  the same for the initial weights.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from ..comm import collectives as C
from ..parallel.sharding import gather_full_state_dict
from ..parallelize.plan import PARAM_STYLES, matches
from .layout import dense_candidates, infer_layout, output_hint
from .noise import bound
from .record import ROOT, Call
from .tolerance import GRAD_FLOOR, Tolerance, difference


def style_of(name: str, plan) -> str | None:
    """The plan styles applied to module ``name`` (a parameter rule shows its parameter)."""
    if plan is None or name == ROOT:
        return None
    found = []
    for pattern, rule in plan.rules.items():
        options = ", ".join(f"{k}={v}" for k, v in rule.items() if k != "style")
        text = rule["style"] + (f"({options})" if options else "")
        if rule["style"] in PARAM_STYLES:
            owner, _, param = pattern.rpartition(".")
            if owner and matches(name, owner):
                found.append(f"{rule['style']}({param})")
        elif matches(name, pattern):
            found.append(text)
    return " + ".join(found) or None


def _rope_tail(name: str, plan) -> int:
    """``mla_kv_a``'s ``rope_dim``: the last features of its output feed this rank's heads
    directly, so their gradient is a partial sum until the style's all-reduce (0 elsewhere)."""
    return next((rule.get("rope_dim", 0) for pattern, rule in (plan.rules.items() if plan else ())
                 if rule["style"] == "mla_kv_a" and matches(name, pattern)), 0)


def _partial_regions(plan) -> list[str]:
    return [p for p, r in (plan.rules.items() if plan else ()) if r["style"] == "reduce_out"]


def _in_partial_region(name: str, regions: list[str]) -> bool:
    parts = name.split(".")
    return any(matches(".".join(parts[:len(r.split("."))]), r) and len(parts) > len(r.split("."))
               for r in regions)


def agree_on_calls(calls: list[Call], group, device=None) -> int | None:
    """Whether every rank of ``group`` recorded the same calls with the same shapes: ``None``, or
    the position of the first call where they differ (collective over ``group``)."""
    codes = [zlib.crc32(repr((c.key, c.paths, [tuple(t.shape) for t in c.inputs + c.outputs],
                              sorted(c.grads))).encode()) for c in calls]
    count = torch.tensor([len(codes), -len(codes)], dtype=torch.int64, device=device)
    C.all_reduce(count, group, op=C.ReduceOp.MAX, label="parity.agree")
    if int(count[0]) != -int(count[1]):
        return min(int(-count[1]), len(codes))
    both = torch.tensor(codes + [-x for x in codes], dtype=torch.int64, device=device)
    C.all_reduce(both, group, op=C.ReduceOp.MAX, label="parity.agree")
    n = len(codes)
    differ = [i for i in range(n) if int(both[i]) != -int(both[n + i])]
    return differ[0] if differ else None


def _compare_tensors(mine, ref_shapes, refs, layout_args, group, floor=0.0, gradient=False,
                     partial_tail=0):
    """``(max abs, max rel, layouts)`` over matching tensors; every rank of ``group`` computes
    the same layouts and joins the same gathers, only rank 0 (which has ``refs``) the numbers."""
    worst_abs = worst_rel = None
    layouts = []
    for i, ref_shape in enumerate(ref_shapes):
        if i >= len(mine) or mine[i] is None:
            continue
        layout = infer_layout(tuple(mine[i].shape), ref_shape, **layout_args)
        layouts.append(layout)
        candidates = dense_candidates(mine[i], layout, group, gradient=gradient,
                                      partial_tail=partial_tail)
        if refs is None or not candidates or refs[i] is None:
            continue
        best = min((difference(c, refs[i], floor) for c in candidates), key=lambda d: d[1])
        worst_abs = best[0] if worst_abs is None else max(worst_abs, best[0])
        worst_rel = best[1] if worst_rel is None else max(worst_rel, best[1])
    return worst_abs, worst_rel, layouts


def _measure(entry: dict, call: Call, ref: Call | None, module: nn.Module, args: dict, group,
             floor: float, style: str | None, rope_tail: int = 0) -> dict:
    """The differences of one call's outputs, inputs and output gradients (collective over
    ``group``; numbers on rank 0 only, where ``ref`` is)."""
    outs = [call.outputs[call.paths.index(p)] if p in call.paths else None
            for p in entry["paths"]]
    out_abs, out_rel, layouts = _compare_tensors(
        outs, entry["outputs"], ref.outputs if ref else None,
        {**args, "hint": output_hint(module)}, group)
    _, in_rel, _ = _compare_tensors(call.inputs, entry["inputs"], ref.inputs if ref else None,
                                    args, group)
    grads = [call.grads.get(p) if has else None for p, has in zip(entry["paths"], entry["grads"])]
    ref_grads = [ref.grads.get(p) for p in entry["paths"]] if ref else None
    # a grad_allreduce module's output feeds this rank's heads only: its gradient is a partial
    # sum by design (the plan sums the parameters' gradients at the end)
    partial = args["partial_region"] or "grad_allreduce" in (style or "")
    _, grad_rel, _ = _compare_tensors(grads, entry["outputs"], ref_grads,
                                      {**args, "hint": output_hint(module),
                                       "partial_region": partial}, group, floor, gradient=True,
                                      partial_tail=rope_tail)
    return {"compared": ", ".join(dict.fromkeys(layout.describe() for layout in layouts)),
            "shape": list(entry["outputs"][0]) if entry["outputs"] else None,
            "max_abs": out_abs, "max_rel": out_rel, "input_rel": in_rel, "grad_rel": grad_rel}


def compare_calls(meta: list[dict], ref_calls: list[Call] | None, calls: list[Call],
                  model: nn.Module, plan, ctx, tol: Tolerance, sequence_parallel: bool,
                  noise: dict | None = None) -> list[dict]:
    """One row per reference call (rank 0; the other ranks of the group return ``[]``), each with
    the bounds it is held to (``noise``: the dense model's 16-bit rounding, :mod:`.noise`)."""
    noise = noise or {}
    mine = {c.key: c for c in calls}
    by_finish = {c.finish: c.key for c in calls}
    regions = _partial_regions(plan)
    refs = {c.key: c for c in ref_calls} if ref_calls is not None else None
    floor = GRAD_FLOOR * max((float(g.abs().max()) for c in ref_calls or ()
                              for g in c.grads.values() if g.numel()), default=0.0)
    rows = []
    for entry in meta:
        key, name = entry["key"], entry["name"]
        call, ref = mine.get(key), refs[key] if refs is not None else None
        row = {"kind": "module", "name": key, "module": name, "style": style_of(name, plan)}
        if call is None:
            rows.append({**row, "status": "not run", "ok": True})
            continue
        args = {"tp_rank": ctx.tp_rank, "tp_size": ctx.tp_size,
                "sequence_parallel": sequence_parallel,
                "partial_region": _in_partial_region(name, regions)}
        found = _measure(entry, call, ref, model if name == ROOT else model.get_submodule(name),
                         args, ctx.tp_group, floor, row["style"], _rope_tail(name, plan))
        if ref is None:
            continue
        bounds = {"bound": bound(noise, ("output", key), tol.output),
                  "input_bound": bound(noise, ("input", key), tol.output),
                  "grad_bound": bound(noise, ("grad", key), tol.grad)}
        out_rel, grad_rel = found["max_rel"], found["grad_rel"]
        ok = (out_rel is None or out_rel <= bounds["bound"]) and \
            (grad_rel is None or grad_rel <= bounds["grad_bound"])
        status = "mismatch" if not ok else "ok" if out_rel is not None else "not compared"
        rows.append({**row, **found, **bounds, "ok": ok, "status": status,
                     "grad_order": call.grad_arrival,
                     "inputs_from": [by_finish[f] for f in call.producers if f in by_finish]})
    return rows


def _dense_grads(model: nn.Module, ctx) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under the dense model's keys: each parameter briefly holds its
    gradient while ``gather_full_state_dict`` (which knows every layer's sharding) gathers it."""
    params = dict(model.named_parameters())
    data = {name: p.data for name, p in params.items()}
    try:
        for p in params.values():
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        return gather_full_state_dict(model, ctx)
    finally:
        for name, p in params.items():
            p.data = data[name]


def owner(param: str) -> str:
    return param.rpartition(".")[0] or ROOT


def compare_params(reference: dict[str, torch.Tensor] | None, model: nn.Module, ctx, plan,
                   tol: float, *, grads: bool, noise: dict | None = None) -> list[dict]:
    """Per parameter of the dense model: the gathered gradient (``grads=True``) or weight of the
    parallel model against ``reference`` (rank 0; collective on every rank)."""
    noise = noise or {}
    with torch.no_grad():
        dense = _dense_grads(model, ctx) if grads else gather_full_state_dict(model, ctx)
    if reference is None:
        return []
    floor = GRAD_FLOOR * max((float(g.abs().max()) for g in reference.values() if g.numel()),
                             default=0.0) if grads else 0.0
    rows = []
    for name, ref in reference.items():
        row = {"kind": "parameter", "name": name, "module": owner(name),
               "style": style_of(owner(name), plan), "shape": list(ref.shape)}
        if name not in dense:
            rows.append({**row, "status": "not compared", "ok": True})
            continue
        try:
            max_abs, rel = difference(dense[name], ref, floor)
        except ValueError as exc:  # a dense shape that differs: the layout is wrong
            rows.append({**row, "status": f"mismatch: {exc}", "ok": False})
            continue
        limit = bound(noise, ("param", name), tol)
        ok = rel <= limit
        rows.append({**row, "max_abs": max_abs, "max_rel": rel, "bound": limit, "ok": ok,
                     "status": "ok" if ok else "mismatch"})
    return rows
