"""Tensor-parallel layers: each states its partition and its forward/backward collectives."""

from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .loss import vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy"]

from .moe import ParallelExperts, ParallelMoE  # noqa: E402

__all__ += ["ParallelExperts", "ParallelMoE"]
