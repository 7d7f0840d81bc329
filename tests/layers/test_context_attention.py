"""Context-parallel attention (ring and all-gather K/V, head-tail balanced) against dense SDPA:
outputs and dq/dk/dv at cp 2 and 4, causal and not, fp64 and fp32, GQA, a non-contiguous incoming
gradient; the ledger's CP traffic equals the planner's formula."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from ops_transformer import CommLedger, init_parallel
from ops_transformer.layers.context_attention import (context_parallel_attention,
                                                      local_positions, shard_sequence,
                                                      unshard_sequence)
from ops_transformer.planner import context_parallel as cpcost

B, H, NKV, S, D = 2, 4, 2, 16, 8
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def _data(dtype):
    torch.manual_seed(0)
    q = torch.randn(B, H, S, D, dtype=dtype)
    k = torch.randn(B, NKV, S, D, dtype=dtype)
    v = torch.randn(B, NKV, S, D, dtype=dtype)
    grad = torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2)  # (B, H, S, D), non-contiguous
    return q, k, v, grad


def _dense(q, k, v, grad, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _cp_attention(strategy, causal, dtype):
    torch.set_num_threads(1)
    ctx = init_parallel(cp=int(os.environ["WORLD_SIZE"]))
    r, cp = ctx.cp_rank, ctx.cp_size
    q, k, v, grad = _data(dtype)
    ref = _dense(q, k, v, grad, causal)
    q_l, k_l, v_l = (shard_sequence(t, r, cp, dim=2).requires_grad_() for t in (q, k, v))
    grad_l = shard_sequence(grad.transpose(1, 2), r, cp, dim=1).transpose(1, 2)
    assert not grad_l.is_contiguous()
    with CommLedger() as fwd:
        out = context_parallel_attention(q_l, k_l, v_l, ctx.cp_group, strategy=strategy,
                                         causal=causal)
    with CommLedger() as bwd:
        out.backward(grad_l)
    labels = {rec.label for rec in fwd.records + bwd.records}
    return [t.detach() for t in (out, q_l.grad, k_l.grad, v_l.grad)], fwd.summary(), \
        bwd.summary(), labels


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("strategy", ["ring", "allgather_kv"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cp_attention_matches_dense_sdpa(run_ranks, cp, strategy, causal, dtype):
    """Each rank's output and gradients, put back in sequence order, against the dense ones
    (relative to the largest entry of the whole tensor)."""
    results = run_ranks(_cp_attention, cp, strategy, causal, dtype)
    reference = _dense(*_data(dtype), causal)
    for i, what in enumerate(("output", "dq", "dk", "dv")):
        mine = unshard_sequence([tensors[i] for tensors, *_ in results], dim=2)
        err = rel_err(mine, reference[i])
        assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.0e}"
    for rank, (_, fwd, bwd, labels) in enumerate(results):
        expected = cpcost.layer_comm(strategy, batch=B, seq=S, kv_dim=NKV * D, cp=cp)
        assert fwd == _with_bytes(expected["fwd"], dtype)
        assert bwd == _with_bytes(expected["bwd"], dtype)
        assert all(label.startswith(f"cp.{strategy}.") for label in labels), labels


def _with_bytes(comm, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    return {kind: {**c, "bytes": c["elements"] * size} for kind, c in comm.items()}


def test_ring_exchanges_are_cp_minus_one_blocks_forward():
    """The issue's count, written out: cp−1 forward exchanges of 2·b·(s/cp)·h_kv elements."""
    for cp in (2, 4, 8):
        fwd = cpcost.layer_comm("ring", batch=3, seq=64, kv_dim=32, cp=cp)["fwd"]
        assert fwd == {"send_recv": {"calls": cp - 1, "elements": (cp - 1) * 2 * 3 * 64 // cp * 32}}
        ag = cpcost.layer_comm("allgather_kv", batch=3, seq=64, kv_dim=32, cp=cp)
        assert ag == {"fwd": {"all_gather": {"calls": 1, "elements": 2 * 3 * 64 * 32}},
                      "bwd": {"reduce_scatter": {"calls": 1, "elements": 2 * 3 * 64 * 32}}}


def test_head_tail_layout_and_round_trip():
    x = torch.arange(16).view(1, 16)
    parts = [shard_sequence(x, r, 4) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(unshard_sequence(parts), x)
    assert local_positions(4, 1, 4).tolist() == [2, 3, 12, 13]


def test_sequence_not_divisible_by_two_cp_is_one_line_error():
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 4 \(cp=2\)"):
        shard_sequence(torch.zeros(1, 10), 0, 2)


def test_auto_choice_names_both_figures():
    kw = dict(batch=1, kv_dim=1024, q_dim=4096, cp=4, alpha_s=1e-5, bandwidth=1e11,
              matmul_flops=1e14)
    long_seq, reason = cpcost.choose_strategy(seq=131072, **kw)
    assert long_seq == "ring" and "ring" in reason and "allgather_kv" in reason
    assert cpcost.choose_strategy(seq=64, **kw)[0] == "allgather_kv"
    assert cpcost.activation_factor(4) == 0.25


def test_the_planner_proposes_cp_for_long_sequences():
    gib = 2**30
    assert cpcost.propose_cp(activation_bytes=10 * gib, other_bytes=20 * gib, memory_bytes=80 * gib,
                             seq=8192, ranks=8)[0] == 1
    cp, reason = cpcost.propose_cp(activation_bytes=200 * gib, other_bytes=20 * gib,
                                   memory_bytes=80 * gib, seq=131072, ranks=8)
    assert cp == 4 and "need cp 4" in reason
    with pytest.raises(ValueError, match="no context-parallel degree up to 2 ranks"):
        cpcost.propose_cp(activation_bytes=400 * gib, other_bytes=20 * gib, memory_bytes=80 * gib,
                          seq=131072, ranks=2)
