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
