"""Expert parallelism in plans: the check ``parallelize`` makes before splitting experts over
``ep``. (The plans of Hugging Face MoE families, :func:`~.hf_plans.hf_moe_plan`, live with the
other Hugging Face plans.)
"""

from __future__ import annotations

from torch import nn

from ..layers.moe import check_experts_divide
from .plan import Plan


def n_experts_of(model: nn.Module) -> int:
    """Experts per MoE layer: ``cfg.n_experts`` of our GPT, ``num_local_experts`` or
    ``num_experts`` of a Hugging Face config; 0 for a dense model."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "n_experts"):
        return cfg.n_experts
    config = getattr(model, "config", None)
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


def check_expert_parallel(model: nn.Module, plan: Plan, ctx) -> None:
    """``ep > 1`` needs expert layers in the plan and ``n_experts`` divisible by ``ep`` (nothing to
    check at ``ep = 1``)."""
    if ctx.ep_size == 1:
        return
    n_experts = n_experts_of(model)
    if not any(rule["style"] == "moe" for rule in plan.rules.values()):
        raise ValueError(f"ep ({ctx.ep_size}) > 1 needs a mixture-of-experts model, but "
                         f"{type(model).__name__} has no expert layers (n_experts = {n_experts}); "
                         f"use dp for plain data parallelism")
    check_experts_divide(n_experts, ctx.ep_size)
