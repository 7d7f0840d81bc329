"""Overlap as a transformation of a plan: each region's entry and exit collective in chunks (F4).

:func:`overlap_plan` rewrites a tensor-parallel plan (after :func:`~.sequence_plan.sequence_parallel_plan`,
if any) rule by rule into its chunked variant — the plan stays data, and prints which rule
overlaps what:

=============================== ========================================================================
rule                            chunked rule (options ``overlap``, ``chunks`` set on it)
=============================== ========================================================================
``region`` with column children ``region(columns=…)``: the children it computes as one collective
(Q/K/V; gate/up)                matmul, their input-gradient all-reduce (``entry="sequence"``: the
                                all-gather, each chunk multiplied while the next arrives) in chunks;
                                each child ``colwise(fed=True)``
``colwise`` reducing its own    the same, the layer its own entry (``entry="sequence"`` too)
input gradient
``rowwise``                     the row matmul and its all-reduce (``exit="reduce_scatter"``: its
                                reduce-scatter) in chunks
``moe``                         dispatch and combine all-to-alls in chunks
=============================== ========================================================================

A re-gathering entry (``regather=True``) is chunked like the others, its ``regather`` option kept
(its op keeps only this rank's share and all-gathers it again in backward); a rule that sets
``overlap`` itself keeps it. Everything else (the embedding and head, strategy B, gathered outputs) keeps its rule. With
``overlap="chunked"`` every chunked region runs ``chunks`` chunks; with ``"auto"`` each decides
at its first call of each size whether chunks pay on the agreed profile
(:class:`~ops_transformer.layers.overlap_regions.OverlapPolicy`,
:func:`~ops_transformer.planner.overlap.choose_chunks`), and records why.
"""

from __future__ import annotations

import dataclasses

_OWN_DROPS = ("reduce_input_grad", "gather_output")  # colwise options its own entry op replaces
# ... and a fed column, whose region's op keeps what regather would keep
_FED_DROPS = _OWN_DROPS + ("regather",)


def _is_fed_column(rule: dict) -> bool:
    # (a re-gathering region's children reduce no input gradient either: its entry does)
    return (rule["style"] == "colwise"
            and (rule.get("reduce_input_grad", True) is False or rule.get("regather", False))
            and not rule.get("gather_output") and rule.get("entry", "copy") == "copy")


def region_columns(rules: dict) -> dict[str, list[str]]:
    """``{region pattern: [child names]}``: the column children (no input-gradient all-reduce of
    their own, no gathered output) of each ``region`` rule."""
    out = {}
    for pattern, rule in rules.items():
        if rule["style"] != "region":
            continue
        names = [child[len(pattern) + 1:] for child, r in rules.items()
                 if child.startswith(pattern + ".") and "." not in child[len(pattern) + 1:]
                 and _is_fed_column(r)]
        if names:
            out[pattern] = names
    return out


def _chunked_rule(pattern: str, rule: dict, columns: dict, fed: set, extra: dict) -> dict:
    style = rule["style"]
    if rule.get("fed") or "overlap" in rule or "chunks" in rule:
        return rule  # a rule's own overlap / chunks win
    if pattern in columns:
        return {**rule, "columns": columns[pattern], **extra}
    if pattern in fed:
        return {**{k: v for k, v in rule.items() if k not in _FED_DROPS}, "fed": True}
    if style == "colwise" and rule.get("reduce_input_grad", True) and not rule.get("gather_output"):
        return {**{k: v for k, v in rule.items() if k not in _OWN_DROPS}, **extra}
    if style in ("rowwise", "moe"):
        return {**rule, **extra}
    return rule


def overlap_plan(plan, overlap: str, chunks: int):
    """The chunked variant of ``plan`` (module docstring); ``overlap`` ``"chunked"`` or
    ``"auto"``, ``chunks`` the chunks (at most, for ``auto``)."""
    if overlap not in ("chunked", "auto"):
        raise ValueError(f"overlap_plan: overlap must be 'chunked' or 'auto', got {overlap!r}")
    columns = region_columns(plan.rules)
    fed = {f"{region}.{name}" for region, names in columns.items() for name in names}
    extra = {"overlap": overlap, "chunks": chunks}
    rules = {pattern: _chunked_rule(pattern, rule, columns, fed, extra)
             for pattern, rule in plan.rules.items()}
    if rules == plan.rules:
        return plan
    how = (f"{chunks} chunks" if overlap == "chunked" else
           f"up to {chunks} chunks where the cost model says they pay, per region and size")
    return dataclasses.replace(plan, rules=rules, reason=(plan.reason + "; " if plan.reason else "")
                               + f"overlap {overlap}: {how}")
