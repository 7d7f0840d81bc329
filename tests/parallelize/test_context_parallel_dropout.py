"""Dropout under context parallelism: the reference GPT with dropout 0.1 (embedding, residual and
attention probabilities) and LoRA dropout, split over cp ranks, draws exactly the masks of one
process (``parallelize`` on ``ParallelContext.single()``: the counter-based masks of
:mod:`ops_transformer.layers.dropout`) — each attention block its part of the ``(b, heads, s, s)``
mask, in forward and again in backward — so the loss and every gradient equal one process's, fp32
within 1e-5; a different seed gives a different loss (the masks matter)."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import rel_err
from ops_transformer import GPT, ParallelContext, init_parallel, parallelize
from ops_transformer.models.gpt import preset
from test_context_parallel_compose import dense_grads

B, S = 2, 16


def dropout_step(tp, cp, strategy="ring", name="llama-tiny", lora=None, seed=7, **options):
    """``(loss, one-process loss, worst gradient error and its name, the error against one
    process at another seed)``."""
    torch.set_num_threads(1)
    ctx = init_parallel(tp=tp, cp=cp)
    torch.manual_seed(0)
    p = 0.0 if lora else 0.1
    dense = GPT(preset(name, n_layers=2, max_seq_len=32, dropout=p))
    kw = {} if lora is None else {"lora": lora}
    model = parallelize(copy.deepcopy(dense), ctx, context_parallel=strategy, **kw, **options)
    ref = parallelize(dense, ParallelContext.single(), **kw)
    batch = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    _, ref_loss = ref(batch[:, :-1], batch[:, 1:])
    ref_loss.backward()
    torch.manual_seed(seed)
    _, loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    grads = dense_grads(model, ctx)
    worst = max((rel_err(grads[n], q.grad), n) for n, q in ref.named_parameters()
                if q.grad is not None)
    torch.manual_seed(seed + 1)  # other masks: other gradients (LoRA's B starts at 0, so
    for q in ref.parameters():  # its dropout shows in the gradients, not the first loss)
        q.grad = None
    ref(batch[:, :-1], batch[:, 1:])[1].backward()
    other = max(rel_err(grads[n], q.grad) for n, q in ref.named_parameters()
                if q.grad is not None)
    return float(loss.detach()), float(ref_loss.detach()), worst, other


def _check(results):
    for rank, (loss, ref, worst, other) in enumerate(results):
        assert abs(loss - ref) <= 1e-6 * abs(ref), (rank, loss, ref)
        assert worst[0] <= 1e-5, f"rank {rank}: gradient of {worst[1]} differs by {worst[0]:.2e}"
        assert other > 1e-2, other  # another seed's masks: gradients far from these


@pytest.mark.parametrize("strategy,name", [("ring", "llama-tiny"), ("allgather_kv", "tiny")])
def test_dropout_at_cp2_equals_one_process(run_ranks, strategy, name):
    _check(run_ranks(dropout_step, 2, 1, 2, strategy, name))


def test_lora_dropout_at_cp2_equals_one_process(run_ranks):
    _check(run_ranks(dropout_step, 2, 1, 2, "ring", lora={"rank": 4, "dropout": 0.2}))


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"sequence_parallel": True},
                                     {"recompute": "selective"}],
                         ids=["plain", "sp", "recompute"])
def test_dropout_at_tp2_cp2_equals_one_process(run_ranks, options):
    _check(run_ranks(dropout_step, 4, 2, 2, "ring", **options))
