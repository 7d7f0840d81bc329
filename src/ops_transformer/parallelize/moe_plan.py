"""Expert parallelism in plans: the check ``parallelize`` makes before splitting experts over
``ep``, and the plans of Hugging Face MoE families.

Hugging Face MoE blocks (``transformers`` ≥ 5) share one shape: a router module ``gate`` returning
``(logits, top_k_weights, top_k_index)`` and an experts module with 3-D ``gate_up_proj`` and
``down_proj`` called as ``experts(x, top_k_index, top_k_weights)``. The plan keeps the router
(replicated, so ``output_router_logits`` and Hugging Face's auxiliary loss still work) and swaps the
experts module for :class:`~ops_transformer.layers.moe.ParallelExperts` (style ``moe``). Attention,
embedding and head follow the Llama plan; a shared expert (Qwen2-MoE) and dense layers are
column→row like Llama's MLP.
"""

from __future__ import annotations

from torch import nn

from ..layers.moe import check_experts_divide
from .plan import Plan

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "phimoe")


def n_experts_of(model: nn.Module) -> int:
    """Experts per MoE layer: ``cfg.n_experts`` of our GPT, ``num_local_experts`` or
    ``num_experts`` of a Hugging Face config; 0 for a dense model."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "n_experts"):
        return cfg.n_experts
    config = getattr(model, "config", None)
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


def check_expert_parallel(model: nn.Module, plan: Plan, ctx) -> None:
    """``ep > 1`` needs expert layers in the plan and ``n_experts`` divisible by ``ep``."""
    n_experts = n_experts_of(model)
    if not any(rule["style"] == "moe" for rule in plan.rules.values()):
        raise ValueError(f"ep ({ctx.ep_size}) > 1 needs a mixture-of-experts model, but "
                         f"{type(model).__name__} has no expert layers (n_experts = {n_experts}); "
                         f"use dp for plain data parallelism")
    check_experts_divide(n_experts, ctx.ep_size)


def hf_moe_plan(model: nn.Module, tp: int, loss_parallel: bool = False, **options) -> Plan:
    """Mixtral, Qwen2-MoE, Qwen3-MoE: the Llama plan's attention, embedding and head; per layer,
    the experts (``moe``), a shared expert or a dense MLP (column→row)."""
    from .hf_plans import _prefix, llama_plan

    base, p = llama_plan(model, tp, loss_parallel, **options), _prefix(model)  # vocab=, profile=
    mlp = {k[len(p + "layers.*.mlp"):]: v for k, v in base.rules.items()
           if k.startswith(p + "layers.*.mlp")}  # "", ".gate_proj", ... → rule
    rules = {k: v for k, v in base.rules.items() if not k.startswith(p + "layers.*.mlp")}
    per_layer = []
    for layer in model.get_submodule(p + "layers"):
        block, rule = layer.mlp, {}
        if hasattr(block, "experts"):
            rule[".experts"] = "moe"
            if hasattr(block, "shared_expert"):
                rule.update({".shared_expert" + k: v for k, v in mlp.items()})
        else:
            rule.update(mlp)
        per_layer.append(rule)
    uniform = all(r == per_layer[0] for r in per_layer)
    head = {k: rules.pop(k) for k in ("lm_head",) if k in rules}  # the layers first, for reading
    for i, layer_rules in enumerate(per_layer[:1] if uniform else per_layer):
        name = f"{p}layers.{'*' if uniform else i}.mlp"
        rules.update({name + k: v for k, v in layer_rules.items()})
    rules.update(head)
    return Plan(rules=rules, attention="heads", vocab=base.vocab,
                reason=f"Hugging Face {model.config.model_type} plan (experts over ep, "
                       f"each column→row over tp); {base.reason.split('; ', 1)[-1]}")
