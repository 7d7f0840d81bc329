"""Dropout inside context-parallel attention (:mod:`.context_attention`): the attention
probabilities take the one-device mask (:mod:`.dropout`: a counter-based hash of each
probability's index in the one-device ``(b, heads, s, s)`` tensor under one seed per call), each
block of query and key positions exactly its part, drawn again in the backward recompute."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .dropout import Layout, _MaskedScale, head_tail_positions, keep_mask

NEG_INF = float("-inf")


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout ``p`` of the attention probabilities with the one-device mask
    (:mod:`.dropout`: a counter-based hash of each probability's index in the one-device
    ``(b, heads, s, s)`` tensor under one ``seed`` per call): a block of query and key positions
    draws exactly its part, in forward and again in the backward recompute, so nothing is kept.
    ``layout`` places this rank's rows (``dp``) and heads (``tp``)."""

    p: float
    seed: torch.Tensor
    layout: Layout

    def scale(self, heads: int, q_pos, k_pos, seq: int, batch: int, dtype) -> torch.Tensor:
        """``(batch, heads, len(q_pos), len(k_pos))``: ``1/(1−p)`` where kept, else 0."""
        index = self.layout.attention_index(batch, heads, q_pos, k_pos, seq)
        keep = keep_mask(self.seed, index, self.p)
        return keep.to(dtype) * (1.0 / (1.0 - self.p))


def block_dropout(drop: AttentionDropout, r: int, src: int, rows: slice, cols: slice, q5):
    """The dropout factors of the block of rank ``r``'s query ``rows`` and rank ``src``'s key
    ``cols``: ``(B, nkv, g, rows, cols)``."""
    B, nkv, g, S, _ = q5.shape
    p = drop.layout.cp
    q_pos = head_tail_positions(S, r, p, q5.device)[rows]
    k_pos = head_tail_positions(S, src, p, q5.device)[cols]
    return drop.scale(nkv * g, q_pos, k_pos, S * p, B, q5.dtype).view(
        B, nkv, g, len(q_pos), len(k_pos))


def explicit_attention(q, k, v, mask, scale, drop: AttentionDropout, q_pos, k_pos, seq: int,
                       layout: Layout | None = None):
    """Scores, softmax, the one-device dropout, weighted sum (SDPA's math path; its own dropout
    mask cannot be split): ``(B, nh, Sq, d)`` queries at positions ``q_pos`` against
    ``(B, nkv, Sk, d)`` keys at ``k_pos`` of a ``seq``-token sequence; ``mask`` True where
    visible (or ``None``); ``layout``: where these heads sit (default ``drop.layout``'s)."""
    if k.shape[1] != q.shape[1]:  # GQA
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, nh, Sq, Sk)
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    probs = F.softmax(scores, dim=-1)
    index = (layout or drop.layout).attention_index(q.shape[0], q.shape[1], q_pos, k_pos, seq)
    keep = keep_mask(drop.seed, index, drop.p)
    return _MaskedScale.apply(probs, keep, 1.0 / (1.0 - drop.p)) @ v
