"""Overlap as a transformation of a plan: each region's entry and exit collective in chunks (F4).

:func:`overlap_plan` rewrites a tensor-parallel plan (after :func:`~.sequence_plan.sequence_parallel_plan`,
if any) rule by rule into its chunked variant — the plan stays data, and prints which rule
overlaps what:

=============================== ========================================================================
rule                            chunked rule (options ``overlap``, ``chunks``)
=============================== ========================================================================
``region`` with column children ``region_chunked`` (``columns``: the children it computes as one
(Q/K/V; gate/up)                collective matmul, their input-gradient all-reduce in chunks); each
                                child ``colwise_fed``
``colwise`` reducing its own    ``colwise_chunked``: the same, the layer its own region
input gradient
``rowwise`` (split input)       ``rowwise_chunked``: the row matmul and its all-reduce in chunks
``sequence_region`` with column ``sequence_region_chunked``: the all-gather in chunks, each multiplied
children                        while the next arrives; children ``colwise_fed``
``colwise_sequence``            ``colwise_sequence_chunked``
``rowwise_sequence``            ``rowwise_sequence_chunked``: the reduce-scatter in chunks
``moe``                         ``moe_chunked``: dispatch and combine all-to-alls in chunks
=============================== ========================================================================

Everything else (the embedding and head, strategy B, gathered outputs) keeps its rule. With
``overlap="chunked"`` every chunked region runs ``chunks`` chunks; with ``"auto"`` each decides
at its first call of each size whether chunks pay on the agreed profile
(:class:`~ops_transformer.layers.overlap_regions.OverlapPolicy`,
:func:`~ops_transformer.planner.overlap.choose_chunks`), and records why.
"""

from __future__ import annotations

import dataclasses

ENTRIES = {"region": "region_chunked", "sequence_region": "sequence_region_chunked"}
SIMPLE = {"rowwise_sequence": "rowwise_sequence_chunked", "moe": "moe_chunked"}
_FED_DROPS = ("reduce_input_grad", "gather_output")  # colwise options colwise_fed does not take


def _is_fed_column(rule: dict) -> bool:
    return (rule["style"] == "colwise" and rule.get("reduce_input_grad", True) is False
            and not rule.get("gather_output"))


def region_columns(rules: dict) -> dict[str, list[str]]:
    """``{region pattern: [child names]}``: the column children (no input-gradient all-reduce of
    their own, no gathered output) of each ``region`` / ``sequence_region`` rule."""
    out = {}
    for pattern, rule in rules.items():
        if rule["style"] not in ENTRIES:
            continue
        names = [child[len(pattern) + 1:] for child, r in rules.items()
                 if child.startswith(pattern + ".") and "." not in child[len(pattern) + 1:]
                 and _is_fed_column(r)]
        if names:
            out[pattern] = names
    return out


def _chunked_rule(pattern: str, rule: dict, columns: dict, fed: set, extra: dict) -> dict:
    style = rule["style"]
    if pattern in columns:
        return {**rule, "style": ENTRIES[style], "columns": columns[pattern], **extra}
    if pattern in fed:
        return {**{k: v for k, v in rule.items() if k not in _FED_DROPS}, "style": "colwise_fed"}
    if style == "colwise" and rule.get("reduce_input_grad", True) and not rule.get("gather_output"):
        return {**{k: v for k, v in rule.items() if k not in _FED_DROPS},
                "style": "colwise_chunked", **extra}
    if style == "rowwise":
        return {**rule, "style": "rowwise_chunked", **extra}
    if style == "colwise_sequence" and not rule.get("gather_output"):
        options = {k: v for k, v in rule.items() if k != "gather_output"}
        return {**options, "style": "colwise_sequence_chunked", **extra}
    if style in SIMPLE:
        return {**rule, "style": SIMPLE[style], **extra}
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
