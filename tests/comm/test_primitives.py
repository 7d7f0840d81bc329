"""Every autograd primitive against its definition, forward and backward, at tp 1, 2 and 4,
with the exact collectives it issues (from the ledger)."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rel
from ops_transformer import (CommLedger, all_gather_along, all_to_all, copy_to_tp_region,
                             gather_from_tp_region, init_parallel, reduce_from_tp_region,
                             reduce_scatter_along, scatter_to_tp_region)

SHAPE = (4, 8, 12)


def _fwd_bwd(fn, x, grad):
    x = x.clone().requires_grad_()
    with CommLedger() as fwd:
        y = fn(x)
    with CommLedger() as bwd:
        y.backward(grad)
    return y.detach(), x.grad, fwd.summary(), bwd.summary()


def _calls(summary, kind, elements):
    return {kind: {"calls": 1, "elements": elements, "bytes": 4 * elements}}


def _per_rank(seed_base, shape, world):
    """Distinct tensors for every rank, known to every rank."""
    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed_base + r))
            for r in range(world)]


def _check_all(dim):
    ctx = init_parallel(tp=int(__import__("os").environ["WORLD_SIZE"]))
    g, r, p = ctx.tp_group, ctx.tp_rank, ctx.tp_size
    comm = p > 1
    n = torch.Size(SHAPE).numel()
    X = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    G = _per_rank(100, SHAPE, p)  # different upstream gradients per rank
    chunk = lambda t: t.chunk(p, dim)[r]  # noqa: E731

    # copy_to_tp_region: identity / all-reduce
    y, gx, f, b = _fwd_bwd(lambda t: copy_to_tp_region(t, g), X, G[r])
    assert torch.equal(y, X)
    assert_rel(gx, sum(G), what="copy_to grad")
    assert f == {} and b == (_calls(b, "all_reduce", n) if comm else {})

    # reduce_from_tp_region: all-reduce / identity
    xs = _per_rank(200, SHAPE, p)
    y, gx, f, b = _fwd_bwd(lambda t: reduce_from_tp_region(t, g), xs[r], G[0])
    assert_rel(y, sum(xs), what="reduce_from fwd")
    assert torch.equal(gx, G[0])
    assert f == (_calls(f, "all_reduce", n) if comm else {}) and b == {}

    # scatter_to_tp_region: split / all-gather
    local_grads = [t.chunk(p, dim)[0] for t in G]
    y, gx, f, b = _fwd_bwd(lambda t: scatter_to_tp_region(t, g, dim), X, local_grads[r])
    assert torch.equal(y, chunk(X))
    assert torch.equal(gx, torch.cat(local_grads, dim))
    assert f == {} and b == (_calls(b, "all_gather", n) if comm else {})

    # gather_from_tp_region: all-gather / split (replicated upstream gradient)
    y, gx, f, b = _fwd_bwd(lambda t: gather_from_tp_region(t, g, dim), chunk(X), G[0])
    assert torch.equal(y, X)
    assert torch.equal(gx, chunk(G[0]))
    assert f == (_calls(f, "all_gather", n) if comm else {}) and b == {}

    # all_gather_along: all-gather / reduce-scatter (distinct upstream gradients)
    y, gx, f, b = _fwd_bwd(lambda t: all_gather_along(t, g, dim), chunk(X), G[r])
    assert torch.equal(y, X)
    assert_rel(gx, chunk(sum(G)), what="all_gather_along grad")
    assert f == (_calls(f, "all_gather", n) if comm else {})
    assert b == (_calls(b, "reduce_scatter", n) if comm else {})

    # reduce_scatter_along: reduce-scatter / all-gather
    y, gx, f, b = _fwd_bwd(lambda t: reduce_scatter_along(t, g, dim), xs[r], local_grads[r])
    assert_rel(y, chunk(sum(xs)), what="reduce_scatter_along fwd")
    assert torch.equal(gx, torch.cat(local_grads, dim))
    assert f == (_calls(f, "reduce_scatter", n) if comm else {})
    assert b == (_calls(b, "all_gather", n) if comm else {})
    return p


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_primitives(run_ranks, tp, dim):
    assert run_ranks(_check_all, tp, dim) == [tp] * tp


def _tagged_rows(src: int, splits: list[int]) -> torch.Tensor:
    """Rows sent by rank ``src``: row value = 100*src + 10*dst + k."""
    rows = [100 * src + 10 * dst + k for dst, cnt in enumerate(splits) for k in range(cnt)]
    return torch.tensor(rows, dtype=torch.float32).unsqueeze(1).repeat(1, 3)  # (rows, 3)


def _check_all_to_all(uneven):
    ctx = init_parallel(tp=int(__import__("os").environ["WORLD_SIZE"]))
    g, r, p = ctx.tp_group, ctx.tp_rank, ctx.tp_size
    # send_counts[src][dst]: even = 2 everywhere; uneven = (src + dst) % 3 (zeros included)
    counts = [[(s + d) % 3 if uneven else 2 for d in range(p)] for s in range(p)]
    x = _tagged_rows(r, counts[r])
    expected = torch.cat([_tagged_rows(s, counts[s])[sum(counts[s][:r]):sum(counts[s][:r + 1])]
                          for s in range(p)])
    kwargs = ({"input_splits": counts[r], "output_splits": [counts[s][r] for s in range(p)]}
              if uneven else {})
    y, gx, f, b = _fwd_bwd(lambda t: all_to_all(t, g, **kwargs), x, 2 * expected)
    assert torch.equal(y, expected)
    assert torch.equal(gx, 2 * x)  # the gradient travels back to the row it came from
    if p > 1:
        assert f["all_to_all"]["calls"] == 1 and f["all_to_all"]["elements"] == x.numel()
        assert b["all_to_all"]["elements"] == expected.numel()
    return y.shape[0]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("uneven", [False, True])
def test_all_to_all(run_ranks, tp, uneven):
    run_ranks(_check_all_to_all, tp, uneven)


def _not_divisible():
    ctx = init_parallel(tp=2)
    with pytest.raises(ValueError, match=r"dimension -1 of a tensor of shape \(2, 5\) has size 5, "
                                         r"which does not divide by the group size 2"):
        scatter_to_tp_region(torch.ones(2, 5), ctx.tp_group, -1)
    with pytest.raises(ValueError, match=r"input_splits \[1, 1\] sum to 2, but dim 0 .* size 3"):
        all_to_all(torch.ones(3, 2), ctx.tp_group, input_splits=[1, 1], output_splits=[1, 1])
    with pytest.raises(ValueError, match="has 3 entries, expected one per rank of the group"):
        all_to_all(torch.ones(3, 2), ctx.tp_group, input_splits=[1, 1, 1])
    return True


def test_clear_errors(run_ranks):
    assert run_ranks(_not_divisible, 2) == [True, True]
