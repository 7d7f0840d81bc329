"""``parallelize(model, ctx, plan="auto")``: tensor parallelism applied from outside, by a plan."""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn

from ..models.gpt import GPT
from ..parallel.data_parallel import DEFAULT_BUCKET_BYTES, GradSync, no_sync
from .gpt_plan import gpt_plan
from .plan import Plan, apply_plan

log = logging.getLogger("ops_transformer")
SUPPORTED = ("ops_transformer.models.GPT",)


class _Groups:
    """What a style may need beyond the context: sibling modules and KV-replica groups."""

    def __init__(self, model: nn.Module, ctx):
        self.model, self.ctx, self._replica = model, ctx, {}

    def module(self, name: str) -> nn.Module:
        return self.model.get_submodule(name)

    def replica_group(self, replicas: int):
        """The group of the ``replicas`` consecutive TP ranks that hold the same KV heads. Every
        rank creates every such group, in the same order (``new_group`` is collective)."""
        if replicas not in self._replica:
            tp = self.ctx.tp_size
            mine = None
            for tp_ranks in self.ctx.mesh.mesh.reshape(-1, tp).tolist():
                for start in range(0, tp, replicas):
                    ranks = tp_ranks[start:start + replicas]
                    group = dist.new_group(ranks)
                    if self.ctx.rank in ranks:
                        mine = group
            self._replica[replicas] = mine
        return self._replica[replicas]


def resolve_plan(model: nn.Module, ctx, plan="auto", attention: str = "auto") -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if plan != "auto":
        raise ValueError(f"plan must be 'auto', a Plan or a dict, got {plan!r}")
    if isinstance(model, GPT):
        return gpt_plan(model.cfg, ctx.tp_size, attention)
    raise ValueError(f"no automatic plan for {type(model).__name__}; supported models: "
                     f"{', '.join(SUPPORTED)} (or pass plan= a Plan / dict)")


def parallelize(model: nn.Module, ctx, plan="auto", *, attention: str = "auto",
                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> nn.Module:
    """Apply tensor parallelism over ``ctx.tp_group`` and data-parallel gradient averaging over
    ``ctx.dp_group`` to ``model`` (in place) and return it.

    Build the dense model with the same RNG seed on every rank first: each rank keeps its slices.
    Afterwards a plain loop — ``loss = model(x, y)[1]; loss.backward(); optimizer.step()`` — is
    correct for any ``dp × tp``, each data-parallel rank feeding its own rows of the global batch.
    The applied plan is ``model.tp_plan``.
    """
    if getattr(model, "tp_plan", None) is not None:
        raise ValueError("this model is already parallelised (model.tp_plan is set)")
    resolved = resolve_plan(model, ctx, plan, attention)
    if ctx.tp_size > 1:
        apply_plan(model, resolved, ctx, _Groups(model, ctx))
    model.tp_plan = resolved
    if ctx.dp_size > 1:
        model._ops_transformer_grad_sync = GradSync(model.parameters(), ctx.dp_group,
                                                    bucket_bytes=bucket_bytes)
    log.info("parallelize: tp=%d dp=%d attention=%s%s", ctx.tp_size, ctx.dp_size,
             resolved.attention, f" ({resolved.reason})" if resolved.reason else "")
    return model


__all__ = ["Plan", "parallelize", "no_sync", "gpt_plan", "resolve_plan"]
