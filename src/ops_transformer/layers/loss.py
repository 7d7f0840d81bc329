"""Cross-entropy over vocabulary-sharded logits; the full logits are never gathered.

With logits ``z`` split along the vocabulary, rank ``r`` holding the columns ``V_r``, each rank
computes per token, from its columns only::

    m_r = max_{v∈V_r} z_v      s_r = Σ_{v∈V_r} exp(z_v − m_r)      t_r = z_target if target ∈ V_r
    S_r = Σ_{v∈V_r} z_v  (with label smoothing)

and one all-gather of these 3 (4) numbers per token combines them (the log-sum-exp of
partitions)::

    M = max_r m_r     log Z = M + log Σ_r s_r·exp(m_r − M)     z_t = Σ_r t_r     S = Σ_r S_r
    loss = (1 − ε)(log Z − z_t) + ε(log Z − S / V)

which is ``F.cross_entropy(z, target, label_smoothing=ε)``. The backward is local:
``∂loss/∂z_v = softmax(z)_v − (1 − ε)·[v = target] − ε / V``. Communication: forward one
all-gather of ``tp·3N`` elements (``tp·4N`` with label smoothing) for ``N`` tokens — one collective,
where Megatron-LM issues three all-reduces — backward none; against ``N·V`` for gathering the logits.
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from .embedding import check_token_range

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, target, group, vocab_start, vocab_size, ignore_index, smoothing):
        logits = logits_shard.float()
        v_local = logits.shape[-1]
        valid_cols = vocab_size - vocab_start  # columns of this shard inside the real vocabulary
        if valid_cols < v_local:  # padded vocabulary: padding columns never take part
            logits = logits.clone()
            logits[..., max(valid_cols, 0):] = float("-inf")
        local_max = logits.max(dim=-1).values  # (...); -inf where a shard is all padding
        shift = local_max.masked_fill(torch.isinf(local_max), 0.0)
        exp = (logits - shift.unsqueeze(-1)).exp()  # (..., V/tp), relative to this shard's max

        local_t = target - vocab_start
        in_shard = (local_t >= 0) & (local_t < v_local)
        safe_t = local_t.masked_fill(~in_shard, 0).unsqueeze(-1)
        target_logit = logits.gather(-1, safe_t).squeeze(-1).masked_fill(~in_shard, 0.0)
        stats = [local_max, exp.sum(-1), target_logit]
        if smoothing > 0:
            stats.append(logits.masked_fill(torch.isinf(logits), 0.0).sum(-1))
        stats = torch.stack(stats)  # (k, ...)
        everyone = stats.new_empty((C.group_size(group) * stats.shape[0], *stats.shape[1:]))
        C.all_gather_into(everyone, stats, group, label="vocab_parallel_ce.stats")
        everyone = everyone.view(-1, *stats.shape)  # (tp, k, ...)

        maxima = everyone[:, 0]
        top = maxima.max(0).values  # the global max per token
        rescale = (maxima.masked_fill(torch.isinf(maxima), 0.0) - top).exp()  # (tp, ...)
        z = (everyone[:, 1] * rescale).sum(0)  # Σ_v exp(z_v − top)
        log_z = z.log() + top
        loss = log_z - everyone[:, 2].sum(0)
        if smoothing > 0:
            uniform = log_z - everyone[:, 3].sum(0) / vocab_size
            loss = (1.0 - smoothing) * loss + smoothing * uniform
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.mul_(((shift - top).exp() / z).unsqueeze(-1))  # reuse the buffer
        ctx.save_for_backward(softmax, safe_t, in_shard, ignored)
        ctx.smoothing, ctx.vocab_size, ctx.valid_cols = smoothing, vocab_size, valid_cols
        ctx.dtype = logits_shard.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_t, in_shard, ignored = ctx.saved_tensors
        grad = softmax  # saved buffer, used once
        eps = ctx.smoothing
        if eps > 0:
            grad = grad - eps / ctx.vocab_size
            if ctx.valid_cols < grad.shape[-1]:
                grad[..., max(ctx.valid_cols, 0):] = 0.0
        grad.scatter_add_(-1, safe_t, (-(1.0 - eps) * in_shard.to(grad.dtype)).unsqueeze(-1))
        scale = grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return (grad * scale).to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, ctx, *,
                                 ignore_index: int = -100, label_smoothing: float = 0.0,
                                 reduction: str = "mean", vocab_size: int | None = None
                                 ) -> torch.Tensor:
    """``F.cross_entropy`` for logits split along the vocabulary over ``ctx``'s TP group.

    ``logits_shard``: ``(..., V/tp)``, this rank's columns (rank ``r`` holds ``[r·V/tp, (r+1)·V/tp)``
    as produced by a column-parallel LM head); ``target``: ``(...)`` with global token ids or
    ``ignore_index``. ``reduction`` is ``"mean"`` (over non-ignored targets, as PyTorch),
    ``"sum"`` or ``"none"``. ``vocab_size`` is the real vocabulary when the sharded logits carry
    padding columns at the end (``tp × V/tp > vocab_size``); they are excluded.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if tuple(logits_shard.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"logits_shard of shape {tuple(logits_shard.shape)} needs a target of "
                         f"shape {tuple(logits_shard.shape[:-1])}, got {tuple(target.shape)}")
    if target.is_floating_point():
        raise ValueError(f"target must hold integer class indices, got dtype {target.dtype}")
    padded_vocab = logits_shard.shape[-1] * ctx.tp_size
    vocab_size = padded_vocab if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded_vocab:
        raise ValueError(f"vocab_size ({vocab_size}) must be in (0, {padded_vocab}] for logits "
                         f"with {logits_shard.shape[-1]} columns per rank at tp {ctx.tp_size}")
    check_token_range(target, vocab_size, "target", allow=ignore_index)
    vocab_start = ctx.tp_rank * logits_shard.shape[-1]
    loss = _VocabParallelCrossEntropy.apply(logits_shard, target, ctx.tp_group, vocab_start,
                                            vocab_size, ignore_index, float(label_smoothing))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
