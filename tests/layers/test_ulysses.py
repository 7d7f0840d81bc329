"""Ulysses (``context_parallel="ulysses"``: all-to-all over heads) against dense SDPA: outputs and
dq/dk/dv at cp 2 and 4, causal and not, fp64 (1e-12) and fp32 (1e-6), GQA, a non-contiguous
incoming gradient; the ledger equals the planner's formula (three all-to-alls each way); a cp
that does not divide the KV heads is one line; the reference GPT at cp 2 (and with dropout)
equals one process."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from ops_transformer import GPT, CommLedger, init_parallel, parallelize
from ops_transformer.layers.context_attention import (context_parallel_attention, shard_sequence,
                                                      unshard_sequence)
from ops_transformer.models.gpt import preset
from ops_transformer.planner import context_parallel as cpcost

B, H, NKV, S, D = 2, 8, 4, 16, 8
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def _data(dtype):
    torch.manual_seed(0)
    q = torch.randn(B, H, S, D, dtype=dtype)
    k = torch.randn(B, NKV, S, D, dtype=dtype)
    v = torch.randn(B, NKV, S, D, dtype=dtype)
    grad = torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2)  # non-contiguous
    return q, k, v, grad


def _dense(q, k, v, grad, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _ulysses(causal, dtype):
    torch.set_num_threads(1)
    ctx = init_parallel(cp=int(os.environ["WORLD_SIZE"]))
    r, cp = ctx.cp_rank, ctx.cp_size
    q, k, v, grad = _data(dtype)
    q_l, k_l, v_l = (shard_sequence(t, r, cp, dim=2).requires_grad_() for t in (q, k, v))
    grad_l = shard_sequence(grad.transpose(1, 2), r, cp, dim=1).transpose(1, 2)
    assert not grad_l.is_contiguous()
    with CommLedger() as fwd:
        out = context_parallel_attention(q_l, k_l, v_l, ctx.cp_group, strategy="ulysses",
                                         causal=causal)
    with CommLedger() as bwd:
        out.backward(grad_l)
    labels = {rec.label for rec in fwd.records + bwd.records}
    return [t.detach() for t in (out, q_l.grad, k_l.grad, v_l.grad)], fwd.summary(), \
        bwd.summary(), labels


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ulysses_matches_dense_sdpa(run_ranks, cp, causal, dtype):
    results = run_ranks(_ulysses, cp, causal, dtype)
    reference = _dense(*_data(dtype), causal)
    for i, what in enumerate(("output", "dq", "dk", "dv")):
        mine = unshard_sequence([tensors[i] for tensors, *_ in results], dim=2)
        err = rel_err(mine, reference[i])
        assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.0e}"
    size = torch.empty((), dtype=dtype).element_size()
    expected = cpcost.layer_comm("ulysses", batch=B, seq=S, kv_dim=NKV * D, cp=cp, q_dim=H * D)
    for _, fwd, bwd, labels in results:
        for got, part in ((fwd, "fwd"), (bwd, "bwd")):
            assert got == {k: {**c, "bytes": c["elements"] * size}
                           for k, c in expected[part].items()}
        assert labels == {"cp.ulysses.fwd", "cp.ulysses.bwd"}


def test_ulysses_formula_written_out():
    """Three all-to-alls each way: Q and the output (b·(s/cp)·q_dim each) and K/V (2·b·(s/cp)·kv)."""
    comm = cpcost.layer_comm("ulysses", batch=2, seq=16, kv_dim=32, cp=2, q_dim=64)
    assert comm["fwd"] == comm["bwd"] == {"all_to_all": {"calls": 3,
                                                         "elements": 2 * 2 * 8 * 64 + 2 * 2 * 8 * 32}}
    with pytest.raises(ValueError, match=r"cp \(4\): cp must divide this rank's KV heads \(2\)"):
        cpcost.check_ulysses(8, 2, 4)


def _gpt(dropout):
    torch.set_num_threads(1)
    from ops_transformer import ParallelContext

    ctx = init_parallel(cp=2)
    torch.manual_seed(0)
    dense = GPT(preset("llama-tiny", n_layers=2, max_seq_len=32, dropout=dropout))
    model = parallelize(copy.deepcopy(dense), ctx, context_parallel="ulysses")
    ref = parallelize(dense, ParallelContext.single())
    batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    _, ref_loss = ref(batch[:, :-1], batch[:, 1:])
    ref_loss.backward()
    torch.manual_seed(3)
    _, loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    grads = dict(model.named_parameters())
    worst = max(rel_err(grads[n].grad, p.grad) for n, p in ref.named_parameters())
    return float(loss), float(ref_loss), worst, "strategy=ulysses" in repr(model)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gpt_with_ulysses_equals_one_process(run_ranks, dropout):
    for loss, ref, worst, shown in run_ranks(_gpt, 2, dropout):
        assert abs(loss - ref) <= 1e-6 * abs(ref) and worst <= 1e-5 and shown, (loss, ref, worst)
