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
      Forward: the loss's one all-gather (``tp·3N`` elements for ``N`` tokens); backward: one
      all-reduce of ``∂L/∂x`` (``N·d``).
    * without ``targets`` (inference): the full logits ``(…, V)``, all-gathered (``N·V_padded``).

    A vocabulary that does not divide by ``tp`` is padded with zero rows at the end; padding columns
    are excluded from the loss and sliced away from gathered logits. The weight may be the same
    parameter as a :class:`VocabParallelEmbedding`'s (tied embeddings): the two shard identically.
    """

    def __init__(self, weight: nn.Parameter, vocab_size: int, ctx, **options):
        super().__init__()
        self.weight = weight  # (V_padded/tp, d), carries its ShardSpec
        self.vocab_size, self.ctx = vocab_size, ctx
        self.options = options

    @classmethod
    def from_dense(cls, head: nn.Module, ctx, *, shared_weight: nn.Parameter | None = None,
                   **options):
        """Shard a dense head whose ``weight`` is ``[V, d]`` (padding the vocabulary if needed), or
        reuse ``shared_weight`` — the already sharded embedding table of a tied model."""
        vocab, dim = head.weight.shape
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"{cls.__name__} supports LM heads without bias; this one has a bias "
                             f"of shape {tuple(head.bias.shape)}")
        if shared_weight is None:
            tp = ctx.tp_size
            padded = -(-vocab // tp) * tp
            spec = ShardSpec((vocab, dim), 0, ctx.tp_rank, tp,
                             padded_size=padded if padded != vocab else None)
            shared_weight = set_shard_spec(nn.Parameter(spec.shard(head.weight.detach())), spec)
        return cls(shared_weight, vocab, ctx, **options)

    def logits_shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's logit columns ``(…, V_padded/tp)``; backward all-reduces ``∂L/∂x``."""
        return linear_with_grad_all_reduce(x, self.weight, None, self.ctx.tp_group)

    def full_logits(self, logits_shard: torch.Tensor) -> torch.Tensor:
        """All-gather the shards and drop the padding columns: ``(…, V)``."""
        logits = gather_from_tp_region(logits_shard, self.ctx.tp_group, -1)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size]

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        logits_shard = self.logits_shard(x)  # (B, T, V_pad/tp)
        if targets is None:
            return self.full_logits(logits_shard), None
        loss = vocab_parallel_cross_entropy(logits_shard, targets, self.ctx,
                                            vocab_size=self.vocab_size, **self.options)
        return logits_shard, loss

    def to_dense(self) -> nn.Module:
        weight = gather_full(self.weight, self.ctx.tp_group)
        head = nn.Module()
        head.weight = nn.Parameter(weight)
        return head

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, vocab_per_rank={self.weight.shape[0]}, "
                f"tp={self.ctx.tp_size}")


class GatheredLMHead(VocabParallelLMHead):
    """A vocabulary-parallel ``nn.Linear`` LM head for models that compute their own loss from the
    logits (Hugging Face): ``forward(x)`` returns the full logits ``(…, V)`` — an all-gather of
    ``N·V_padded`` elements — so ``generate`` and the model's loss work unchanged. With
    ``gather=False`` it returns this rank's shard instead, for a vocab-parallel loss."""

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        """The vocabulary, as on the ``nn.Linear`` it replaced (models read it for their loss)."""
        return self.vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shard = self.logits_shard(x)
        out = self.full_logits(shard) if self.options.get("gather", True) else shard
        # never a view: FSDP2 refuses one as a module's output (an in-place op on it, as a
        # model's loss may do, would skip the pre-backward hook); a copy only where it is one
        return out.clone(memory_format=torch.contiguous_format) if out._is_view() else out
