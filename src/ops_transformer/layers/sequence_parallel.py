"""Sequence parallelism (Megatron-SP, Korthikanti et al. 2022, §4.2.2).

Between tensor-parallel regions every rank keeps only ``1/t`` of the activations — an ``(b, s/t, h)``
share of the ``(b, s, h)`` tokens: norms, dropout and residual adds run on the share, and each
region's entry all-gathers the tokens while its exit reduce-scatters them::

    x (b, s/t, h) ─ norm ─ all-gather ─▶ (b, s, h) ─ Q,K,V (column) ─ attention ─ out (row, partial)
        ▲                                                                            │
        └──────── + residual ◀─ dropout ◀─ (b, s/t, h) ◀────── reduce-scatter ◀───────┘

================================== ============================== ==============================
piece                              forward                        backward
================================== ============================== ==============================
:func:`scatter_sequence`           keep this rank's share         all-gather
:func:`gather_sequence_region`     all-gather                     reduce-scatter
:class:`SequenceParallelRowLinear` local matmul, reduce-scatter,  all-gather of the output
                                   + bias                         gradient
:func:`gather_sequence`            all-gather                     keep this rank's share
================================== ============================== ==============================

Per layer that is 2 all-gathers + 2 reduce-scatters of ``b·s·h`` elements in forward and the same in
backward, in place of 2 + 2 all-reduces of ``b·s·h`` (the same volume, SPEC F4).

Which tokens a rank holds: its contiguous ``1/t`` share of the ``b·s`` tokens in memory order,
shaped ``(b, s/t, h)`` — for ``b = 1`` exactly its ``s/t`` slice of the sequence, for ``b > 1``
the same number of tokens taken batch-row-major. Norms, dropout and residual adds work token by
token, so the result is the same whichever tokens a rank holds; this choice makes every all-gather
and reduce-scatter a copy-free collective on a contiguous buffer (Megatron-LM gets the same from its
``(s, b, h)`` layout). Gathering along dim 1 of a batch-first tensor instead returns a strided view,
and each of Q, K and V would save its own contiguous copy of it for backward.

Replicated parameters used on a share — norm weights and biases, the row-parallel biases, the
final norm — get a gradient from this rank's tokens only. They are marked
(:func:`~ops_transformer.comm.bucketing.mark_partial_grad` over the TP group), and
``parallelize``'s :class:`~ops_transformer.parallel.grad_reduce.GradSums` sums them over the TP
group in **one** coalesced all-reduce per backward (per 25 MB of such gradients).

Sequence parallelism saves the activations kept for backward. Without autograd (inference,
``generate``) nothing is kept, and every piece here runs as plain tensor parallelism, so any
sequence length works; with autograd a length ``s`` that does not divide by ``tp`` is a
``ValueError``. Dropout on a slice draws its mask from each rank's generator: ranks seeded alike
draw the same pattern for their slices (Megatron keeps a separate generator per TP rank for this).
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from ..comm.bucketing import mark_partial_grad, partial_grad_group
from ..comm.primitives import gather_from_tp_region, scatter_to_tp_region
from .collective_matmul import gather_matmul, matmul_reduce_scatter
from .linear import RowParallelLinear, chunks_of, exit_operands

SEQ_DIM = 1  # activations are (batch, sequence, hidden)


from ..schema.choices import SEQUENCE_PARALLEL_VALUES


def sequence_parallel_mode(value) -> str:
    """``"none"``, ``"plain"`` or ``"regather"`` for ``parallelize``'s ``sequence_parallel``:
    ``False``, ``True`` (the all-gathered region inputs kept for backward) or ``"regather"``
    (only this rank's share kept, all-gathered again in backward); anything else is a
    ``ValueError`` naming the value."""
    if value is False or value is True:
        return "plain" if value else "none"
    if isinstance(value, str) and value == "regather":
        return "regather"
    raise ValueError(f"sequence_parallel must be one of {SEQUENCE_PARALLEL_VALUES} (True keeps the "
                     f"gathered inputs of each region for backward, 'regather' keeps this rank's "
                     f"share and all-gathers it again in backward), got {value!r}")


def _active(group) -> bool:
    return C.group_size(group) > 1 and torch.is_grad_enabled()


def check_sequence_length(x: torch.Tensor, group) -> None:
    tp = C.group_size(group)
    if x.dim() < 2 or x.shape[SEQ_DIM] % tp:
        length = x.shape[SEQ_DIM] if x.dim() >= 2 else None
        raise ValueError(f"sequence parallelism splits the sequence over tp ({tp}) ranks: the "
                         f"sequence length s ({length}) must be divisible by tp ({tp})")


def _tokens(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # (b·s, h): a view of a contiguous activation


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the sequence-parallel layout: ``(b, s, h)`` → this rank's ``(b, s/t, h)`` share of the
    tokens (backward: all-gather)."""
    if not _active(group):
        return x
    check_sequence_length(x, group)
    b, s = x.shape[0], x.shape[SEQ_DIM]
    # A copy, not a view: a view would keep the whole (b, s, h) input alive for backward.
    share = scatter_to_tp_region(_tokens(x), group, 0).clone()
    return share.view(b, s // C.group_size(group), *x.shape[2:])


def gather_sequence_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region: ``(b, s/t, h)`` → ``(b, s, h)`` by an all-gather (backward: reduce-scatter
    of the partial input gradients of the column-parallel layers inside)."""
    if not _active(group):
        return x
    # the collective matmul of the entry with no column weights, in one chunk
    full, _ = gather_matmul(_tokens(x), [], [], group, 1,
                            ("all_gather_along.fwd", "all_gather_along.bwd"))
    return full.view(x.shape[0], x.shape[SEQ_DIM] * C.group_size(group), *x.shape[2:])


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the sequence-parallel layout for a replicated consumer (the LM head, whose input
    gradient is the same on every rank): all-gather (backward: keep this rank's share)."""
    if not _active(group):
        return x
    full = gather_from_tp_region(_tokens(x), group, 0)
    return full.view(x.shape[0], x.shape[SEQ_DIM] * C.group_size(group), *x.shape[2:])


class SequenceParallelRowLinear(RowParallelLinear):
    """A :class:`RowParallelLinear` whose partial outputs are reduce-scattered over the tokens
    instead of all-reduced: ``y_share = reduce-scatter(x_r W_rᵀ) + b`` of shape ``(b, s/t, out)``.
    Backward all-gathers the output gradient. The bias, replicated and added on the slice,
    gets a partial gradient, marked for the TP sum (:func:`mark_partial_grad`)::

        x_r (b, s, in/t) ─ x_r W_rᵀ (partial, b·s tokens) ─ reduce-scatter ─▶ (b, s/t, out) + b

    The exit is the collective matmul :func:`~.collective_matmul.matmul_reduce_scatter` (one chunk
    without an ``overlap`` policy, else the policy's chunks: :func:`~.linear.chunks_of`)."""

    def _load_dense(self, dense) -> None:
        super()._load_dense(dense)
        if self.bias is not None:
            mark_partial_grad(self.bias, self.tp_group)

    exit_name = "matmul_reduce_scatter"
    exit_comm = ("fwd the row matmul and its reduce-scatter in chunks, overlapped; bwd the "
                 "all-gather in chunks")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _active(self.tp_group):
            return super().forward(x)
        if x.shape[-1] != self.in_features_per_rank:
            raise ValueError(f"SequenceParallelRowLinear expects the last dimension of its input "
                             f"to be in_features_per_rank ({self.in_features_per_rank}), got "
                             f"{x.shape[-1]}")
        check_sequence_length(x, self.tp_group)
        y = self.exit(x, self.weight)
        return y + self.bias if self.bias is not None else y

    def exit(self, x_local: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """This rank's ``(b, s/t, out)`` share of ``Σ_r x_r W_rᵀ`` by the collective matmul
        :func:`~.collective_matmul.matmul_reduce_scatter` (one chunk: the plain
        reduce-scatter; backward its all-gather of the output gradient)."""
        if not _active(self.tp_group):
            return super().exit(x_local, weight)
        k, t = x_local.shape[-1], self.tp_size
        chunks = chunks_of(self, "sp_exit", x_local.reshape(-1, k), weight.shape[0])
        x_in, w = exit_operands(self, x_local, weight)
        y = matmul_reduce_scatter(x_in.reshape(-1, x_in.shape[-1]), w, self.tp_group, chunks)
        return y.view(x_local.shape[0], x_local.shape[SEQ_DIM] // t, *x_local.shape[2:-1],
                      w.shape[0])

    def extra_repr(self) -> str:
        return super().extra_repr() + ", sequence_parallel=True"


def mark_partial(module: torch.nn.Module, group) -> None:
    """Mark ``module``'s own parameters as replicated over ``group`` but used on a share of the
    tokens: their gradients are summed over ``group`` once per backward."""
    for p in module.parameters(recurse=False):
        mark_partial_grad(p, group)


def is_partial(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient is a partial sum (sequence parallelism, replicated KV heads,
    strategy B's output projection)."""
    return partial_grad_group(param) is not None
