"""Vocabulary-parallel LM head: sharded logits and the vocab-parallel loss."""

from __future__ import annotations

import torch
from torch import nn

from ..comm.primitives import gather_from_tp_region
from ..parallel.sharding import ShardSpec, gather_full, set_shard_spec
from .linear import linear_with_grad_all_reduce
from .loss import vocab_parallel_cross_entropy


class VocabParallelLMHead(nn.Module):
    """``logits = x Wᵀ`` with ``W [V, d]`` split along the vocabulary, and its loss.

    ``forward(x, targets)`` returns ``(logits, loss)`` like the dense head it replaces:

    * with ``targets``: this rank's logit columns ``(…, V_padded/tp)`` and the loss from
      :func:`vocab_parallel_cross_entropy` — the full logits are never assembled.
      Forward: the loss's two all-reduces (``N`` and ``2N`` elements for ``N`` tokens); backward:
      one all-reduce of ``∂L/∂x`` (``N·d``).
    * without ``targets`` (inference): the full logits ``(…, V)``, all-gathered (``N·V_padded``).

    A vocabulary that does not divide by ``tp`` is padded with zero rows at the end; padding columns
    are excluded from the loss and sliced away from gathered logits. The weight may be the same
    parameter as a :class:`VocabParallelEmbedding`'s (tied embeddings): the two shard identically.
    """

    def __init__(self, weight: nn.Parameter, vocab_size: int, ctx, *, loss_kwargs=None):
        super().__init__()
        self.weight = weight  # (V_padded/tp, d), carries its ShardSpec
        self.vocab_size, self.ctx = vocab_size, ctx
        self.loss_kwargs = dict(loss_kwargs or {})

    @classmethod
    def from_dense(cls, head: nn.Module, ctx, *, shared_weight: nn.Parameter | None = None,
                   **loss_kwargs) -> VocabParallelLMHead:
        """Shard a dense head whose ``weight`` is ``[V, d]`` (padding the vocabulary if needed), or
        reuse ``shared_weight`` — the already sharded embedding table of a tied model."""
        vocab, dim = head.weight.shape
        if shared_weight is None:
            tp = ctx.tp_size
            padded = -(-vocab // tp) * tp
            spec = ShardSpec((vocab, dim), 0, ctx.tp_rank, tp,
                             padded_size=padded if padded != vocab else None)
            shared_weight = set_shard_spec(nn.Parameter(spec.shard(head.weight.detach())), spec)
        return cls(shared_weight, vocab, ctx, loss_kwargs=loss_kwargs)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        group = self.ctx.tp_group
        logits_shard = linear_with_grad_all_reduce(x, self.weight, None, group)  # (B, T, V_pad/tp)
        if targets is None:
            logits = gather_from_tp_region(logits_shard, group, -1)
            return logits[..., :self.vocab_size], None
        loss = vocab_parallel_cross_entropy(logits_shard, targets, self.ctx,
                                            vocab_size=self.vocab_size, **self.loss_kwargs)
        return logits_shard, loss

    def to_dense(self) -> nn.Module:
        weight = gather_full(self.weight, self.ctx.tp_group)
        head = nn.Module()
        head.weight = nn.Parameter(weight)
        return head

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, vocab_per_rank={self.weight.shape[0]}, "
                f"tp={self.ctx.tp_size}")
