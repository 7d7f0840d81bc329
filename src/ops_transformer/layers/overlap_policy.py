"""How many chunks a chunked region runs, and what each decided: :class:`OverlapPolicy`.

Every chunked region (:mod:`.overlap_regions`) and chunked experts (:mod:`.moe_overlap`) hold one.
With ``overlap="chunked"`` it answers the plan's ``chunks``; with ``"auto"`` it asks the cost
model's one formula (:func:`~ops_transformer.planner.overlap.choose_chunks`) for the region's
sizes on the agreed profile, once per size, and keeps the choice with its reason —
:func:`overlap_decisions` reads them back, :func:`overlap_summary` in one line (``train`` writes
both into its metrics).
"""

from __future__ import annotations

import logging

import torch

from ..planner.choose import resolve_profile
from ..planner.overlap import ChunkChoice, choose_chunks, region_pieces, size_bucket

log = logging.getLogger("ops_transformer")


class OverlapPolicy:
    """How many chunks one region runs: ``chunks`` (``mode="chunked"``), or the cost model's
    choice for each new size (``"auto"``, at most ``chunks``; sizes rounded down to a power of
    two, :func:`~ops_transformer.planner.overlap.size_bucket`), kept in :attr:`decisions`
    (``{(region, tokens, in, out, dtype): ChunkChoice}``) with its reason."""

    def __init__(self, mode: str, chunks: int, profile=None):
        self.mode, self.chunks, self.profile = mode, chunks, resolve_profile(profile)
        self.decisions: dict[tuple, ChunkChoice] = {}

    def chunks_for(self, region: str, tokens: int, in_features: int, out_features: int,
                   group_size: int, dtype: torch.dtype) -> int:
        bucket = size_bucket(tokens)  # decided per power of two of the tokens
        key = (region, bucket, in_features, out_features, dtype)
        choice = self.decisions.get(key)
        if choice is None:
            if self.mode == "chunked":
                choice = ChunkChoice(self.chunks, 0.0, f"{self.chunks} chunks (as requested)")
            else:
                pieces = region_pieces(region, bucket, in_features, out_features, group_size)
                element = torch.empty((), dtype=dtype).element_size()
                choice = choose_chunks(pieces, self.chunks, self.profile, element)
            self.decisions[key] = choice
            if not torch.compiler.is_compiling():  # a log call is a graph break under Dynamo
                log.debug("overlap %s (%d tokens): %s", region, tokens, choice.reason)
        return choice.chunks

    def __repr__(self) -> str:
        return (f"overlap={self.mode} (chunks {'<= ' if self.mode == 'auto' else ''}"
                f"{self.chunks})")


def overlap_policies(model: torch.nn.Module) -> dict[str, OverlapPolicy]:
    """``{module name: its OverlapPolicy}`` for every chunked region of ``model`` (the experts'
    too)."""
    return {name: m.overlap for name, m in model.named_modules()
            if isinstance(getattr(m, "overlap", None), OverlapPolicy)}


def overlap_decisions(model: torch.nn.Module) -> dict[str, list[dict]]:
    """What each chunked region decided, per size it ran: ``{module name: [{"region", "tokens",
    "chunks", "reason"}]}`` (``region``: the cost formula's kind; empty before the first call)."""
    return {name: [{"region": key[0], "tokens": key[1], "chunks": choice.chunks,
                    "reason": choice.reason} for key, choice in policy.decisions.items()]
            for name, policy in overlap_policies(model).items()}


def overlap_summary(model: torch.nn.Module) -> str:
    """One line: how many of the regions' decisions run in chunks, and one reason of each kind."""
    decided = [(name, d) for name, ds in overlap_decisions(model).items() for d in ds]
    if not decided:
        return "no chunked region ran" if overlap_policies(model) else "overlap none"
    chunked = [(n, d) for n, d in decided if d["chunks"] > 1]
    plain = [(n, d) for n, d in decided if d["chunks"] == 1]
    parts = [f"{len(chunked)} of {len(decided)} region sizes in chunks"]
    for name, d in (chunked[:1] + plain[:1]):
        parts.append(f"{name} ({d['region']}, {d['tokens']} tokens): {d['reason']}")
    return "; ".join(parts)
