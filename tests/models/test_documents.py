"""Packed documents: a packed row with ``document_ids`` gives the loss and gradients of its
documents run one by one (the reference GPT, learned positions and RoPE/GQA); the naive packing
(no ids) does not — attention crosses the documents and positions run on."""

from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from ops_transformer import GPT
from ops_transformer.models.documents import (document_mask, document_positions, document_runs,
                                              document_targets)
from ops_transformer.models.gpt import preset

LENGTHS = (5, 7, 4)  # three documents packed in one row of 16


def _row(vocab):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (1, sum(LENGTHS) + 1), generator=g)
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)]).unsqueeze(0)
    return tokens[:, :-1], tokens[:, 1:], ids


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _alone(model, x, y):
    """Each document run by itself: Σ of the per-document loss sums ÷ all targets. A document
    predicts its own next tokens (n − 1); the last one also the token after the row (it goes on
    beyond it)."""
    model.zero_grad()
    total, count, start = 0.0, sum(LENGTHS) - len(LENGTHS) + 1, 0
    for i, n in enumerate(LENGTHS):
        last = i == len(LENGTHS) - 1
        inputs = x[:, start:start + n] if last else x[:, start:start + n - 1]
        targets = y[:, start:start + n] if last else y[:, start:start + n - 1]
        _, loss = model(inputs, targets)
        (loss * targets.numel() / count).backward()
        total += float(loss.detach()) * targets.numel() / count
        start += n
    return total, _grads(model)


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_packed_row_equals_its_documents_alone_and_naive_packing_does_not(name):
    torch.manual_seed(0)
    model = GPT(preset(name, n_layers=2))
    x, y, ids = _row(model.cfg.vocab_size)
    ref_loss, ref_grads = _alone(model, x, y)

    model.zero_grad()
    _, loss = model(x, y, document_ids=ids)
    loss.backward()
    assert abs(loss.item() - ref_loss) <= 1e-6 * ref_loss
    for n, g in _grads(model).items():
        assert rel_err(g, ref_grads[n]) <= 1e-5, n

    model.zero_grad()  # today's packing: the same row, no document ids
    naive = model(x, document_targets(y, ids))[1]
    naive.backward()
    worst = max(rel_err(g, ref_grads[n]) for n, g in _grads(model).items())
    # (a random tiny model attends almost uniformly, so the loss moves little; the gradients do)
    assert abs(naive.item() - ref_loss) > 1e-4 * ref_loss and worst > 1e-2, (naive.item(), worst)


def test_positions_mask_and_targets_follow_the_ids():
    ids = torch.tensor([[0, 0, 1, 1, 1, 0]])
    assert document_runs(ids).tolist() == [[0, 0, 1, 1, 1, 2]]
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 0]]
    mask = document_mask(ids)[0, 0]
    assert mask[4].tolist() == [False, False, True, True, True, False]
    assert mask[5].tolist() == [False] * 5 + [True]
    assert document_targets(torch.arange(6).view(1, 6), ids).tolist() == [[0, -100, 2, 3, -100, 5]]


def test_document_ids_of_another_shape_is_a_clear_error():
    model = GPT(preset("tiny"))
    with pytest.raises(ValueError, match=r"document_ids has shape \(1, 3\); it must match"):
        model(torch.zeros(1, 4, dtype=torch.long), document_ids=torch.zeros(1, 3, dtype=torch.long))
