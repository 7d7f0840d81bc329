"""Sequence parallelism as a transformation of a tensor-parallel plan (SPEC F4, F7).

:func:`sequence_parallel_plan` turns a Megatron-layout plan (``attention="heads"``) into its
sequence-parallel variant, rule by rule, for the reference GPT and Hugging Face GPT-2, Llama,
Mistral and Qwen2 — the plans stay data, and the variant prints and serialises like any plan:

================================ ==================================================================
TP rule inside the layers        sequence-parallel rule
================================ ==================================================================
``region`` (Q/K/V, gate/up share ``region(entry="sequence")``: all-gather the sequence on entry
one input)                       (backward: reduce-scatter), replacing the backward all-reduce
``colwise`` reducing its own     ``colwise(entry="sequence")``: the column layer behind an all-gather of
input gradient (GPT-2's c_attn)  the sequence, no input-gradient all-reduce
``rowwise``                      ``rowwise(exit="reduce_scatter")``: :class:`SequenceParallelRowLinear`
                                 (reduce-scatter instead of all-reduce)
``moe``                          ``moe(sequence=True)``: the layer on the gathered sequence
(added) first layer              ``sequence(kind="scatter")``: keep this rank's slice of its input
(added) norms in each layer      ``sequence(kind="partial")``: gradients summed over TP once per step
(added) final norm               ``sequence(kind="gather")``: runs on the slice, output all-gathered for
                                 the LM head
================================ ==================================================================

The embedding and LM head keep their TP rules. The styles are in :mod:`.styles`; their regions
(:mod:`ops_transformer.layers.regions`) name their collectives in ``print(model)``.

``sequence_parallel="regather"`` is the re-gathering variant
(:mod:`ops_transformer.layers.sequence_regather`, Megatron-LM's layout): the same plan with
``regather=True`` on the sequence entries (the entry keeps only this rank's share) and on the
column layers they feed (their inputs are not kept: backward all-gathers the share again, once per
region).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..layers.regions import FullSequenceRegion
from ..layers.sequence_parallel import is_partial
from ..models.hf import DECODER_LAYOUTS, decoder_layout, model_type
from ..parallel.sharding import shard_spec


def sequence_parallel_layout(model: nn.Module) -> tuple[str, str]:
    """``(layers, final norm)`` module names of a model sequence parallelism supports."""
    layout = decoder_layout(model)
    if layout is None:
        kind = model_type(model)
        raise ValueError(f"sequence_parallel=True supports the reference GPT and Hugging Face "
                         f"{', '.join(DECODER_LAYOUTS)} models; got {type(model).__name__}"
                         + (f" (model_type {kind!r})" if kind else ""))
    return layout


def _transform(pattern: str, rule: dict, regather: bool = False) -> dict:
    # no padded sequence-parallel layers: a width that does not divide by tp is refused by them
    rule = {k: v for k, v in rule.items() if k != "pad"}
    style, again = rule["style"], {"regather": True} if regather else {}
    if style == "region":
        return {**rule, "entry": "sequence", **again}
    if style == "rowwise":
        return {**rule, "exit": "reduce_scatter"}
    if style == "colwise" and rule.get("gather_output"):
        raise ValueError(f"sequence parallelism cannot combine with the gathered output of plan "
                         f"rule {pattern!r}")
    options = {k: v for k, v in rule.items() if k != "reduce_input_grad"}
    if style == "colwise" and rule.get("reduce_input_grad", True):
        return {**options, "entry": "sequence", **again}
    if style == "colwise" and regather:  # fed by a region entry
        return {**options, **again}
    if style == "moe":  # on the whole sequence (layers.regions.FullSequenceRegion)
        return {**rule, "sequence": True}
    if style in ("colwise", "attrs"):
        return rule
    raise ValueError(f"sequence parallelism has no variant of style {style!r} (plan rule "
                     f"{pattern!r})")


def is_sequence_parallel(plan) -> bool | str:
    """Whether ``plan`` is sequence-parallel: ``"regather"`` for the re-gathering variant."""
    rules = plan.rules.values() if plan is not None else ()
    if not any(r["style"] == "sequence" and r.get("kind") == "scatter" for r in rules):
        return False
    return "regather" if any(r.get("regather") for r in plan.rules.values()) else True


def sequence_parallel_plan(plan, model: nn.Module, regather: bool = False):
    """The sequence-parallel variant of a tensor-parallel ``plan`` for ``model`` (see the module
    docstring); ``regather``: the re-gathering one. The attention must be head-parallel with a
    row-parallel output (``heads``)."""
    if plan.attention != "heads":
        raise ValueError(f"sequence_parallel=True needs attention='heads' (head-parallel with a "
                         f"row-parallel output projection); the plan has attention="
                         f"{plan.attention!r}, whose collectives have no sequence-parallel form")
    layers, final_norm = sequence_parallel_layout(model)
    inside = layers + "."
    rules = {pattern: (_transform(pattern, rule, regather) if pattern.startswith(inside)
                       else rule)
             for pattern, rule in plan.rules.items()}
    parts = [p[len(inside):].split(".", 1) for p in plan.rules if p.startswith(inside)]
    targeted = {rest[1] for rest in parts if len(rest) == 2}  # names inside one layer
    whole = tuple(p[len(inside):].split(".", 1)[1] + "." for p, r in plan.rules.items()
                  if p.startswith(inside) and "." in p[len(inside):] and r["style"] == "moe")
    first = model.get_submodule(layers + ".0")
    rules[layers + ".0"] = {"style": "sequence", "kind": "scatter"}
    for name, module in first.named_modules():
        if whole and name.startswith(whole):  # an MoE layer runs on the whole sequence
            continue
        if name and name not in targeted and any(True for _ in module.parameters(recurse=False)):
            rules[f"{layers}.*.{name}"] = {"style": "sequence", "kind": "partial"}
    rules[final_norm] = {"style": "sequence", "kind": "gather"}
    return dataclasses.replace(plan, rules=rules,
                               reason=(plan.reason + "; " if plan.reason else "")
                               + ("sequence parallel (regather)" if regather
                                  else "sequence parallel"))


def check_partial_marked(model: nn.Module) -> None:
    """After a sequence-parallel plan is applied: every replicated parameter inside the layers and
    the final norm sees only this rank's tokens, so each must be marked for the TP sum (an internal
    invariant: a plan rule missing would silently leave a partial gradient)."""
    layers, final_norm = sequence_parallel_layout(model)
    whole = tuple(n + "." for n, m in model.named_modules() if isinstance(m, FullSequenceRegion))
    for name, p in model.named_parameters():
        inside = name.startswith(layers + ".") or name.startswith(final_norm + ".")
        if whole and name.startswith(whole):  # run on every token: a complete gradient
            continue
        if inside and shard_spec(p) is None and not is_partial(p):
            raise AssertionError(f"sequence parallelism: replicated parameter {name} is used on "
                                 f"a share of the tokens but its gradient is not summed over TP")
