"""Hugging Face Llama / Qwen2 with the sequence split over cp ranks: equal to the unsplit model
over 10 SGD steps (loss each step, weights after the last) at cp 2 and tp 2 × cp 2; packed
documents (``document_ids``) equal to transformers' own packed-sequence attention (position ids
that restart per document)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hf_tiny
from helpers import rel_err
from ops_transformer import gather_full_state_dict, init_parallel, parallelize
from ops_transformer.models.documents import document_positions, document_targets

B, S, STEPS = 2, 16, 10
DOCS = torch.tensor([[0] * 5 + [1] * 11, [0] * 8 + [1] * 4 + [2] * 4])


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, hf_tiny.VOCAB, (B, S), generator=g) for _ in range(STEPS)]


def _train(model, batches, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids, **kwargs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _cp_vs_dense(family, tp, strategy):
    torch.set_num_threads(1)
    ctx = init_parallel(tp=tp, cp=2)
    dense = hf_tiny.build(family).float()
    model = parallelize(copy.deepcopy(dense), ctx, context_parallel=strategy)
    ref = _train(dense, _batches())
    losses = _train(model, _batches())
    weights = gather_full_state_dict(model, ctx)
    worst = max(rel_err(weights[k], v) for k, v in dense.state_dict().items())
    return losses, ref, worst, type(model).__name__


@pytest.mark.parametrize("family,tp,strategy", [("llama", 1, "ring"), ("llama", 1, "allgather_kv"),
                                                ("llama", 2, "ring"), ("qwen2", 1, "ring"),
                                                pytest.param("llama", 1, "ulysses",
                                                             marks=pytest.mark.slow)])
def test_hf_context_parallel_equals_one_device(run_ranks, family, tp, strategy):
    for losses, ref, worst, name in run_ranks(_cp_vs_dense, 2 * tp, family, tp, strategy):
        for mine, theirs in zip(losses, ref):
            assert abs(mine - theirs) <= 1e-6 * theirs, (mine, theirs)
        assert worst <= 1e-6 and name.startswith("ContextParallel")


def _documents(strategy):
    torch.set_num_threads(1)
    ctx = init_parallel(cp=2)
    dense = hf_tiny.build("llama").float()
    model = parallelize(copy.deepcopy(dense), ctx, context_parallel=strategy)
    ids = _batches()[0]
    shifted = document_targets(nn.functional.pad(ids, (0, 1), value=-100)[:, 1:], DOCS)
    ref = dense(input_ids=ids, position_ids=document_positions(DOCS), labels=ids,
                shift_labels=shifted, use_cache=False).loss  # transformers' packed-sequence mask
    ref.backward()
    loss = model(input_ids=ids, labels=ids, document_ids=DOCS).loss
    loss.backward()
    grads = dict(dense.named_parameters())
    worst = max(rel_err(p.grad, grads[n].grad) for n, p in model.named_parameters())
    unmasked = dense(input_ids=ids, labels=ids, shift_labels=shifted).loss  # crosses documents
    return float(loss), float(ref), worst, float(unmasked)


@pytest.mark.parametrize("strategy", ["ring", "allgather_kv"])
def test_hf_packed_documents_at_cp2(run_ranks, strategy):
    for loss, ref, worst, unmasked in run_ranks(_documents, 2, strategy):
        assert abs(loss - ref) <= 1e-6 * ref and worst <= 1e-5, (loss, ref, worst)
        assert abs(unmasked - ref) > 1e-4 * ref  # attention across documents differs
