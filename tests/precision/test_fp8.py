"""FP8 tensorwise dynamic scaling (``precision/fp8.py``): the amax of a split weight all-reduced
(MAX) over its TP group, so every rank uses the dense weight's scale; a column-parallel fp8
output bit-equal to the same columns of the tp 1 fp8 output; close to the fp32 product."""

from __future__ import annotations

import os

import pytest
import torch

from ops_transformer import CommLedger, init_parallel
from ops_transformer.precision.fp8 import FP8_MAX, fp8_linear, to_fp8

IN, OUT, TOKENS = 64, 32, 24  # 32 / 2 = 16 output columns per rank: see the blocking note


def _dense():
    g = torch.Generator().manual_seed(0)
    return torch.randn(TOKENS, IN, generator=g), torch.randn(OUT, IN, generator=g), \
        torch.randn(OUT, generator=g)


def _column_parallel():
    tp = int(os.environ["WORLD_SIZE"])
    ctx = init_parallel(tp=tp)
    x, w, b = _dense()
    rows = slice(ctx.tp_rank * OUT // tp, (ctx.tp_rank + 1) * OUT // tp)
    with CommLedger() as ledger:
        y, scales = fp8_linear(x, w[rows], b[rows], weight_group=ctx.tp_group,
                               return_scales=True)
    return y, [float(s) for s in scales], ledger.summary()


def test_scales_agree_and_columns_bit_equal_tp1(run_ranks):
    (dense_y, dense_scales, dense_ledger), = run_ranks(_column_parallel, 1)
    assert dense_ledger == {}  # nothing to agree on at tp 1
    x, w, b = _dense()
    want = [float(FP8_MAX / t.abs().max().float()) for t in (x, w)]  # fp32, as computed
    assert dense_scales == pytest.approx(want, rel=1e-6)
    # e4m3 keeps 3 mantissa bits (unit roundoff 2^-4) in each operand: each product term is off
    # by up to ~2·2^-4 of itself; measured 5.1e-2 of the fp32 output's largest value here
    exact = x @ w.t() + b
    assert float((dense_y - exact).abs().max() / exact.abs().max()) < 2 * 2 ** -4
    results = run_ranks(_column_parallel, 2)
    for rank, (y, scales, ledger) in enumerate(results):
        assert scales == dense_scales, f"rank {rank}: scales {scales} != tp 1's {dense_scales}"
        # the weight's amax, one MAX all-reduce of one fp32 scalar (the input is replicated)
        assert ledger == {"all_reduce": {"calls": 1, "elements": 1, "bytes": 4}}
        # CPU _scaled_mm blocks its output columns by 16: a 16-column shard is bit-equal; an
        # 8-column one differs in the last bit (3e-6 measured)
        assert torch.equal(y, dense_y[:, rank * OUT // 2:(rank + 1) * OUT // 2]), rank


def test_own_amax_would_differ():
    """Why the all-reduce: a rank's own shard amax gives another scale than the dense one."""
    _, w, _ = _dense()
    own = [float(FP8_MAX / w[r * 16:(r + 1) * 16].abs().max()) for r in range(2)]
    assert own[0] != own[1]


def test_to_fp8_saturates():
    t = torch.tensor([1.0, -1000.0, 1000.0])
    assert to_fp8(t, torch.tensor(1.0)).float().tolist() == [1.0, -FP8_MAX, FP8_MAX]


def test_zero_tensor_has_finite_scale():
    y = fp8_linear(torch.zeros(4, IN), torch.zeros(8, IN))
    assert torch.equal(y, torch.zeros(4, 8))


# ---- the e5m2 backward (torchao's tensorwise recipe: grad_output cast to float8_e5m2) ----

def _column_backward(backward):
    """A column-parallel fp8 layer's forward and backward on this rank, every amax it takes
    (label, value) recorded: the dense upstream gradient's columns of this rank flow back."""
    from ops_transformer.precision import fp8

    tp = int(os.environ["WORLD_SIZE"])
    ctx = init_parallel(tp=tp)
    x, w, _ = _dense()
    grad_out = torch.randn(TOKENS, OUT, generator=torch.Generator().manual_seed(2))
    rows = slice(ctx.tp_rank * OUT // tp, (ctx.tp_rank + 1) * OUT // tp)
    x.requires_grad_()
    w_shard = w[rows].clone().requires_grad_()
    seen, amax = [], fp8.tp_amax

    def recording(t, group=None, label="fp8.amax"):
        out = amax(t, group, label)
        seen.append((label, float(out)))
        return out

    fp8.tp_amax = recording
    try:
        with CommLedger() as ledger:
            y = fp8_linear(x, w_shard, weight_group=ctx.tp_group, grad_group=ctx.tp_group,
                           backward=backward)
            y.backward(grad_out[:, rows])
    finally:
        fp8.tp_amax = amax
    return x.grad, w_shard.grad, seen, [(r.label, r.elements) for r in ledger.records]


@pytest.mark.parametrize("backward", ["e5m2", "fp32"])
def test_backward_equals_dense_and_scales_agree(run_ranks, backward):
    (dense_gx, dense_gw, dense_seen, _), = run_ranks(_column_backward, 1, backward)
    labels = [label for label, _ in dense_seen]
    assert labels == ["fp8.amax", "fp8.amax"] + (["fp8.grad_amax"] if backward == "e5m2" else [])
    results = run_ranks(_column_backward, 2, backward)
    for rank, (gx, gw, seen, records) in enumerate(results):
        # every rank's scales — forward and the gradient's — are the dense tensors'
        assert seen == dense_seen, f"rank {rank}: amaxes {seen} != tp 1's {dense_seen}"
        assert records == [("fp8.amax", 1)] + ([("fp8.grad_amax", 1)] if backward == "e5m2"
                                               else []), rank
        want_gw = dense_gw[rank * OUT // 2:(rank + 1) * OUT // 2]
        # (bit-equal measured: a rank computes whole rows of the weight gradient)
        assert float((gw - want_gw).abs().max() / want_gw.abs().max()) < 1e-6, rank
    # the input gradient is partial: the ranks' sum is the dense one (fp32 summation order)
    gx = results[0][0] + results[1][0]
    assert float((gx - dense_gx).abs().max() / dense_gx.abs().max()) < 1e-5  # 1.5e-7 measured


def test_e5m2_backward_is_really_applied(run_ranks):
    """The e5m2 gradients differ from the fp32 straight-through ones by e5m2's rounding: 2 mantissa
    bits (unit roundoff 2^-3) in each gradient element; measured 7.3e-2 / 5.4e-2 of the largest
    input / weight gradient here."""
    (gx8, gw8, _, _), = run_ranks(_column_backward, 1, "e5m2")
    (gx32, gw32, _, _), = run_ranks(_column_backward, 1, "fp32")
    for got, ref in ((gx8, gx32), (gw8, gw32)):
        err = float((got - ref).abs().max() / ref.abs().max())
        assert 1e-3 < err < 2 * 2 ** -3, err


def test_fp8_backward_value_is_checked():
    with pytest.raises(ValueError, match=r"fp8_backward must be one of \('e5m2', 'fp32'\).*'e4m3'"):
        fp8_linear(torch.ones(2, 4), torch.ones(3, 4), backward="e4m3")
