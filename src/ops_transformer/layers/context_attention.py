"""Context-parallel attention: every rank holds a part of each sequence; K/V travel, queries stay.

The sequence of ``s`` tokens is cut into ``2·cp`` chunks of ``c = s/(2·cp)``; rank ``r`` holds
chunks ``r`` and ``2·cp−1−r`` (head-tail balancing: under a causal mask every rank then has the same
work, as in Megatron-LM's CP and torchtitan)::

    cp = 2, s = 8 (c = 2)     chunk:   0     1     2     3
                              tokens: 0 1 | 2 3 | 4 5 | 6 7
                              rank 0:  ███               ███     (positions 0 1 6 7)
                              rank 1:        ███   ███           (positions 2 3 4 5)

``ring`` (Liu et al. 2023, Ring Attention): ``cp`` steps; at step ``i`` rank ``r`` attends its
queries to the K/V block of rank ``r−i`` while the next block is already on its way
(:func:`~ops_transformer.comm.ring.ring_shift`, posted before the block is computed); the partial
outputs merge exactly by their log-sum-exp. Under the causal mask a step computes only the chunk
pairs that see each other (all of them for ``i = 0``, half for the others). Backward is the mirror
image: K/V circulate again and each block's dK/dV accumulator travels with it, arriving back at its
owner after ``cp`` hops.

``allgather_kv`` (Llama 3): one all-gather of K and V over the ``cp`` group, attention of the local
queries against the whole sequence (masked by position), and in backward one reduce-scatter of
dK/dV (:func:`~ops_transformer.comm.primitives.all_gather_along`).

====================== ========================================= ==============================
strategy               forward                                   backward
====================== ========================================= ==============================
``ring``               ``cp−1`` ``send_recv`` of K,V blocks       ``cp−1`` of K,V, ``cp`` of dK,dV
``allgather_kv``       one all-gather of K,V                     one reduce-scatter of dK,dV
====================== ========================================= ==============================

Both are exact (the same softmax; only the order of the sums differs). GQA: ``q`` has ``nh`` heads,
``k``/``v`` ``nkv``; query head ``j`` uses KV head ``j // (nh/nkv)``, as ``repeat_interleave``
would, without repeating K/V. Under tensor parallelism each rank passes its own heads. The volumes
are :func:`ops_transformer.planner.context_parallel.layer_comm`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.collectives import group_rank, group_size
from ..comm.primitives import all_gather_along
from ..comm.ring import ring_shift
from ..models.documents import document_mask, document_runs
from .context_dropout import AttentionDropout, block_dropout, explicit_attention
from .dropout import Layout, draw_seed, head_tail_positions
from .ulysses import ulysses_attention
from ..planner.context_parallel import CP_STRATEGIES, check_sequence, check_strategy

NEG_INF = float("-inf")


def head_tail_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2·cp``) that rank ``cp_rank`` holds: ``r`` and ``2·cp−1−r``."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_local: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """The positions in the whole sequence of the ``seq_local`` tokens rank ``cp_rank`` holds."""
    return head_tail_positions(seq_local, cp_rank, cp, device)


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``dim`` (the sequence), head-tail balanced; a
    ``ValueError`` naming the sizes when ``2·cp`` does not divide it."""
    if cp == 1:
        return x
    c = check_sequence(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, k * c, c) for k in head_tail_chunks(cp_rank, cp)], dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's :func:`shard_sequence` (in ``cp`` rank order)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        head, tail = part.chunk(2, dim)
        a, b = head_tail_chunks(r, cp)
        chunks[a], chunks[b] = head, tail
    return torch.cat(chunks, dim)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _merge_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the partial outputs merge in: float64 (every merge rescales the running
    output by ``exp(lse_old − lse_new)``; in float32 those roundings add up to ~1e-6 in dQ, the
    cancellation ``dP − rowsum(dO ∘ O)`` amplifying the output's error)."""
    return torch.float64


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (a row that sees nothing yet) as 0, so ``exp(s − lse)`` stays 0."""
    return lse.masked_fill(lse == NEG_INF, 0.0)


def _step_plan(r: int, src: int, p: int, S: int, causal: bool, device):
    """``(rows, cols, mask)`` of the ring step at which rank ``r`` holds rank ``src``'s block: the
    local query rows and block key columns that see each other (chunk slices) and the causal mask
    among them (``None``: all visible); ``None`` when nothing is visible. Decided from the chunk
    numbers on the host (no device sync); a mask is built only for a diagonal chunk pair."""
    full = slice(0, S)
    if not causal:
        return full, full, None
    c = S // 2
    q_chunks, k_chunks = head_tail_chunks(r, p), head_tail_chunks(src, p)
    # chunk pair (i, j) is visible unless the key chunk comes after the query chunk
    seen = [[kc <= qc for kc in k_chunks] for qc in q_chunks]
    rows = [i for i in (0, 1) if any(seen[i])]
    cols = [j for j in (0, 1) if any(seen[i][j] for i in rows)]
    rows_s = slice(rows[0] * c, (rows[-1] + 1) * c)
    cols_s = slice(cols[0] * c, (cols[-1] + 1) * c)
    if all(k_chunks[j] < q_chunks[i] for i in rows for j in cols):
        return rows_s, cols_s, None
    q_pos = local_positions(S, r, p, device)[rows_s]
    k_pos = local_positions(S, src, p, device)[cols_s]
    return rows_s, cols_s, q_pos.unsqueeze(1) >= k_pos.unsqueeze(0)  # (rows, cols)


def _scores(q5, k, scale, mask):
    """``(B, nkv, g, Sq, Sk)`` scaled scores of grouped queries against ``(B, nkv, Sk, d)`` keys;
    ``mask`` ``(Sq, Sk)`` or ``(B, 1, 1, Sq, Sk)``, True where visible."""
    s = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, NEG_INF)


def _with_documents(mask, q_runs, k_runs):
    """``mask`` (causal, or ``None``) and, with documents, the same-document condition:
    ``(B, 1, 1, Sq, Sk)``; ``q_runs`` ``(B, Sq)``, ``k_runs`` ``(B, Sk)`` document indices."""
    if q_runs is None:
        return mask
    same = (q_runs.unsqueeze(2) == k_runs.unsqueeze(1))  # (B, Sq, Sk)
    if mask is not None:
        same = same & mask
    return same[:, None, None]


def _block(r, src, p, S, causal, runs, device):
    """The plan of the step at which rank ``r`` holds rank ``src``'s block, with the document
    condition: ``(rows, cols, mask)`` or ``None``."""
    plan = _step_plan(r, src, p, S, causal, device)
    if plan is None or runs is None:
        return plan
    rows, cols, mask = plan
    q_runs = shard_sequence(runs, r, p)[:, rows]
    k_runs = shard_sequence(runs, src, p)[:, cols]
    return rows, cols, _with_documents(mask, q_runs, k_runs)


class _RingAttention(torch.autograd.Function):
    """Ring attention over ``group`` (forward and backward above); inputs ``(B, nh, S, d)``,
    ``(B, nkv, S, d)`` with ``S`` this rank's two chunks."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, runs, drop):
        p, r = group_size(group), group_rank(group)
        B, H, S, D = q.shape
        nkv, acc = k.shape[1], _acc_dtype(q.dtype)
        q5 = q.reshape(B, nkv, H // nkv, S, D).to(acc)
        out = q5.new_zeros(q5.shape, dtype=_merge_dtype(q.dtype))
        lse = q5.new_full(q5.shape[:-1], NEG_INF, dtype=out.dtype)
        kv = torch.stack([k, v])  # (2, B, nkv, S, d): one message a step
        for step in range(p):
            pending = ring_shift(kv, group, label="cp.ring.fwd") if step < p - 1 else None
            plan = _block(r, (r - step) % p, p, S, causal, runs, q.device)
            if plan is not None:
                rows, cols, mask = plan
                s = _scores(q5[..., rows, :], kv[0][..., cols, :].to(acc), scale, mask)
                blk_lse = torch.logsumexp(s, -1)
                weights = torch.exp(s - _finite(blk_lse).unsqueeze(-1))  # (B, nkv, g, rows, cols)
                if drop is not None:  # dropout after the softmax: it commutes with the merge
                    weights = weights * block_dropout(drop, r, (r - step) % p, rows, cols, q5)
                blk_out = weights @ kv[1][..., cols, :].to(acc).unsqueeze(2)
                blk_lse, blk_out = blk_lse.to(out.dtype), blk_out.to(out.dtype)
                old_lse = lse[..., rows]
                new_lse = torch.logaddexp(old_lse, blk_lse)
                safe = _finite(new_lse)
                out[..., rows, :] = (out[..., rows, :] * torch.exp(old_lse - safe).unsqueeze(-1)
                                     + blk_out * torch.exp(blk_lse - safe).unsqueeze(-1))
                lse[..., rows] = new_lse
            if pending is not None:
                kv = pending.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.runs, ctx.drop = group, causal, scale, runs, drop
        return out.reshape(B, H, S, D).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, runs = ctx.group, ctx.causal, ctx.scale, ctx.runs
        p, r = group_size(group), group_rank(group)
        B, H, S, D = q.shape
        nkv, acc = k.shape[1], _acc_dtype(q.dtype)
        q5 = q.reshape(B, nkv, H // nkv, S, D).to(acc)
        do5 = grad_out.contiguous().reshape(q5.shape).to(acc)
        # rowsum(dO ∘ O), (B, nkv, g, S), from the merged output at its own precision
        delta = (do5.to(out.dtype) * out).sum(-1).to(acc)
        lse = lse.to(acc)
        dq = torch.zeros_like(q5)
        kv = torch.stack([k, v])
        dkv = kv.new_zeros(kv.shape, dtype=acc)  # the accumulator of the block held this step
        pending_dkv = None
        for step in range(p):
            pending_kv = ring_shift(kv, group, label="cp.ring.bwd") if step < p - 1 else None
            if pending_dkv is not None:
                dkv = pending_dkv.wait()  # the accumulator of this step's block, from the left
            plan = _block(r, (r - step) % p, p, S, causal, runs, q.device)
            if plan is not None:
                rows, cols, mask = plan
                k_blk, v_blk = kv[0][..., cols, :].to(acc), kv[1][..., cols, :].to(acc)
                probs = torch.exp(_scores(q5[..., rows, :], k_blk, scale, mask)
                                  - lse[..., rows].unsqueeze(-1))  # (B, nkv, g, rows, cols)
                do_rows = do5[..., rows, :]
                dropped, dprobs = probs, do_rows @ v_blk.unsqueeze(2).transpose(-1, -2)
                if ctx.drop is not None:  # the forward's mask, drawn again from its indices
                    mask = block_dropout(ctx.drop, r, (r - step) % p, rows, cols, q5)
                    dropped, dprobs = probs * mask, dprobs * mask
                dkv[1][..., cols, :] += (dropped.transpose(-1, -2) @ do_rows).sum(2)
                ds = probs * (dprobs - delta[..., rows].unsqueeze(-1)) * scale
                dq[..., rows, :] += ds @ k_blk.unsqueeze(2)
                dkv[0][..., cols, :] += (ds.transpose(-1, -2) @ q5[..., rows, :]).sum(2)
            pending_dkv = ring_shift(dkv, group, label="cp.ring.bwd")  # to the block's next holder
            if pending_kv is not None:
                kv = pending_kv.wait()
        dkv = pending_dkv.wait()  # our own block's, home after p hops
        return (dq.reshape(B, H, S, D).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None)


def ring_attention(q, k, v, group, *, causal: bool = True, scale: float | None = None,
                   document_ids=None, dropout: AttentionDropout | None = None):
    """Ring attention of this rank's queries ``(B, nh, S, d)`` against the whole sequence, whose
    K/V ``(B, nkv, S, d)`` are spread head-tail over ``group``; returns ``(B, nh, S, d)``.
    ``document_ids``: the *whole* sequences' ``(B, cp·S)`` (every rank has them; none travel)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    runs = None if document_ids is None else document_runs(document_ids)
    return _RingAttention.apply(q, k, v, group, causal, scale, runs, dropout)


def allgather_kv_attention(q, k, v, group, *, causal: bool = True, scale: float | None = None,
                           document_ids=None, dropout: AttentionDropout | None = None):
    """All-gather K/V over ``group``, then this rank's queries against the whole sequence."""
    p, r = group_size(group), group_rank(group)
    S = q.shape[2]
    kv = all_gather_along(torch.stack([k, v]), group, 3, label="cp.allgather_kv")
    mask = None
    if causal:
        k_pos = torch.cat([local_positions(S, j, p, q.device) for j in range(p)])
        mask = local_positions(S, r, p, q.device).unsqueeze(1) >= k_pos.unsqueeze(0)
    if document_ids is not None:
        runs = document_runs(document_ids)
        k_runs = torch.cat([shard_sequence(runs, j, p) for j in range(p)], 1)
        mask = _with_documents(mask, shard_sequence(runs, r, p), k_runs)[:, 0]  # (B, 1, S, pS)
    if dropout is not None:
        k_pos = torch.cat([local_positions(S, j, p, q.device) for j in range(p)])
        return explicit_attention(q, kv[0], kv[1], mask, scale, dropout,
                                  local_positions(S, r, p, q.device), k_pos, S * p)
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask,
                                          is_causal=causal and mask is None, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def context_parallel_attention(q, k, v, group, *, strategy: str = "ring", causal: bool = True,
                               scale: float | None = None, document_ids=None,
                               dropout: AttentionDropout | None = None):
    """Attention over a sequence split head-tail over ``group`` with ``strategy`` (``ring``,
    ``allgather_kv`` or ``ulysses``, :mod:`.ulysses`): this rank's ``(B, nh, S, d)`` queries, ``(B, nkv, S, d)`` keys and values;
    ``S`` must be even (two chunks). ``document_ids`` ``(B, cp·S)``: the whole sequences'
    documents (:mod:`ops_transformer.models.documents`); a query never sees another document."""
    check_strategy(strategy)
    if group_size(group) == 1:  # the whole sequence here
        mask = None if document_ids is None else document_mask(document_ids)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              is_causal=causal and mask is None, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    if q.shape[2] % 2:
        raise ValueError(f"context-parallel attention: this rank's {q.shape[2]} tokens must be "
                         f"two equal chunks (head and tail)")
    if document_ids is not None and document_ids.shape[1] != q.shape[2] * group_size(group):
        raise ValueError(f"context-parallel attention takes the whole sequences' document_ids: "
                         f"{q.shape[2] * group_size(group)} per row, got "
                         f"{tuple(document_ids.shape)}")
    fn = {"ring": ring_attention, "allgather_kv": allgather_kv_attention,
          "ulysses": ulysses_attention}[strategy]
    return fn(q, k, v, group, causal=causal, scale=scale, document_ids=document_ids,
              dropout=dropout)


class ContextParallelCore(nn.Module):
    """The attention core (``Attention.core(q, k, v)`` of the reference GPT) over a sequence split
    by the ``cp`` group of ``ctx``: causal, this rank's heads (TP) and its two chunks (CP)."""

    def __init__(self, ctx, strategy: str, reason: str = "", switch=None,
                 dropout: float = 0.0):
        super().__init__()
        check_strategy(strategy)
        self.group, self.cp_size, self.strategy, self.reason = ctx.cp_group, ctx.cp_size, \
            strategy, reason
        self.switch = switch  # ``switch.on`` False: the sequence is whole here (generation)
        # dropout of the probabilities: the one-device mask of this rank's rows, heads and
        # blocks (micro_batch_masks moves ``dropout_layout`` under gradient accumulation)
        self.dropout = dropout
        self.dropout_layout = Layout("heads", ctx.tp_rank, ctx.tp_size, ctx.dp_ep_rank,
                                     ctx.dp_ep_size, ctx.cp_rank, ctx.cp_size)

    def forward(self, q, k, v, document_ids=None):
        if self.switch is not None and not self.switch.on:  # the whole sequence on every rank
            return context_parallel_attention(q, k, v, None, document_ids=document_ids)
        drop = None
        if self.training and self.dropout > 0:  # one seed per call, as the one-device core
            drop = AttentionDropout(self.dropout, draw_seed(q.device), self.dropout_layout)
        return context_parallel_attention(q, k, v, self.group, strategy=self.strategy,
                                          document_ids=document_ids, dropout=drop)

    def extra_repr(self) -> str:
        comm = {"ring": "ring send_recv of K/V (fwd), K/V and dK/dV (bwd)",
                "allgather_kv": "all-gather K/V (fwd), reduce-scatter dK/dV (bwd)",
                "ulysses": "all-to-all of Q, K/V and the output over heads (fwd and bwd)"
                }[self.strategy]
        return f"strategy={self.strategy}, cp={self.cp_size}, {comm}" + (
            f", dropout={self.dropout:g} (one-device masks per block)" if self.dropout else "")


__all__ = ["CP_STRATEGIES", "ContextParallelCore", "allgather_kv_attention",
           "context_parallel_attention", "head_tail_chunks", "local_positions", "ring_attention",
           "shard_sequence", "unshard_sequence"]
