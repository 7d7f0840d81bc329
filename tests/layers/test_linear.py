"""Column- and row-parallel linears against nn.Linear: forward, input grad, weight and bias grads,
at tp 1, 2 and 4, with the exact collectives from the ledger."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import BF16_RTOL, assert_rel
from ops_transformer import (ColumnParallelLinear, CommLedger, ParallelContext, RowParallelLinear,
                             gather_full_state_dict, init_parallel)

B, S, IN, OUT = 2, 3, 12, 32


def _ctx():
    return init_parallel(tp=int(os.environ["WORLD_SIZE"]))


def _dense_and_data(in_f, out_f, bias, dtype=torch.float32):
    torch.manual_seed(0)
    dense = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    x = torch.randn(B, S, in_f, dtype=dtype)
    grad_out = torch.randn(B, S, out_f, dtype=dtype)
    return dense, x, grad_out


def _dense_grads(dense, x, grad_out):
    x = x.clone().requires_grad_()
    y = dense(x)
    y.backward(grad_out)
    return y.detach(), x.grad, dense.weight.grad, (dense.bias.grad if dense.bias is not None else None)


def _column(bias, gather_output, sub_blocks):
    ctx = _ctx()
    dense, x, grad_out = _dense_and_data(IN, OUT, bias)
    layer = ColumnParallelLinear.from_dense(dense, ctx, gather_output=gather_output,
                                            sub_blocks=sub_blocks)
    y_ref, gx_ref, gw_ref, gb_ref = _dense_grads(dense, x, grad_out)
    cols = torch.cat([torch.arange(s, s + n) for s, n in layer.weight_spec.slices()])

    x_tp = x.clone().requires_grad_()
    with CommLedger() as fwd:
        y = layer(x_tp)
    with CommLedger() as bwd:
        y.backward(grad_out if gather_output else grad_out[..., cols])
    assert_rel(y, y_ref if gather_output else y_ref[..., cols], what="output")
    assert_rel(x_tp.grad, gx_ref, what="input grad")
    assert_rel(layer.weight.grad, gw_ref[cols], what="weight grad")
    if bias:
        assert_rel(layer.bias.grad, gb_ref[cols], what="bias grad")
    spec = layer.weight.shard_spec
    assert (spec.full_shape, spec.split_dim, spec.tp_size) == ((OUT, IN), 0, ctx.tp_size)
    assert tuple(layer.weight.shape) == (OUT // ctx.tp_size, IN)
    dense_back = layer.to_dense()
    assert torch.equal(dense_back.weight, dense.weight)
    return fwd.summary(), bwd.summary()


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("bias,gather_output,sub_blocks", [
    (True, False, None), (False, True, None), (True, True, (16, 8, 8)), (True, False, (16, 8, 8)),
])
def test_column_parallel_linear(run_ranks, tp, bias, gather_output, sub_blocks):
    fwd, bwd = run_ranks(_column, tp, bias, gather_output, sub_blocks)[0]
    if tp == 1:
        assert fwd == {} and bwd == {}
        return
    gathered = {"all_gather": {"calls": 1, "elements": B * S * OUT, "bytes": 4 * B * S * OUT}}
    assert fwd == (gathered if gather_output else {})
    assert bwd == {"all_reduce": {"calls": 1, "elements": B * S * IN, "bytes": 4 * B * S * IN}}


def _row(bias, input_is_parallel):
    ctx = _ctx()
    dense, x, grad_out = _dense_and_data(OUT, IN, bias)  # 32 -> 12
    layer = RowParallelLinear.from_dense(dense, ctx, input_is_parallel=input_is_parallel)
    y_ref, gx_ref, gw_ref, gb_ref = _dense_grads(dense, x, grad_out)
    cols = slice(ctx.tp_rank * OUT // ctx.tp_size, (ctx.tp_rank + 1) * OUT // ctx.tp_size)

    x_tp = (x[..., cols] if input_is_parallel else x).clone().requires_grad_()
    with CommLedger() as fwd:
        y = layer(x_tp)
    with CommLedger() as bwd:
        y.backward(grad_out)
    assert_rel(y, y_ref, what="output")
    assert_rel(x_tp.grad, gx_ref[..., cols] if input_is_parallel else gx_ref, what="input grad")
    assert_rel(layer.weight.grad, gw_ref[:, cols], what="weight grad")
    if bias:
        assert_rel(layer.bias.grad, gb_ref, what="bias grad")
        assert not hasattr(layer.bias, "shard_spec")  # replicated
    assert layer.weight.shard_spec.split_dim == 1
    assert torch.equal(layer.to_dense().weight, dense.weight)
    return fwd.summary(), bwd.summary()


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("bias,input_is_parallel", [(True, True), (False, True), (True, False)])
def test_row_parallel_linear(run_ranks, tp, bias, input_is_parallel):
    fwd, bwd = run_ranks(_row, tp, bias, input_is_parallel)[0]
    if tp == 1:
        assert fwd == {} and bwd == {}
        return
    assert fwd == {"all_reduce": {"calls": 1, "elements": B * S * IN, "bytes": 4 * B * S * IN}}
    if input_is_parallel:
        assert bwd == {}
    else:  # the full-input gradient is re-assembled from the ranks' slices
        assert bwd == {"all_gather": {"calls": 1, "elements": B * S * OUT, "bytes": 4 * B * S * OUT}}


class _MLP(nn.Module):
    def __init__(self, h, ffn, dtype=torch.float32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, ffn).to(dtype), nn.Linear(ffn, h).to(dtype)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _mlp(dtype):
    ctx = _ctx()
    h, ffn = 16, 64
    torch.manual_seed(1)
    dense = _MLP(h, ffn, dtype)
    x = torch.randn(B, S, h, dtype=dtype)
    grad_out = torch.randn(B, S, h, dtype=dtype)
    x_ref = x.clone().requires_grad_()
    y_ref = dense(x_ref)
    y_ref.backward(grad_out)

    tp_model = _MLP(h, ffn, dtype)
    tp_model.fc1 = ColumnParallelLinear.from_dense(dense.fc1, ctx)
    tp_model.fc2 = RowParallelLinear.from_dense(dense.fc2, ctx)
    x_tp = x.clone().requires_grad_()
    with CommLedger() as fwd:
        y = tp_model(x_tp)
    with CommLedger() as bwd:
        y.backward(grad_out)
    rtol = BF16_RTOL if dtype == torch.bfloat16 else 1e-5
    assert y.dtype == dtype
    assert_rel(y, y_ref, rtol, "output")
    assert_rel(x_tp.grad, x_ref.grad, rtol, "input grad")
    assert_rel(tp_model.fc1.weight.grad, dense.fc1.weight.grad.chunk(ctx.tp_size, 0)[ctx.tp_rank],
               rtol, "fc1 weight grad")
    assert_rel(tp_model.fc2.weight.grad, dense.fc2.weight.grad.chunk(ctx.tp_size, 1)[ctx.tp_rank],
               rtol, "fc2 weight grad")
    assert_rel(tp_model.fc2.bias.grad, dense.fc2.bias.grad, rtol, "fc2 bias grad")
    full = gather_full_state_dict(tp_model, ctx)
    ref = dense.state_dict()
    assert list(full) == list(ref)
    assert all(torch.equal(full[k], ref[k]) for k in ref)
    return fwd.summary(), bwd.summary()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_row_mlp_issues_one_all_reduce_each_way(run_ranks, tp):
    for fwd, bwd in run_ranks(_mlp, tp, torch.float32):
        expected = {} if tp == 1 else {
            "all_reduce": {"calls": 1, "elements": B * S * 16, "bytes": 4 * B * S * 16}}
        assert fwd == expected and bwd == expected


def test_column_row_mlp_bf16(run_ranks):
    fwd, bwd = run_ranks(_mlp, 2, torch.bfloat16)[0]
    assert fwd["all_reduce"]["bytes"] == 2 * B * S * 16  # communicated in bf16


def _init_matches_dense():
    ctx = _ctx()
    torch.manual_seed(3)
    d1, d2 = nn.Linear(IN, OUT), nn.Linear(OUT, IN)
    torch.manual_seed(3)
    col, row = ColumnParallelLinear(IN, OUT, ctx), RowParallelLinear(OUT, IN, ctx)
    return (torch.equal(col.to_dense().weight, d1.weight) and torch.equal(col.to_dense().bias, d1.bias)
            and torch.equal(row.to_dense().weight, d2.weight) and torch.equal(row.bias, d2.bias))


def test_construction_with_same_seed_equals_dense_init(run_ranks):
    assert run_ranks(_init_matches_dense, 2) == [True, True]


def _fake_ctx(tp):
    """A context that only carries sizes: construction errors happen before any communication."""
    return ParallelContext(rank=0, world_size=tp, tp_size=tp, tp_rank=0, dp_size=1, dp_rank=0)


@pytest.mark.parametrize("make,needle", [
    (lambda c: ColumnParallelLinear(10, 15, c), r"out_features \(15\) is not divisible by the "
                                                r"tensor-parallel degree tp \(2\)"),
    (lambda c: RowParallelLinear(15, 10, c), r"in_features \(15\) is not divisible .* tp \(2\)"),
    (lambda c: ColumnParallelLinear(4, 12, c, sub_blocks=(6, 3, 3)),
     r"sub-block 1 of out_features \(3\) is not divisible .* tp \(2\)"),
    (lambda c: ColumnParallelLinear(4, 12, c, sub_blocks=(6, 4)), r"sum to 10, expected out_f"),
])
def test_not_divisible_sizes_raise_at_construction(make, needle):
    with pytest.raises(ValueError, match=needle):
        make(_fake_ctx(2))


def test_extra_repr_shows_global_and_per_rank_sizes():
    text = repr(ColumnParallelLinear(8, 16, ParallelContext.single()))
    assert "out_features=16" in text and "out_features_per_rank=16" in text and "tp=1" in text


def _row_wrong_input():
    ctx = _ctx()
    layer = RowParallelLinear(8, 4, ctx)
    with pytest.raises(ValueError, match=r"in_features_per_rank \(4 = 8 / tp 2\)"):
        layer(torch.ones(2, 8))
    return True


def test_row_parallel_wrong_input_width_is_clear(run_ranks):
    assert run_ranks(_row_wrong_input, 2) == [True, True]
