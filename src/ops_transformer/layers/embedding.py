"""Vocabulary-parallel embedding (Shoeybi et al. 2019, §3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.primitives import gather_from_tp_region, reduce_from_tp_region
from ..parallel.sharding import ShardSpec, divide, gather_full, set_shard_spec


def check_token_range(idx: torch.Tensor, size: int, what: str, *, allow: int | None = None) -> None:
    """Raise a ``ValueError`` for indices outside ``[0, size)`` (``allow`` is exempt, e.g.
    ``ignore_index``). A sharded lookup would silently return zeros for them. Checked on CPU only:
    on a GPU it would add a host synchronisation to every step."""
    if idx.is_cuda or idx.numel() == 0:
        return
    bad = (idx < 0) | (idx >= size)
    if allow is not None:
        bad &= idx != allow
    if bool(bad.any()):
        value = int(idx[bad].flatten()[0])
        raise ValueError(f"{what} contains {value}, outside the valid range [0, {size})")


class _ShardedEmbedding(nn.Module):
    """What the two split embeddings share: loading this rank's shard of a dense table (per
    ``self.weight_spec``) and gathering the dense table back."""

    def _load_dense(self, dense: nn.Embedding) -> None:
        self.weight = set_shard_spec(nn.Parameter(self.weight_spec.shard(dense.weight.detach())),
                                     self.weight_spec)

    def to_dense(self) -> nn.Embedding:
        """The dense ``nn.Embedding`` (collective over the TP group; every rank gets it)."""
        weight = gather_full(self.weight, self.tp_group)
        return nn.Embedding.from_pretrained(weight, freeze=False, padding_idx=self.padding_idx)


class VocabParallelEmbedding(_ShardedEmbedding):
    """``nn.Embedding`` with the vocabulary (rows of the table) split across the TP group::

        rows [0, V/tp) on rank 0 | rows [V/tp, 2V/tp) on rank 1 | …

    Each rank looks up the tokens that fall in its rows and writes zeros for the others; the
    partial results are summed.

    * forward: one all-reduce of the output (``tokens × embedding_dim`` elements).
    * backward: no communication (each rank's rows get the gradient of their own tokens).

    A vocabulary that does not divide by ``tp`` is a ``ValueError`` unless ``pad_vocab=True``, which
    pads the table with zero rows that no valid token reaches (``num_embeddings`` stays the real
    vocabulary size; the padded size is ``num_embeddings_padded``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx, *,
                 padding_idx: int | None = None, pad_vocab: bool = False, device=None, dtype=None):
        super().__init__()
        tp = ctx.tp_size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        padded = -(-num_embeddings // tp) * tp if pad_vocab else num_embeddings
        self.num_embeddings_padded = padded
        self.num_embeddings_per_rank = divide(padded, tp, "VocabParallelEmbedding: num_embeddings")
        self.vocab_start = ctx.tp_rank * self.num_embeddings_per_rank
        self.padding_idx = padding_idx
        self.tp_group, self.tp_size, self.tp_rank = ctx.tp_group, tp, ctx.tp_rank
        self.weight_spec = ShardSpec((num_embeddings, embedding_dim), 0, ctx.tp_rank, tp,
                                     padded_size=padded if padded != num_embeddings else None)
        self._load_dense(nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx,
                                      device=device, dtype=dtype))

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, ctx, *,
                   pad_vocab: bool = False) -> VocabParallelEmbedding:
        """This rank's exact rows of a dense ``nn.Embedding``."""
        num, dim = embedding.weight.shape
        layer = cls(num, dim, ctx, padding_idx=getattr(embedding, "padding_idx", None),
                    pad_vocab=pad_vocab, device="meta", dtype=embedding.weight.dtype)
        layer._load_dense(embedding)
        return layer

    def _local_padding_idx(self) -> int | None:
        if self.padding_idx is None:
            return None
        local = self.padding_idx % self.num_embeddings - self.vocab_start
        return local if 0 <= local < self.num_embeddings_per_rank else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        check_token_range(idx, self.num_embeddings, "VocabParallelEmbedding input")
        if self.tp_size == 1:
            return F.embedding(idx, self.weight, self._local_padding_idx())
        outside = (idx < self.vocab_start) | (idx >= self.vocab_start + self.num_embeddings_per_rank)
        local_idx = (idx - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_idx, self.weight, self._local_padding_idx())  # (..., dim)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.tp_group, inplace=True)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"num_embeddings_per_rank={self.num_embeddings_per_rank}, tp={self.tp_size}"
                + (f", padded_to={self.num_embeddings_padded}"
                   if self.num_embeddings_padded != self.num_embeddings else ""))


class ColumnParallelEmbedding(_ShardedEmbedding):
    """``nn.Embedding`` with the embedding dimension (columns of the table) split across the TP
    group (Hugging Face's ``embedding_colwise``)::

        table = [ T_0 | T_1 | … ]   (V × d/tp each)      out = [ lookup(T_0) | lookup(T_1) | … ]

    * forward: one all-gather of the looked-up slices along the last dimension
      (``tokens × embedding_dim`` elements).
    * backward: no communication (each rank keeps its slice of the output gradient).

    ``embedding_dim`` must divide by ``tp`` (``ValueError`` otherwise).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx, *,
                 padding_idx: int | None = None, device=None, dtype=None):
        super().__init__()
        tp = ctx.tp_size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.embedding_dim_per_rank = divide(embedding_dim, tp,
                                             "ColumnParallelEmbedding: embedding_dim")
        self.padding_idx = padding_idx
        self.tp_group, self.tp_size, self.tp_rank = ctx.tp_group, tp, ctx.tp_rank
        self.weight_spec = ShardSpec((num_embeddings, embedding_dim), 1, ctx.tp_rank, tp)
        self._load_dense(nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx,
                                      device=device, dtype=dtype))

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, ctx) -> ColumnParallelEmbedding:
        """This rank's exact columns of a dense ``nn.Embedding``."""
        num, dim = embedding.weight.shape
        layer = cls(num, dim, ctx, padding_idx=embedding.padding_idx, device="meta",
                    dtype=embedding.weight.dtype)
        layer._load_dense(embedding)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        check_token_range(idx, self.num_embeddings, "ColumnParallelEmbedding input")
        out = F.embedding(idx, self.weight, self.padding_idx)  # (..., d/tp)
        return gather_from_tp_region(out, self.tp_group, -1)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"embedding_dim_per_rank={self.embedding_dim_per_rank}, tp={self.tp_size}")
