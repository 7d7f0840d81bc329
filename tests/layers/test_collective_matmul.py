"""The collective matmuls against the dense computation: forward, input grad, weight and bias
grads at tp 2 and 4 for 1, 2 and 3 chunks (3: uneven pieces), and their collectives from the
ledger: ``chunks`` calls moving exactly the bytes of the one unchunked call."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import CommLedger, init_parallel
from ops_transformer.layers.collective_matmul import (chunk_bounds, copy_matmul, gather_matmul,
                                                      matmul_all_reduce, matmul_reduce_scatter)

TOKENS_PER_RANK, H, OUTS = 5, 8, (12, 4)  # 5 rows per rank: 3 chunks are 2 + 2 + 1


def _ctx():
    return init_parallel(tp=int(os.environ["WORLD_SIZE"]))


def _data(t):
    torch.manual_seed(0)
    x = torch.randn(t * TOKENS_PER_RANK, H)
    weights = [torch.randn(o * t, H) for o in OUTS]  # dense column weights, split on dim 0
    biases = [torch.randn(o * t) for o in OUTS]
    grads = [torch.randn(t * TOKENS_PER_RANK, o * t) for o in OUTS]
    return x, weights, biases, grads


def _dense_column(x, weights, biases, grads):
    x = x.clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in weights]
    bs = [b.clone().requires_grad_() for b in biases]
    ys = [torch.nn.functional.linear(x, w, b) for w, b in zip(ws, bs)]
    sum((y * g).sum() for y, g in zip(ys, grads)).backward()
    return ys, x.grad, [w.grad for w in ws], [b.grad for b in bs]


def _local(full, rank, t, dim=0):
    return full.chunk(t, dim)[rank].clone().requires_grad_()


def _entry(sequence_parallel: bool, chunks: int, regather: bool = False):
    ctx = _ctx()
    t, r = ctx.tp_size, ctx.tp_rank
    x, weights, biases, grads = _data(t)
    ys_ref, gx_ref, gw_ref, gb_ref = _dense_column(x, weights, biases, grads)
    ws, bs = [_local(w, r, t) for w in weights], [_local(b, r, t) for b in biases]
    rows = slice(r * TOKENS_PER_RANK, (r + 1) * TOKENS_PER_RANK)
    x_in = (x[rows] if sequence_parallel else x).clone().requires_grad_()
    with CommLedger() as fwd:
        if sequence_parallel:
            x_full, ys = gather_matmul(x_in, ws, bs, ctx.tp_group, chunks, regather=regather)
            x_full, ys = x_full.reshape(-1, H), [y.reshape(-1, y.shape[-1]) for y in ys]
        else:
            x_full, ys = copy_matmul(x_in, ws, bs, ctx.tp_group, chunks)
    assert_rel(x_full, x, what="the region's input")
    with CommLedger() as bwd:
        sum((y * g.chunk(t, 1)[r]).sum() for y, g in zip(ys, grads)).backward()
    for y, y_ref in zip(ys, ys_ref):
        assert_rel(y, y_ref.chunk(t, 1)[r], what="output")
    assert_rel(x_in.grad, gx_ref[rows] if sequence_parallel else gx_ref, what="input grad")
    for w, b, gw, gb in zip(ws, bs, gw_ref, gb_ref):
        assert_rel(w.grad, gw.chunk(t, 0)[r], what="weight grad")
        assert_rel(b.grad, gb.chunk(t, 0)[r], what="bias grad")
    labels = sorted({r.label for r in bwd.records if r.kind == "all_gather"})
    return fwd.summary(), bwd.summary(), labels


def _exit(sequence_parallel: bool, chunks: int):
    ctx = _ctx()
    t, r = ctx.tp_size, ctx.tp_rank
    torch.manual_seed(1)
    n, k, o = t * TOKENS_PER_RANK, 4 * t, 6
    x, weight, grad = torch.randn(n, k), torch.randn(o, k), torch.randn(n, o)
    x_ref, w_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y_ref = x_ref @ w_ref.t()
    y_ref.backward(grad)
    x_in, w = _local(x, r, t, 1), _local(weight, r, t, 1)
    rows = slice(r * TOKENS_PER_RANK, (r + 1) * TOKENS_PER_RANK)
    with CommLedger() as fwd:
        y = (matmul_reduce_scatter if sequence_parallel else matmul_all_reduce)(
            x_in, w, ctx.tp_group, chunks)
    with CommLedger() as bwd:
        y.backward(grad[rows] if sequence_parallel else grad)
    assert_rel(y, y_ref[rows] if sequence_parallel else y_ref, what="output")
    assert_rel(x_in.grad, x_ref.grad.chunk(t, 1)[r], what="input grad")
    assert_rel(w.grad, w_ref.grad.chunk(t, 1)[r], what="weight grad")
    return fwd.summary(), bwd.summary()


def _comm(kind, calls, elements):
    return {kind: {"calls": calls, "elements": elements, "bytes": 4 * elements}}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_sequence_parallel_entry_equals_dense(run_ranks, tp, chunks):
    fwd, bwd, _ = run_ranks(_entry, tp, True, chunks)[0]
    n = tp * TOKENS_PER_RANK * H
    assert fwd == _comm("all_gather", chunks, n)
    assert bwd == _comm("reduce_scatter", chunks, n)


@pytest.mark.parametrize("tp,chunks", [(2, 1), (2, 3), (4, 2)])
def test_regathering_sequence_parallel_entry_equals_dense(run_ranks, tp, chunks):
    """``regather=True`` (``sequence_parallel="regather"``): the same op keeping only this
    rank's share — exact, with one more all-gather of the share in backward (unchunked)."""
    fwd, bwd, labels = run_ranks(_entry, tp, True, chunks, True)[0]
    n = tp * TOKENS_PER_RANK * H
    assert fwd == _comm("all_gather", chunks, n)
    assert bwd == {**_comm("reduce_scatter", chunks, n), **_comm("all_gather", 1, n)}
    assert labels == ["sequence_regather.bwd"]


@pytest.mark.parametrize("tp,chunks", [(2, 1), (2, 3), (4, 2)])
def test_tensor_parallel_entry_equals_dense(run_ranks, tp, chunks):
    fwd, bwd, _ = run_ranks(_entry, tp, False, chunks)[0]
    assert fwd == {}
    assert bwd == _comm("all_reduce", chunks, tp * TOKENS_PER_RANK * H)


@pytest.mark.parametrize("tp,chunks", [(2, 1), (2, 3), (4, 2)])
def test_sequence_parallel_exit_equals_dense(run_ranks, tp, chunks):
    fwd, bwd = run_ranks(_exit, tp, True, chunks)[0]
    n = tp * TOKENS_PER_RANK * 6
    assert fwd == _comm("reduce_scatter", chunks, n)
    assert bwd == _comm("all_gather", chunks, n)


@pytest.mark.parametrize("tp,chunks", [(2, 1), (2, 3), (4, 2)])
def test_tensor_parallel_exit_equals_dense(run_ranks, tp, chunks):
    fwd, bwd = run_ranks(_exit, tp, False, chunks)[0]
    assert fwd == _comm("all_reduce", chunks, tp * TOKENS_PER_RANK * 6)
    assert bwd == {}


def test_chunk_bounds():
    assert chunk_bounds(5, 3) == [(0, 2), (2, 2), (4, 1)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 1)]  # never more pieces than rows
    assert chunk_bounds(0, 3) == [(0, 0)]
    assert chunk_bounds(6, 1) == [(0, 6)]
