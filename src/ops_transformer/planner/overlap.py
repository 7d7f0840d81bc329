"""Does splitting a collective into chunks pay? The one overlap formula of the cost model (SPEC F4).

A collective of ``n`` elements that sits between two pieces of dependent compute (the gather
before a column matmul, the all-reduce after a row matmul) is fully exposed. Split both into ``c``
chunks and pipeline them — chunk ``i + 1`` moves while chunk ``i`` is multiplied — and only one
chunk's transfer stays exposed, at the price of ``c − 1`` more calls. With Hockney's α–β model
(:func:`~.cost.collective_time`) per chunk ``t_comm = α + wire(n/c)·bytes/β`` and per chunk of
compute ``t_comp = F/(c·φ)``, a two-stage pipeline of ``c`` chunks takes
``t_comm + t_comp + (c − 1)·max(t_comm, t_comp)`` against ``c·(...)`` serial; relative to the
unchunked, serial ``α + wire(n)·bytes/β + F/φ`` it saves::

    gain(c) = (c − 1) · (η · min(t_comm, t_comp) − α)

— each extra chunk pays one more latency ``α`` and hides at most the shorter of its transfer and
its compute. ``η`` (the profile's :attr:`~.hardware.HardwareProfile.overlap_efficiency`) is the
fraction of that overlap the machine really gets: about 1 where communication has engines of its
own (NCCL on a GPU), less where the transfer needs the cores the compute runs on (gloo over
loopback on a small CPU), 0 where overlapping gains nothing. ``ops-transformer calibrate``
measures it.

:func:`choose_chunks` picks, for one region's collectives (forward and backward, each with the
compute it is pipelined with), the chunk count up to ``max_chunks`` with the largest summed gain,
and 1 (no chunks) unless some gain is positive. This module is pure: the regions that run the
chunks (:mod:`ops_transformer.layers.overlap_regions`) and the MoE dispatch
(:mod:`ops_transformer.layers.moe_overlap`) ask it with their sizes at their first call.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import wire_elements

OVERLAP_MODES = ("none", "chunked", "auto")


@dataclass(frozen=True)
class Pipelined:
    """One collective of a region (``kind`` of ``elements`` on ``group_size`` ranks) and the
    ``flops`` of the compute its chunks are pipelined with."""

    kind: str
    elements: int
    group_size: int
    flops: float


def chunk_times(piece: Pipelined, chunks: int, profile,
                bytes_per_element: int = 4) -> tuple[float, float]:
    """``(t_comm, t_comp)`` of one of ``chunks`` chunks: its collective (α + wire/β) and its
    compute (FLOPs / the profile's FLOP/s)."""
    alpha, beta = profile.alpha_beta(piece.kind, piece.group_size)
    wire = wire_elements(piece.kind, piece.elements / chunks, piece.group_size)
    return alpha + wire * bytes_per_element / beta, profile.compute_time(piece.flops / chunks)


def chunk_gain(piece: Pipelined, chunks: int, profile, bytes_per_element: int = 4) -> float:
    """Seconds saved by ``chunks`` pipelined chunks against one call (module docstring):
    ``(c − 1)·(η·min(t_comm, t_comp) − α)``; 0 for one chunk or a group of one."""
    if chunks <= 1 or piece.group_size <= 1 or piece.elements <= 0:
        return 0.0
    alpha, _ = profile.alpha_beta(piece.kind, piece.group_size)
    t_comm, t_comp = chunk_times(piece, chunks, profile, bytes_per_element)
    return (chunks - 1) * (overlap_efficiency(profile) * min(t_comm, t_comp) - alpha)


def overlap_efficiency(profile) -> float:
    """The profile's ``η`` in [0, 1] (1 for a profile that does not say)."""
    return min(max(float(getattr(profile, "overlap_efficiency", 1.0)), 0.0), 1.0)


@dataclass(frozen=True)
class ChunkChoice:
    chunks: int
    gain_s: float
    reason: str


def choose_chunks(pieces: list[Pipelined], max_chunks: int, profile,
                  bytes_per_element: int = 4) -> ChunkChoice:
    """The chunk count in ``1 … max_chunks`` with the largest summed :func:`chunk_gain` over
    ``pieces`` (ties: fewer chunks), and why."""
    if not pieces or max_chunks <= 1:
        return ChunkChoice(1, 0.0, "nothing to overlap" if not pieces else "chunks=1")
    gains = {c: sum(chunk_gain(p, c, profile, bytes_per_element) for p in pieces)
             for c in range(2, max_chunks + 1)}
    best = max(gains, key=lambda c: (gains[c], -c))
    first = pieces[0]
    t_comm, t_comp = chunk_times(first, best, profile, bytes_per_element)
    alpha, _ = profile.alpha_beta(first.kind, first.group_size)
    detail = (f"{first.kind} {first.elements} elements: per chunk {t_comm * 1e3:.3g} ms transfer, "
              f"{t_comp * 1e3:.3g} ms compute, α {alpha * 1e3:.3g} ms, η "
              f"{overlap_efficiency(profile):.2g} ({getattr(profile, 'name', 'profile')})")
    if gains[best] <= 0:
        return ChunkChoice(1, 0.0, f"not chunked: {best} chunks would save "
                                   f"{gains[best] * 1e3:.3g} ms ({detail})")
    return ChunkChoice(best, gains[best], f"{best} chunks save {gains[best] * 1e3:.3g} ms "
                                          f"({detail})")


REGIONS = ("tp_entry", "sp_entry", "tp_exit", "sp_exit", "experts")


def region_pieces(region: str, tokens: int, in_features: int, out_features: int,
                  group_size: int) -> list[Pipelined]:
    """The collectives of one chunked region and the compute each is pipelined with, for a
    matmul of ``tokens`` rows by ``in_features → out_features`` on one rank (all column outputs
    together at an entry; the experts' FFN width × matrices for ``experts``):

    ============ ========================================== ===========================================
    region       forward                                    backward
    ============ ========================================== ===========================================
    ``tp_entry`` —                                          all-reduce ``tokens·in`` ∥ input-grad matmul
    ``sp_entry`` all-gather ``tokens·in`` ∥ the matmul      reduce-scatter ``tokens·in`` ∥ input-grad
    ``tp_exit``  all-reduce ``tokens·out`` ∥ the matmul     —
    ``sp_exit``  reduce-scatter ``tokens·out`` ∥ the matmul all-gather ``tokens·out`` ∥ both grad matmuls
    ``experts``  dispatch, combine all-to-alls ``tokens·in`` the same two ∥ the experts' backward
                 ∥ half the experts' matmuls each
    ============ ========================================== ===========================================

    (``tokens``: every token the matmul sees — under sequence parallelism the gathered ``t·n``;
    for ``experts`` the token-slots this rank routes.)"""
    mm = 2.0 * tokens * in_features * out_features
    p = group_size
    if region == "tp_entry":
        return [Pipelined("all_reduce", tokens * in_features, p, mm)]
    if region == "sp_entry":
        return [Pipelined("all_gather", tokens * in_features, p, mm),
                Pipelined("reduce_scatter", tokens * in_features, p, mm)]
    if region == "tp_exit":
        return [Pipelined("all_reduce", tokens * out_features, p, mm)]
    if region == "sp_exit":
        return [Pipelined("reduce_scatter", tokens * out_features, p, mm),
                Pipelined("all_gather", tokens * out_features, p, 2 * mm)]
    if region == "experts":
        moved = tokens * in_features
        return [Pipelined("all_to_all", moved, p, mm / 2), Pipelined("all_to_all", moved, p, mm / 2),
                Pipelined("all_to_all", moved, p, mm), Pipelined("all_to_all", moved, p, mm)]
    raise ValueError(f"region must be one of {REGIONS}, got {region!r}")
