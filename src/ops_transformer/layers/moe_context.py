"""MoE routing statistics with the sequence split over ``cp`` ranks (SPEC F9 × F18).

One process takes an MoE layer's capacity and load-balancing loss over its whole micro-batch,
flattened row by row: a token-slot's place in its expert's queue counts every slot of an earlier
row and of the earlier tokens of its own row. Under context parallelism a rank holds chunks ``r``
and ``2·cp−1−r`` of every row (:func:`~.context_attention.shard_sequence`), so the slots before
one of its tokens sit on every ``cp`` rank, interleaved with its own. :class:`ContextRouting`
makes the statistics the one process's:

* one all-gather over the ``cp`` group of each rank's routed-slot counts **per row, chunk and
  expert** (``b·2·E`` elements) and its sums of the router probabilities (``E``): label
  ``cp.moe_stats``, per MoE layer per forward. From them every rank knows each chunk's counts in
  the micro-batch's order, and a slot's queue position is the exclusive prefix sum over the
  ``(row, chunk)`` pairs before its own plus its place inside its chunk;
* under ``moe_statistics="global"`` (:class:`~.moe_stats.GlobalRouting` already mixed in, over
  ``dp × ep``) the micro-batch's ``E`` counts and its token count are then gathered over
  ``dp × ep`` as there (label ``moe_stats``), and earlier micro-batches come first;
* the **load-balancing loss** ``E · Σ_i f_i · P_i``: ``f`` from the summed counts; its value is
  the micro-batch's (``P`` from the gathered probability sums, so every ``cp`` rank reports the
  same), and its gradient flows through this rank's own probabilities, scaled by
  ``cp · W · n_cp / N`` (``W = dp × ep`` ranks under global statistics, else 1; ``N`` the tokens
  the statistics are over) so that averaged over ``dp × ep × cp`` — as every dense gradient is —
  it is the one process's. The model adds it after the cross-entropy's own cp normalisation
  (:class:`~ops_transformer.parallelize.context_plan.ContextParallelGPT`).

Megatron-LM's MoE under CP reduces its load-balancing statistics over the ``tp × cp`` group as
well (its ``moe_router_load_balancing_type`` with CP); the token-order capacity is ours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import collectives as C
from ..models.moe import RoutingStats, capacity_mask, expert_capacity
from .context_attention import head_tail_chunks
from .mixin import mix_into
from .moe_stats import GlobalRouting


class ContextRouting:
    """Mixed into an MoE layer's class (:func:`use_context_statistics`): :meth:`route` over the
    whole rows of this rank's ``cp`` group (module docstring). ``switch``: the model's
    :class:`~ops_transformer.parallelize.context_plan.CoreSwitch` (off while ``generate`` runs
    whole sequences on every rank: plain statistics then)."""

    cp_group, cp_rank, cp_size, switch = None, 0, 1, None
    _rows = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._rows = x.shape[0]  # (b, s/cp, h): b rows of this rank's two chunks
        return super().forward(x)

    def route(self, probs, index):
        if not self.switch.on:
            keep = capacity_mask(index, self.n_experts, self.capacity_factor)
            self._record(probs, index, keep)
            return keep
        e, cp, rows = self.n_experts, self.cp_size, self._rows
        n, k = index.shape
        slots = index.view(rows, 2, (n // (2 * rows)) * k)  # (b, 2 chunks, c·k), token-major
        one_hot = F.one_hot(slots, e)  # (b, 2, c·k, E)
        mine = torch.cat([one_hot.sum(2).flatten().float(), probs.detach().sum(0)])
        flat = mine.new_empty(cp * mine.numel())
        C.all_gather_into(flat, mine, self.cp_group, label="cp.moe_stats")
        gathered = flat.view(cp, -1)
        per_chunk = mine.new_zeros(rows, 2 * cp, e)  # (b, 2·cp, E) in the rows' order
        for r in range(cp):
            per_chunk[:, list(head_tail_chunks(r, cp))] = gathered[r, :rows * 2 * e].view(
                rows, 2, e)
        prob_sums = gathered[:, rows * 2 * e:].sum(0)  # (E,) over the cp group's tokens
        counts, tokens = per_chunk.sum((0, 1)), n * cp
        total, before, world = counts, counts.new_zeros(e), 1
        if isinstance(self, GlobalRouting) and self.stats_world > 1:  # earlier micro-batches
            total, before, tokens = self._global_counts(counts, tokens)
            world = self.stats_world
        keep = None
        if self.capacity_factor is not None:
            earlier = (per_chunk.flatten(0, 1).cumsum(0) - per_chunk.flatten(0, 1)).view(
                rows, 2 * cp, e)[:, list(head_tail_chunks(self.cp_rank, cp))]  # (b, 2, E)
            position = (one_hot.cumsum(2) * one_hot).sum(-1) - 1  # inside its chunk
            position = position + (earlier + before).long().gather(-1, slots)
            limit = expert_capacity(tokens, k, e, self.capacity_factor)
            keep = (position < limit).view(n, k)
        f = (total / total.sum()).to(probs.dtype)
        value = e * (f * prob_sums.to(probs.dtype)).sum() * (world / tokens)
        graph = e * (f * probs.sum(0)).sum() * (cp * world / tokens)
        self.aux_loss = value + (graph - graph.detach())
        self.dropped = index.new_zeros(()) if keep is None else (~keep).sum()
        self.slots = index.numel()
        return keep

    def _global_counts(self, counts, tokens):
        """``(counts, before, tokens)`` over the ``dp × ep`` micro-batches
        (:class:`~.moe_stats.GlobalRouting`'s gather, of this ``cp`` group's whole rows)."""
        e = self.n_experts
        mine = torch.cat([counts, counts.new_tensor([float(tokens)])])
        flat = mine.new_empty(self.stats_world * (e + 1))
        C.all_gather_into(flat, mine, self.stats_group, label="moe_stats")
        gathered = flat.view(self.stats_world, e + 1)
        total = gathered.sum(0)
        return total[:e], gathered[:self.stats_rank, :e].sum(0), int(total[e])

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", statistics over the cp={self.cp_size} group's whole "
                f"rows (all-gather cp.moe_stats)")


def use_context_statistics(model: torch.nn.Module, ctx, switch) -> int:
    """Give every MoE layer of ``model`` (:class:`RoutingStats`) statistics over its ``cp``
    group's whole rows (and, where :class:`~.moe_stats.GlobalRouting` is mixed in, over
    ``dp × ep``), in place; returns how many. Nothing to do (0) at ``cp = 1``."""
    if ctx.cp_size == 1:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, RoutingStats) and not isinstance(module, ContextRouting):
            mix_into(module, ContextRouting, "ContextRouting[{}]", cp_group=ctx.cp_group,
                     cp_rank=ctx.cp_rank, cp_size=ctx.cp_size, switch=switch)
            count += 1
    return count
