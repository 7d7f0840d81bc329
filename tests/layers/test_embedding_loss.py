"""VocabParallelEmbedding and vocab_parallel_cross_entropy against nn.Embedding and
F.cross_entropy, at tp 1, 2 and 4, with their collectives."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_rel
from ops_transformer import (CommLedger, ParallelContext, VocabParallelEmbedding, init_parallel,
                             vocab_parallel_cross_entropy)

V, D, B, S = 16, 6, 3, 5


def _ctx():
    return init_parallel(tp=int(os.environ["WORLD_SIZE"]))


def _embedding(vocab, padding_idx, pad_vocab):
    ctx = _ctx()
    torch.manual_seed(0)
    dense = nn.Embedding(vocab, D, padding_idx=padding_idx)
    idx = torch.randint(0, vocab, (B, S))
    idx[0, 0] = vocab - 1
    if padding_idx is not None:
        idx[1, :2] = padding_idx
    grad_out = torch.randn(B, S, D)
    y_ref = dense(idx)
    y_ref.backward(grad_out)

    layer = VocabParallelEmbedding.from_dense(dense, ctx, pad_vocab=pad_vocab)
    with CommLedger() as fwd:
        y = layer(idx)
    with CommLedger() as bwd:
        y.backward(grad_out)
    rows = layer.num_embeddings_per_rank
    start = ctx.tp_rank * rows
    assert_rel(y, y_ref, what="output")
    ref_grad = torch.cat([dense.weight.grad, torch.zeros(layer.num_embeddings_padded - vocab, D)])
    assert_rel(layer.weight.grad, ref_grad[start:start + rows], what="weight grad")
    assert torch.equal(layer.to_dense().weight, dense.weight)
    return fwd.summary(), bwd.summary(), layer.num_embeddings_padded


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("vocab,padding_idx,pad_vocab", [(16, None, False), (16, 5, False),
                                                         (10, None, True)])
def test_vocab_parallel_embedding(run_ranks, tp, vocab, padding_idx, pad_vocab):
    fwd, bwd, padded = run_ranks(_embedding, tp, vocab, padding_idx, pad_vocab)[0]
    assert padded == -(-vocab // tp) * tp
    expected = {} if tp == 1 else {"all_reduce": {"calls": 1, "elements": B * S * D,
                                                  "bytes": 4 * B * S * D}}
    assert fwd == expected and bwd == {}


def _loss(reduction, smoothing, vocab, with_ignored, weighted=False):
    ctx = _ctx()
    tp, r = ctx.tp_size, ctx.tp_rank
    local = -(-vocab // tp)
    torch.manual_seed(0)
    logits = torch.randn(B, S, vocab) * 3
    target = torch.randint(0, vocab, (B, S))
    weight = torch.rand(vocab) * 2 + 0.1 if weighted else None  # class weights
    if with_ignored:
        target[0, :3] = -100
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten(), reduction=reduction,
                          label_smoothing=smoothing, weight=weight)
    ref = ref.view(B, S) if reduction == "none" else ref
    grad_out = torch.randn(B, S) if reduction == "none" else torch.tensor(1.7)
    ref.backward(grad_out)

    padded = torch.cat([logits, torch.full((B, S, local * tp - vocab), 50.0)], -1)  # junk padding
    shard = padded[..., r * local:(r + 1) * local].clone().requires_grad_()
    with CommLedger() as fwd:
        loss = vocab_parallel_cross_entropy(shard, target, ctx, reduction=reduction,
                                            label_smoothing=smoothing, vocab_size=vocab,
                                            weight=weight)
    with CommLedger() as bwd:
        loss.backward(grad_out)
    assert_rel(loss, ref, what="loss")
    ref_grad = torch.cat([ref_logits.grad, torch.zeros(B, S, local * tp - vocab)], -1)
    assert_rel(shard.grad, ref_grad[..., r * local:(r + 1) * local], what="logits grad")
    return fwd.summary(), bwd.summary()


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("reduction,smoothing,vocab,with_ignored", [
    ("mean", 0.0, 16, True), ("sum", 0.1, 16, False), ("none", 0.0, 16, True),
    ("mean", 0.2, 10, True),
])
def test_vocab_parallel_cross_entropy(run_ranks, tp, reduction, smoothing, vocab, with_ignored):
    fwd, bwd = run_ranks(_loss, tp, reduction, smoothing, vocab, with_ignored)[0]
    n = B * S
    if tp == 1:
        assert fwd == {} and bwd == {}
        return
    stats = 4 if smoothing else 3  # max, sum-exp, target logit (+ sum of logits for smoothing)
    assert fwd == {"all_gather": {"calls": 1, "elements": tp * stats * n,
                                  "bytes": 4 * tp * stats * n}}  # one collective
    assert bwd == {}  # the backward is local: logits are never gathered


@pytest.mark.parametrize("tp,reduction,smoothing,vocab", [
    (2, "mean", 0.1, 10), (4, "mean", 0.1, 10), (2, "sum", 0.2, 16), (4, "sum", 0.2, 10),
    (2, "none", 0.1, 10), (4, "none", 0.1, 16), (2, "mean", 0.0, 16), (1, "mean", 0.1, 10),
])
def test_weighted_vocab_parallel_cross_entropy(run_ranks, tp, reduction, smoothing, vocab):
    """Class weights as F.cross_entropy(weight=...): with ignored targets, label smoothing and a
    padded vocabulary (10 at tp 4); the same single collective."""
    fwd, bwd = run_ranks(_loss, tp, reduction, smoothing, vocab, True, True)[0]
    if tp > 1:
        stats = 4 if smoothing else 3
        assert fwd == {"all_gather": {"calls": 1, "elements": tp * stats * B * S,
                                      "bytes": 4 * tp * stats * B * S}}
        assert bwd == {}


def _all_ignored():
    ctx = _ctx()
    loss = vocab_parallel_cross_entropy(torch.randn(2, 8 // ctx.tp_size), torch.tensor([-100, -100]),
                                        ctx)
    return bool(torch.isnan(loss))  # as F.cross_entropy: 0 / 0


def test_all_ignored_mean_is_nan_like_pytorch(run_ranks):
    assert run_ranks(_all_ignored, 2) == [True, True]


def _bad_tokens():
    ctx = _ctx()
    emb = VocabParallelEmbedding(8, 4, ctx)
    with pytest.raises(ValueError, match=r"contains 8, outside the valid range \[0, 8\)"):
        emb(torch.tensor([1, 8]))
    with pytest.raises(ValueError, match=r"target contains 9, outside the valid range \[0, 8\)"):
        vocab_parallel_cross_entropy(torch.randn(2, 4), torch.tensor([9, -100]), ctx)
    return True


def test_out_of_range_tokens_are_clear_errors(run_ranks):
    assert run_ranks(_bad_tokens, 2) == [True, True]


def test_embedding_vocab_not_divisible():
    ctx = ParallelContext(rank=0, world_size=4, tp_size=4, tp_rank=0, dp_size=1, dp_rank=0)
    with pytest.raises(ValueError, match=r"num_embeddings \(10\) is not divisible by the "
                                         r"tensor-parallel degree tp \(4\)"):
        VocabParallelEmbedding(10, 4, ctx)


@pytest.mark.parametrize("kwargs,needle", [
    ({"reduction": "avg"}, "reduction must be one of"),
    ({"label_smoothing": 1.5}, r"label_smoothing must be in \[0, 1\]"),
    ({"vocab_size": 9}, r"vocab_size \(9\) must be in \(0, 8\]"),
    ({"weight": torch.ones(7)}, r"weight must be a 1-D floating-point tensor of vocab_size \(8\)"),
    ({"weight": torch.ones(8, dtype=torch.long)}, r"dtype torch.int64"),
])
def test_loss_argument_errors(kwargs, needle):
    ctx = ParallelContext.single()
    with pytest.raises(ValueError, match=needle):
        vocab_parallel_cross_entropy(torch.randn(2, 8), torch.tensor([1, 2]), ctx, **kwargs)


def test_loss_shape_mismatch():
    with pytest.raises(ValueError, match=r"needs a target of shape \(2, 3\), got \(6,\)"):
        vocab_parallel_cross_entropy(torch.randn(2, 3, 8), torch.zeros(6, dtype=torch.long),
                                     ParallelContext.single())
