"""Cross-entropy over vocabulary-sharded logits; the full logits are never gathered.

With logits ``z`` split along the vocabulary, rank ``r`` holding the columns ``V_r``, each rank
computes per token, from its columns only::

    m_r = max_{v∈V_r} z_v      s_r = Σ_{v∈V_r} exp(z_v − m_r)      t_r = z_target if target ∈ V_r
    S_r = Σ_{v∈V_r} w_v·z_v  (with label smoothing; w_v = 1 without class weights)

and one all-gather of these 3 (4) numbers per token combines them (the log-sum-exp of
partitions)::

    M = max_r m_r     log Z = M + log Σ_r s_r·exp(m_r − M)     z_t = Σ_r t_r     S = Σ_r S_r
    loss = (1 − ε)·w_t·(log Z − z_t) + ε/V·(W·log Z − S)        W = Σ_v w_v

which is ``F.cross_entropy(z, target, weight=w, label_smoothing=ε)`` per token (``w_t``, the
target's class weight, and ``W`` need no communication: every rank holds the class weights). The
``mean`` reduction divides by ``Σ w_t`` over non-ignored tokens (their count without weights), as
PyTorch does. The backward is local: ``∂loss/∂z_v = softmax(z)_v·((1 − ε)·w_t + ε·W/V) − (1 −
ε)·w_t·[v = target] − ε·w_v / V``. Communication: forward one all-gather of ``tp·3N`` elements
(``tp·4N`` with label smoothing) for ``N`` tokens — one collective, where Megatron-LM issues three
all-reduces — backward none; against ``N·V`` for gathering the logits.
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from .embedding import check_token_range

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, target, group, vocab_start, vocab_size, ignore_index, smoothing,
                weights):
        # weights: None, or (w_local (V/tp,) zero on padding, w_target (...), W = Σ_v w_v)
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
            finite = logits.masked_fill(torch.isinf(logits), 0.0)
            stats.append(finite.sum(-1) if weights is None else finite @ weights[0])
        stats = torch.stack(stats)  # (k, ...)
        everyone = stats.new_empty((C.group_size(group) * stats.shape[0], *stats.shape[1:]))
        C.all_gather_into(everyone, stats, group, label="vocab_parallel_ce.stats")
        everyone = everyone.view(-1, *stats.shape)  # (tp, k, ...)

        maxima = everyone[:, 0]
        top = maxima.max(0).values  # the global max per token
        rescale = (maxima.masked_fill(torch.isinf(maxima), 0.0) - top).exp()  # (tp, ...)
        z = (everyone[:, 1] * rescale).sum(0)  # Σ_v exp(z_v − top)
        log_z = z.log() + top
        w_t, w_sum = (1.0, float(vocab_size)) if weights is None else weights[1:]
        loss = (log_z - everyone[:, 2].sum(0)) * w_t
        if smoothing > 0:
            uniform = (w_sum * log_z - everyone[:, 3].sum(0)) / vocab_size
            loss = (1.0 - smoothing) * loss + smoothing * uniform
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.mul_(((shift - top).exp() / z).unsqueeze(-1))  # reuse the buffer
        ctx.save_for_backward(softmax, safe_t, in_shard, ignored,
                              *(weights[:2] if weights is not None else ()))
        ctx.smoothing, ctx.vocab_size, ctx.valid_cols = smoothing, vocab_size, valid_cols
        ctx.w_sum, ctx.dtype = w_sum, logits_shard.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_t, in_shard, ignored, *weights = ctx.saved_tensors
        grad = softmax  # saved buffer, used once
        eps = ctx.smoothing
        target_coef = (1.0 - eps) * in_shard.to(grad.dtype)
        if weights:  # class weights: every term scales with them
            w_local, w_t = weights
            grad.mul_(((1.0 - eps) * w_t + eps * ctx.w_sum / ctx.vocab_size).unsqueeze(-1))
            if eps > 0:
                grad.sub_(eps / ctx.vocab_size * w_local)  # w_local is zero on padding columns
            target_coef = target_coef * w_t
        elif eps > 0:
            grad = grad - eps / ctx.vocab_size
            if ctx.valid_cols < grad.shape[-1]:
                grad[..., max(ctx.valid_cols, 0):] = 0.0
        grad.scatter_add_(-1, safe_t, (-target_coef).unsqueeze(-1))
        scale = grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return (grad * scale).to(ctx.dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, ctx, *,
                                 ignore_index: int = -100, label_smoothing: float = 0.0,
                                 reduction: str = "mean", vocab_size: int | None = None,
                                 weight: torch.Tensor | None = None) -> torch.Tensor:
    """``F.cross_entropy`` for logits split along the vocabulary over ``ctx``'s TP group.

    ``logits_shard``: ``(..., V/tp)``, this rank's columns (rank ``r`` holds ``[r·V/tp, (r+1)·V/tp)``
    as produced by a column-parallel LM head); ``target``: ``(...)`` with global token ids or
    ``ignore_index``. ``reduction`` is ``"mean"`` (over non-ignored targets, as PyTorch),
    ``"sum"`` or ``"none"``. ``vocab_size`` is the real vocabulary when the sharded logits carry
    padding columns at the end (``tp × V/tp > vocab_size``); they are excluded. ``weight``: the
    class weights as ``F.cross_entropy`` takes them, a ``(vocab_size,)`` tensor, the same on
    every rank (each uses its columns' slice; ``mean`` then divides by the summed weights of the
    non-ignored targets).
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
    weights = None if weight is None else _class_weights(weight, target, vocab_start,
                                                         logits_shard.shape[-1], vocab_size,
                                                         ignore_index)
    loss = _VocabParallelCrossEntropy.apply(logits_shard, target, ctx.tp_group, vocab_start,
                                            vocab_size, ignore_index, float(label_smoothing),
                                            weights)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    kept = target != ignore_index
    return loss.sum() / (kept.sum() if weights is None else weights[1][kept].sum())


def _class_weights(weight, target, vocab_start, v_local, vocab_size, ignore_index):
    """``(w_local, w_target, W)``: this shard's class weights (zero on padding columns), each
    token's target weight (zero where ignored) and the sum over the real vocabulary."""
    if weight.dim() != 1 or weight.shape[0] != vocab_size or weight.is_complex() \
            or not weight.is_floating_point():
        raise ValueError(f"weight must be a 1-D floating-point tensor of vocab_size "
                         f"({vocab_size}) class weights, got shape {tuple(weight.shape)} and "
                         f"dtype {weight.dtype}")
    weight = weight.detach().float()
    w_local = weight.new_zeros(v_local)
    local = weight[vocab_start:vocab_start + v_local]
    w_local[:local.shape[0]] = local
    ignored = target == ignore_index
    w_target = weight[target.masked_fill(ignored, 0)].masked_fill(ignored, 0.0)
    return w_local, w_target, weight.sum()  # a tensor: no host synchronisation
