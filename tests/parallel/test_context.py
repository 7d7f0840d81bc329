"""ParallelContext / init_parallel: the rank grid and its validation."""

from __future__ import annotations

import pytest
import torch

from ops_transformer import ParallelContext, init_parallel
from ops_transformer.parallel.context import check_degrees


def test_check_degrees_infers_dp():
    assert check_degrees(8, tp=2, dp=None, ep=1) == (4, 1, 2)
    assert check_degrees(8, tp=2, dp=None, ep=2) == (2, 2, 2)
    assert check_degrees(4, tp=4, dp=1, ep=1) == (1, 1, 4)


@pytest.mark.parametrize("world,tp,dp,ep,needles", [
    (4, 3, None, 1, ["world size 4", "tp (3)", "ep (1)"]),
    (8, 2, 3, 1, ["dp (3)", "ep (1)", "tp (2)", "= 6", "world size (8)"]),
    (4, 2, 1, 4, ["tp (2)", "ep (4)"]),
])
def test_check_degrees_names_every_factor(world, tp, dp, ep, needles):
    with pytest.raises(ValueError) as info:
        check_degrees(world, tp=tp, dp=dp, ep=ep)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_check_degrees_rejects_non_positive_integers(bad):
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        check_degrees(4, tp=bad, dp=None, ep=1)


def test_single_process_without_environment(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    ctx = init_parallel(tp=1)
    assert (ctx.world_size, ctx.tp_size, ctx.dp_size, ctx.tp_group) == (1, 1, 1, None)
    with pytest.raises(ValueError, match=r"tp \(2\)"):
        init_parallel(tp=2)


def test_context_is_frozen():
    ctx = ParallelContext.single()
    with pytest.raises(Exception):
        ctx.tp_size = 2


def _grid(tp, dp, ep):
    ctx = init_parallel(tp=tp, dp=dp, ep=ep)
    sizes = {
        "tp": None if ctx.tp_group is None else ctx.tp_group.size(),
        "dp": None if ctx.dp_group is None else ctx.dp_group.size(),
    }
    return (ctx.rank, ctx.world_size, ctx.tp_rank, ctx.tp_size, ctx.dp_rank, ctx.dp_size,
            ctx.ep_rank, ctx.ep_size, sizes, tuple(ctx.mesh.mesh_dim_names), str(ctx.device))


def test_grid_dp2_tp2_is_tp_fastest(run_ranks):
    out = run_ranks(_grid, 4, 2, None, 1)
    for rank, (r, world, tp_rank, tp, dp_rank, dp, ep_rank, ep, sizes, names, dev) in enumerate(out):
        assert (r, world, tp, dp, ep) == (rank, 4, 2, 2, 1)
        assert (tp_rank, dp_rank, ep_rank) == (rank % 2, rank // 2, 0)
        assert sizes == {"tp": 2, "dp": 2}
        assert names == ("dp", "ep", "tp") and dev == "cpu"


def test_grid_tp4(run_ranks):
    out = run_ranks(_grid, 4, 4, None, 1)
    assert [o[2] for o in out] == [0, 1, 2, 3]
    assert all(o[5] == 1 and o[8]["dp"] is None for o in out)


def _bad_degrees():
    init_parallel(tp=2, dp=2)


def test_bad_degrees_on_ranks_raise_value_error(run_ranks):
    with pytest.raises(ValueError, match=r"dp \(2\) × ep \(1\) × tp \(2\) = 4 must equal the world "
                                         r"size \(2\)"):
        run_ranks(_bad_degrees, 2)


def _reuse_default_group():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    ctx = init_parallel(tp=2)
    t = torch.ones(1)
    dist.all_reduce(t, group=ctx.tp_group)
    return ctx.tp_size, float(t)


def test_reuses_initialised_default_group(run_ranks):
    assert run_ranks(_reuse_default_group, 2) == [(2, 2.0), (2, 2.0)]


def _cp_grid(tp, cp):
    ctx = init_parallel(tp=tp, cp=cp)
    return (ctx.cp_rank, ctx.cp_size, ctx.tp_rank, ctx.dp_size, tuple(ctx.mesh.mesh_dim_names),
            ctx.cp_group.size(), ctx.grad_group.size())


def test_grid_cp2_tp2_places_cp_between_dp_and_tp(run_ranks):
    for rank, (cp_rank, cp, tp_rank, dp, names, cp_group, grad) in enumerate(
            run_ranks(_cp_grid, 4, 2, 2)):
        assert (cp_rank, cp, tp_rank, dp) == (rank // 2, 2, rank % 2, 1)
        assert names == ("dp", "ep", "cp", "tp") and cp_group == 2 and grad == 2


def test_check_mesh_degrees_names_every_factor():
    from ops_transformer.parallel.context import check_mesh_degrees
    assert check_mesh_degrees(8, tp=2, dp=None, ep=1, cp=2) == (2, 1, 2, 2)
    with pytest.raises(ValueError, match=r"dp \(2\) × ep \(1\) × cp \(2\) × tp \(2\) = 8 must "
                                         r"equal the world size \(4\)"):
        check_mesh_degrees(4, tp=2, dp=2, ep=1, cp=2)
    with pytest.raises(ValueError, match="cp must be a positive integer, got 0"):
        check_mesh_degrees(4, tp=2, dp=None, ep=1, cp=0)
