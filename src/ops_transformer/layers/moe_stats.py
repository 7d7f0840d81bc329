"""MoE routing statistics over the global batch (``parallelize(..., moe_statistics="global")``).

By default each MoE layer takes its capacity and its load-balancing loss over the tokens of the
call — on a data- or expert-parallel rank, its own micro-batch (Megatron-LM's default, and what a
rank can know without communicating). One process running the global batch takes them over all
of it, so ``dp × ep > 1`` then differs from one process from the first step (1.4–4.9e-4 on
``moe-tiny``, issue 33). :class:`GlobalRouting` makes them the one process's:

* one all-gather over the ``dp × ep`` group of each rank's ``E`` routed-slot counts and its token
  count (``E + 1`` elements per rank, per MoE layer per forward: ``moe_stats`` in the ledger);
* **capacity**: ``ceil(capacity_factor · N_global · k / E)`` slots per expert, earlier tokens of
  the global batch first — a slot's place in its expert's queue counts the slots the ranks
  before this one (their rows come first in the global batch) routed there;
* **load-balancing loss**: ``f_i`` from the summed counts. ``P_i`` carries the gradient; each rank
  computes ``E · Σ_i f_i · (W · S_i / N_global)`` with ``S_i`` its own sum of expert ``i``'s
  probabilities, whose gradient, averaged over the ``W = dp × ep`` ranks as every gradient is, is
  exactly the one process's, and whose mean over the ranks is the one process's loss.

The tensor-parallel ranks of one data-parallel rank hold the same tokens (the router is
replicated), so they take part in their own ``dp × ep`` group's gather only. Megatron-LM calls the
global variant ``moe_router_load_balancing_type="global_aux_loss"`` (it reduces the counts over
its data-parallel group too).
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from ..models.moe import RoutingStats, capacity_mask, expert_counts
from .mixin import mix_into


class GlobalRouting:
    """Mixed into an MoE layer's class (:func:`use_global_statistics`): :meth:`route` over the
    global batch of ``stats_group`` (module docstring)."""

    stats_group = None
    stats_rank, stats_world = 0, 1

    def route(self, probs, index):
        n, e = index.shape[0], self.n_experts
        mine = torch.cat([expert_counts(index, e), torch.tensor([float(n)], device=index.device)])
        flat = mine.new_empty(self.stats_world * (e + 1))
        C.all_gather_into(flat, mine, self.stats_group, label="moe_stats")
        gathered = flat.view(self.stats_world, e + 1)
        total = gathered.sum(0)
        tokens = int(total[e])  # (a host read, as the capacity's own cumsum needs the limit)
        before = gathered[:self.stats_rank, :e].sum(0).long()
        keep = capacity_mask(index, e, self.capacity_factor, tokens=tokens, before=before)
        self._record(probs, index, keep, counts=total[:e],
                     scale=self.stats_world * n / tokens)
        return keep

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", statistics over the global batch (all-gather of the "
                f"expert counts over dp×ep={self.stats_world})")


def use_global_statistics(model: torch.nn.Module, ctx) -> int:
    """Give every MoE layer of ``model`` (reference or expert-parallel, :class:`RoutingStats`)
    global statistics over ``ctx``'s ``dp × ep`` group, in place; returns how many. Nothing to do
    (0) when ``dp × ep`` is 1."""
    if ctx.dp_ep_size == 1:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, RoutingStats) and not isinstance(module, GlobalRouting):
            mix_into(module, GlobalRouting, "GlobalRouting[{}]", stats_group=ctx.dp_ep_group,
                     stats_rank=ctx.dp_ep_rank, stats_world=ctx.dp_ep_size)
            count += 1
    return count
