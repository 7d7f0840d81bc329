"""parallel_linear: both splits exact for every input/output layout at tp 2 and 4; the
collectives equal split_comm's prediction; `auto` picks the cheaper one."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from helpers import assert_rel
from ops_transformer import CommLedger, init_parallel, parallel_linear
from ops_transformer.parallelize.linear_split import choose_split, split_comm

TOKENS, IN, OUT = 6, 16, 24


def _run(split, input_layout, output_layout):
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT)
    x = torch.randn(2, 3, IN)
    grad = torch.randn(2, 3, OUT)
    x_ref = x.clone().requires_grad_()
    dense(x_ref).backward(grad)

    def shard(t):
        return t.chunk(ctx.tp_size, -1)[ctx.tp_rank] if ctx.tp_size > 1 else t

    layer = parallel_linear(dense, ctx, split, input_layout=input_layout,
                            output_layout=output_layout, tokens=TOKENS)
    x_in = (shard(x) if input_layout == "sharded" else x).clone().requires_grad_()
    with CommLedger() as fwd:
        y = layer(x_in)
    with CommLedger() as bwd:
        y.backward(shard(grad) if output_layout == "sharded" else grad)
    y_ref = dense(x)
    assert_rel(y, shard(y_ref) if output_layout == "sharded" else y_ref, what="output")
    expected_gx = shard(x_ref.grad) if input_layout == "sharded" else x_ref.grad
    assert_rel(x_in.grad, expected_gx, what="input grad")
    strip = lambda s: {k: {"calls": v["calls"], "elements": v["elements"]} for k, v in s.items()}  # noqa: E731
    return layer.split, strip(fwd.summary()), strip(bwd.summary())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("split", ["column", "row"])
@pytest.mark.parametrize("layouts", [("replicated", "replicated"), ("replicated", "sharded"),
                                     ("sharded", "replicated"), ("sharded", "sharded")])
def test_exact_with_predicted_collectives(run_ranks, tp, split, layouts):
    got_split, fwd, bwd = run_ranks(_run, tp, split, *layouts)[0]
    assert got_split == split
    assert {"fwd": fwd, "bwd": bwd} == split_comm(split, TOKENS, IN, OUT, *layouts)


@pytest.mark.parametrize("inp,out,n_in,n_out,expected", [
    # replicated in and out: column moves n_out + 2·n_in, row 2·n_out + n_in
    ("replicated", "replicated", 1024, 4096, "column"),
    ("replicated", "replicated", 4096, 1024, "row"),
    ("replicated", "replicated", 4096, 4096, "column"),  # a tie, decided for column
    ("sharded", "replicated", 4096, 4096, "row"),        # row consumes a sharded input as is
    ("replicated", "sharded", 4096, 4096, "column"),     # column produces a sharded output
])
def test_auto_choice(inp, out, n_in, n_out, expected):
    assert choose_split(2048, n_in, n_out, 2, inp, out)[0] == expected


def test_bad_layout():
    from ops_transformer import ParallelContext

    with pytest.raises(ValueError, match="input_layout must be one of"):
        parallel_linear(nn.Linear(4, 4), ParallelContext.single(), input_layout="split")
