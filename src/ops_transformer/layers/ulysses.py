"""Ulysses context parallelism: an all-to-all turns "all heads, part of the sequence" into "part of
the heads, all the sequence", attention runs unsplit, and a second all-to-all turns it back
(Jacobs et al. 2023, *DeepSpeed Ulysses*)::

    rank r:  q (b, h, s/cp, d) ── all-to-all ──▶ (b, h/cp, s, d)   heads r·h/cp … (r+1)·h/cp − 1
             k, v (b, h_kv, s/cp, d) ── one all-to-all ──▶ (b, h_kv/cp, s, d)
             attention over the whole sequence (SDPA, causal or document mask; GQA kept)
             out (b, h/cp, s, d) ── all-to-all ──▶ (b, h, s/cp, d)

==========================  =====================================  ==========================
piece                       forward                                backward
==========================  =====================================  ==========================
Q, K/V, output              3 all-to-alls (``cp.ulysses.fwd``) of   the same 3, reversed
                            ``b·(s/cp)·q_dim``, ``2·b·(s/cp)·kv``   (``cp.ulysses.bwd``)
                            and ``b·(s/cp)·q_dim`` elements
==========================  =====================================  ==========================

(:func:`~ops_transformer.planner.context_parallel.layer_comm`, ``"ulysses"``). ``cp`` must divide
this rank's query and KV heads (so ``cp ≤ kv heads``). Each rank holds its head-tail chunks
(:mod:`.context_attention`); the gathered sequence is put back in order before attention and cut
again after it. With dropout the probabilities are computed explicitly and take the one-device
mask of this rank's heads (:mod:`.dropout`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm.collectives import group_rank, group_size
from ..comm.primitives import all_to_all
from ..models.documents import document_mask
from ..planner.context_parallel import check_ulysses
from .context_dropout import explicit_attention
from .dropout import Layout, head_tail_positions

LABEL = "cp.ulysses"


def _order(seq_local: int, cp: int, device) -> torch.Tensor:
    """The whole-sequence positions of the ranks' tokens, rank after rank."""
    return torch.cat([head_tail_positions(seq_local, j, cp, device) for j in range(cp)])


def heads_to_sequence(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """``(..., h, s/cp, d)`` → ``(..., h/cp, s, d)``: this rank's share of the heads over the
    whole sequence, in order (one all-to-all)."""
    *lead, h, s_local, d = x.shape
    parts = x.reshape(*lead, cp, h // cp, s_local, d).movedim(-4, 0)  # (cp, ..., h/cp, s/cp, d)
    got = all_to_all(parts.contiguous(), group, label=LABEL)  # dim 0: the source rank
    whole = torch.cat(got.unbind(0), dim=-2)  # (..., h/cp, s, d) in rank order
    return whole.index_select(-2, torch.argsort(_order(s_local, cp, x.device)))


def sequence_to_heads(y: torch.Tensor, group, cp: int) -> torch.Tensor:
    """``(b, h/cp, s, d)`` → ``(b, h, s/cp, d)``: back to this rank's tokens, all heads."""
    b, hc, s, d = y.shape
    ranked = y.index_select(-2, _order(s // cp, cp, y.device))  # rank after rank
    parts = torch.stack(ranked.chunk(cp, dim=-2))  # (cp, b, h/cp, s/cp, d): one part per rank
    got = all_to_all(parts, group, label=LABEL)  # dim 0: whose heads
    return got.movedim(0, 1).reshape(b, cp * hc, s // cp, d)


def ulysses_attention(q, k, v, group, *, causal: bool = True, scale: float | None = None,
                      document_ids=None, dropout=None):
    """Attention of this rank's ``(B, nh, S, d)`` queries, ``(B, nkv, S, d)`` keys and values
    (its head-tail chunks) over the whole sequence by two head/sequence all-to-alls (module
    docstring); returns ``(B, nh, S, d)``. ``document_ids``: the whole rows' ``(B, cp·S)``.
    ``dropout``: an :class:`~.context_attention.AttentionDropout` or ``None``."""
    cp = group_size(group)
    check_ulysses(q.shape[1], k.shape[1], cp)
    q_all = heads_to_sequence(q, group, cp)  # (B, nh/cp, cp·S, d)
    kv_all = heads_to_sequence(torch.stack([k, v]), group, cp)  # (2, B, nkv/cp, cp·S, d)
    mask = None if document_ids is None else document_mask(document_ids)  # (B, 1, s, s)
    if dropout is None:
        out = F.scaled_dot_product_attention(q_all, kv_all[0], kv_all[1], attn_mask=mask,
                                             is_causal=causal and mask is None, scale=scale,
                                             enable_gqa=kv_all.shape[2] != q_all.shape[1])
    else:
        out = _with_dropout(q_all, kv_all[0], kv_all[1], mask, causal, scale, dropout,
                            group_rank(group), cp)
    return sequence_to_heads(out, group, cp)


def _with_dropout(q, k, v, mask, causal, scale, drop, r: int, cp: int):
    """The whole sequence's attention with the one-device dropout of this rank's heads: heads
    ``r·h/cp …`` of the TP rank's, i.e. a TP layout of ``tp·cp`` ranks."""
    s = q.shape[2]
    if causal:
        visible = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        mask = visible if mask is None else mask & visible
    lay = drop.layout
    heads = Layout("heads", lay.tp_rank * cp + r, lay.tp * cp, lay.dp_rank, lay.dp)
    position = torch.arange(s, device=q.device)
    return explicit_attention(q, k, v, mask, scale, drop, position, position, s, heads)
