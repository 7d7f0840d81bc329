"""Sequence parallelism (Megatron-SP, Korthikanti et al. 2022, §4.2.2).

Between tensor-parallel regions every rank keeps only its ``s/t`` slice of the sequence (dim 1 of
``(b, s, h)`` activations): norms, dropout and residual adds run on the slice, and each region's
entry all-gathers the sequence while its exit reduce-scatters it::

    x (b, s/t, h) ─ norm ─ all-gather ─▶ (b, s, h) ─ Q,K,V (column) ─ attention ─ out (row, partial)
        ▲                                                                            │
        └──────── + residual ◀─ dropout ◀─ (b, s/t, h) ◀────── reduce-scatter ◀───────┘

=============================== ================================ ================================
piece                           forward                          backward
=============================== ================================ ================================
:func:`scatter_sequence`        keep this rank's ``s/t`` slice   all-gather along the sequence
:func:`gather_sequence_region`  all-gather along the sequence    reduce-scatter along it
:class:`SequenceParallelRowLinear` local matmul, reduce-scatter  all-gather of the output gradient
                                along the sequence, + bias
:func:`gather_sequence`         all-gather along the sequence    keep this rank's slice
=============================== ================================ ================================

Per layer that is 2 all-gathers + 2 reduce-scatters of ``b·s·h`` elements in forward and the same in
backward, in place of 2 + 2 all-reduces of ``b·s·h`` (the same volume, SPEC F4).

Replicated parameters used on a slice — norm weights and biases, the row-parallel biases, the
final norm — get a gradient from this rank's tokens only. :class:`SequenceParallelGradSync` sums
them over the TP group in **one** coalesced all-reduce per backward (and averages them over
``dp``, since they are kept out of the data-parallel bucketing).

Sequence parallelism saves the activations kept for backward. Without autograd (inference,
``generate``) nothing is kept, and every piece here runs as plain tensor parallelism, so any
sequence length works; with autograd a length that does not divide by ``tp`` is a ``ValueError``.
Dropout on a slice draws its mask from each rank's generator: ranks seeded alike draw the same
pattern for their slices (Megatron keeps a separate generator per TP rank for this).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import collectives as C
from ..comm.primitives import (all_gather_along, gather_from_tp_region, reduce_scatter_along,
                               scatter_to_tp_region)
from .linear import RowParallelLinear

SEQ_DIM = 1  # activations are (batch, sequence, hidden)
PARTIAL = "sequence_parallel_partial"  # attribute set on replicated parameters used on a slice


def _active(group) -> bool:
    return C.group_size(group) > 1 and torch.is_grad_enabled()


def check_sequence_length(x: torch.Tensor, group) -> None:
    tp = C.group_size(group)
    if x.dim() < 2 or x.shape[SEQ_DIM] % tp:
        length = x.shape[SEQ_DIM] if x.dim() >= 2 else None
        raise ValueError(f"sequence parallelism splits the sequence over tp ({tp}) ranks: the "
                         f"sequence length s ({length}) must be divisible by tp ({tp})")


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the sequence-parallel layout: keep this rank's ``s/t`` slice (backward: all-gather)."""
    if not _active(group):
        return x
    check_sequence_length(x, group)
    return scatter_to_tp_region(x, group, SEQ_DIM)


def gather_sequence_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region: all-gather the sequence (backward: reduce-scatter the partial input
    gradients of the column-parallel layers inside)."""
    return all_gather_along(x, group, SEQ_DIM) if _active(group) else x


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the sequence-parallel layout for a replicated consumer (the LM head, whose input
    gradient is the same on every rank): all-gather (backward: keep this rank's slice)."""
    return gather_from_tp_region(x, group, SEQ_DIM) if _active(group) else x


class SequenceParallelRowLinear(RowParallelLinear):
    """A :class:`RowParallelLinear` whose partial outputs are reduce-scattered along the sequence
    instead of all-reduced: ``y_slice = reduce-scatter_seq(x_r W_rᵀ) + b`` of shape ``(b, s/t,
    out)``. Backward all-gathers the output gradient. The bias, replicated and added on the slice,
    gets a partial gradient (marked ``sequence_parallel_partial``)."""

    def _load_dense(self, dense) -> None:
        super()._load_dense(dense)
        if self.bias is not None:
            setattr(self.bias, PARTIAL, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _active(self.tp_group):
            return super().forward(x)
        if x.shape[-1] != self.in_features_per_rank:
            raise ValueError(f"SequenceParallelRowLinear expects the last dimension of its input "
                             f"to be in_features_per_rank ({self.in_features_per_rank}), got "
                             f"{x.shape[-1]}")
        check_sequence_length(x, self.tp_group)
        y = reduce_scatter_along(F.linear(x, self.weight), self.tp_group, SEQ_DIM)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return super().extra_repr() + ", sequence_parallel=True"


def mark_partial(module: torch.nn.Module) -> None:
    """Mark ``module``'s own parameters as replicated-but-used-on-a-slice."""
    for p in module.parameters(recurse=False):
        setattr(p, PARTIAL, True)


def is_partial(param: torch.Tensor) -> bool:
    return bool(getattr(param, PARTIAL, False))
