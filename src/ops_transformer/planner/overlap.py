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

from .cost import Comm, wire_elements
from .hardware import CPU_GLOO

from ..schema.choices import OVERLAP_MODES


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


def region_chunks(region: str, tokens: int, in_features: int, out_features: int,
                  group_size: int, rows: int, *, overlap: str, chunks: int, profile=None,
                  bytes_per_element: int = 4) -> int:
    """The chunks a region of these sizes runs (``rows``: the rows each rank splits, never fewer
    than one per chunk): 1 for ``none``, ``chunks`` for ``chunked``, :func:`choose_chunks` on
    ``profile`` (default: the built-in one) for ``auto`` — what the layers do, for the formulas
    that count their calls."""
    if overlap not in OVERLAP_MODES:
        raise ValueError(f"overlap must be one of {OVERLAP_MODES}, got {overlap!r}")
    if overlap == "none" or group_size <= 1:
        return 1
    if overlap == "auto":
        pieces = region_pieces(region, size_bucket(tokens), in_features, out_features,
                               group_size)
        chunks = choose_chunks(pieces, chunks, profile or CPU_GLOO, bytes_per_element).chunks
    return max(1, min(chunks, rows))


def size_bucket(tokens: int) -> int:
    """The size a region decides its chunks for: its tokens rounded down to a power of two (a
    little conservative; few distinct decisions however the lengths vary, as in generation)."""
    return 1 << (max(tokens, 1).bit_length() - 1)


def decoder_overlap_calls(*, b: int, s: int, h: int, qkv_out: int, ffn_in: int, ffn: int,
                          tp: int, layers: int, attention: str, sequence_parallel: bool,
                          recompute: str, overlap: str, chunks: int, profile=None,
                          bytes_per_element: int = 4, ffn_layers: int | None = None,
                          regather: bool = False) -> Comm:
    """The calls chunking adds to one training step of the reference decoder's dense layers on
    one rank (``elements`` 0: chunks move the same elements): per chunked region ``chunks − 1``
    more of each of its collectives (:func:`region_pieces`), and, with ``recompute="full"``,
    of each forward one the replay repeats (all but the layer's closing exit). ``qkv_out``:
    this rank's Q, K and V output features; ``ffn_in``: its first FFN matrix's (``2·ffn/tp``
    for SwiGLU); ``attention``: the strategy (its output projection is a chunked exit only for
    ``heads``; ``kv_split`` and ``naive`` have no chunked attention region); ``ffn_layers``: the
    layers with a dense FFN (default all; an MoE FFN's chunks are :func:`moe_chunk_calls`');
    ``regather``: the re-gathering sequence-parallel entries (``sequence_parallel="regather"``),
    chunked like the plain ones; the re-gather of their backward stays one call (no more calls)."""
    tokens, rows = b * s, (b * s // tp if sequence_parallel else b * s)
    entry, exit_ = ("sp_entry", "sp_exit") if sequence_parallel else ("tp_entry", "tp_exit")
    dense = layers if ffn_layers is None else ffn_layers
    regions = []  # (region, in, out, replayed by full recompute, layers)
    if attention in ("heads", "heads_allgather"):
        regions.append((entry, h, qkv_out, True, layers))
    if attention == "heads":
        regions.append((exit_, h // tp, h, True, layers))
    regions.append((entry, h, ffn_in, True, dense))
    regions.append((exit_, ffn // tp, h, False, dense))
    out = Comm()
    for region, n_in, n_out, replayed, count in regions:
        c = region_chunks(region, tokens, n_in, n_out, tp, rows, overlap=overlap, chunks=chunks,
                          profile=profile, bytes_per_element=bytes_per_element)
        for i, piece in enumerate(region_pieces(region, tokens, n_in, n_out, tp)):
            forward = region in ("sp_entry", "sp_exit", "tp_exit") and i == 0
            repeats = 1 + (recompute == "full" and replayed and forward)
            out.add(piece.kind, 0, calls=(c - 1) * repeats * count)
    return out


def moe_chunk_calls(*, slots: int, h: int, expert_width: int, ep: int, tp: int, overlap: str,
                    chunks: int, profile=None, bytes_per_element: int = 4,
                    recompute: str = "none") -> tuple[int, Comm]:
    """``(chunks, extra calls)`` of one MoE layer over ``ep > 1`` ranks: the EP group's largest
    routed ``slots`` decide (every rank of the group knows them); each chunk beyond the first adds one
    dispatch and one combine all-to-all per direction and, with the experts split over TP, one
    all-reduce per direction (full recompute replays the forward ones).
    ``expert_width``: this rank's ``W/tp + F/tp`` expert features."""
    if ep <= 1 or overlap == "none":
        return 1, Comm()
    c = region_chunks("experts", slots, h, expert_width, ep, chunks,
                      overlap=overlap, chunks=chunks, profile=profile,
                      bytes_per_element=bytes_per_element)
    fwd = 1 + (recompute == "full")
    out = Comm().add("all_to_all", 0, calls=2 * (c - 1) * (fwd + 1))
    if tp > 1:
        out.add("all_reduce", 0, calls=(c - 1) * (fwd + 1))
    return c, out
