"""Entry regions whose collective is a chunked collective matmul (SPEC F4, overlap).

The column and row layers run their own collective through the collective-matmul ops already
(:mod:`.collective_matmul`: ``ColumnParallelLinear`` its input-gradient all-reduce by
``copy_matmul``, ``RowParallelLinear`` / ``SequenceParallelRowLinear`` their exit by
``matmul_all_reduce`` / ``matmul_reduce_scatter``; the chunk count an option from one policy,
:func:`~.linear.chunks_of`: one chunk is the plain layer). What is left here is the entry shared by
several column layers — Q, K and V, or gate and up — computed as **one** op for all of them::

    (self_attn): ChunkedCopyToTPRegion[LlamaAttention](input: copy_to_tp_region over tp=2 (fwd
                 identity, bwd all-reduce of the input gradient) as copy_matmul with q_proj,
                 k_proj, v_proj: the all-reduce in chunks, ..., overlap=auto (chunks <= 2)
      (q_proj): FedColumnParallelLinear(..., output: from its region's collective matmul ...)

========================================= ====================== ================== ==============
module                                    replaces               forward            backward
========================================= ====================== ================== ==============
:class:`ChunkedCopyToTPRegion`            ``CopyToTPRegion``     its column matmuls all-reduce of
                                                                                    the input grad
                                                                                    in chunks
:class:`ChunkedGatherSequenceRegion`      ``GatherSequence-``    all-gather in      reduce-scatter
                                          ``Region``             chunks ∥ matmuls   in chunks
``ChunkedGatherSequenceRegion``           ``RegatherSequence-``  the same, keeps    the share all-
(``regather=True``)                       ``Region``             only the share     gathered again
========================================= ====================== ================== ==============

Since issue 33 they are no classes of their own: ``ChunkedCopyToTPRegion`` *is*
:class:`~.regions.CopyToTPRegion` and ``ChunkedGatherSequenceRegion`` *is*
:class:`~.regions.GatherSequenceRegion` — one class per entry, the fused op an option
(``columns``, ``overlap``; :mod:`.fused_entry`): without ``columns`` (``overlap="none"``) the
plain entry, with them the one op. An entry region computes the column layers that read its input (``columns``: child
names, or ``""`` for the region itself when it is the column layer) in one fused op; each child,
a :class:`FedColumn` (:func:`as_variant`), returns that op's output when called with the
region's input (anything else it computes itself, which stays exact). How many chunks:
:class:`OverlapPolicy` — as many as the plan asks (``overlap="chunked"``), or what the cost
model's one formula says pays for this region's sizes on the agreed profile (``"auto"``,
:func:`~ops_transformer.planner.overlap.choose_chunks`), decided once per size and recorded.
"""

from __future__ import annotations

from .fused_entry import FedColumn, _ChunkedEntry, _feeding, _with_adapters, as_variant
from .overlap_policy import OverlapPolicy
from .regions import CopyToTPRegion, GatherSequenceRegion

# the earlier names of the fused entries: the same classes (one class per entry, an option each)
ChunkedCopyToTPRegion = CopyToTPRegion
ChunkedGatherSequenceRegion = GatherSequenceRegion

__all__ = ["ChunkedCopyToTPRegion", "ChunkedGatherSequenceRegion", "FedColumn", "OverlapPolicy",
           "_ChunkedEntry", "_feeding", "_with_adapters", "as_variant"]
