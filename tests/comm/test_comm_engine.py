"""The communication engine (SPEC F11): algorithm choice from the cost model, and hierarchical and
point-to-point collectives equal to the flat ones — values, autograd gradients, and the ledger's
record of what ran at which level — on 4 ranks declared as 2 nodes × 2, and on 2 ranks."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import (CommLedger, all_gather_along, init_parallel, reduce_from_tp_region,
                             reduce_scatter_along)
from ops_transformer.comm import collectives as C
from ops_transformer.comm.engine import NodeLayout, lookup
from ops_transformer.comm.ledger import CommStep
from ops_transformer.planner.collective_algorithms import (algorithm_times, choose_algorithm,
                                                           executed_time, p2p_faster, staged_time)
from ops_transformer.planner.hardware import CPU_GLOO, HardwareProfile
from ops_transformer.planner.calibrated import CalibratedProfile

FP32_EXACT = 1e-6  # the bound: only the order of the sums differs from flat
# Links between "nodes" so slow that every message but the tiniest goes hierarchical.
SLOW_INTER = dataclasses.replace(CPU_GLOO, name="slow inter-node", inter_node_bandwidth=1e3)
# A measured point-to-point threshold: a swap beats an all-gather below 64 KiB.
P2P = CalibratedProfile("p2p below 64 KiB", 4.5e10, 2.2e-4, 0.94e9,
                        p2p_threshold_bytes=1 << 16, p2p_small_messages="send_recv")


# ---------------------------------------------------------------- the choice (no process group)

def test_node_layout():
    layout = NodeLayout(8, 4)
    assert layout.nodes == 2 and [layout.node_of(r) for r in (0, 3, 4, 7)] == [0, 0, 1, 1]
    assert layout.level([0, 1, 2]) == "intra" and layout.level([3, 4]) == "inter"
    assert layout.split([0, 2, 4, 6]) == [[0, 2], [4, 6]]
    assert layout.split([0, 1, 2, 4]) is None  # 3 ranks on node 0, 1 on node 1
    for bad, needle in ((3, r"ranks_per_node \(3\) must divide the world size \(8\)"),
                        (0, "positive integer")):
        with pytest.raises(ValueError, match=needle):
            NodeLayout(8, bad)


def test_equal_links_always_run_flat():
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        for n in (4, 1 << 10, 1 << 20, 1 << 28):
            assert choose_algorithm(CPU_GLOO, kind, n, 2, 2)[0] == "flat", (kind, n)


def test_choice_follows_the_inter_node_bandwidth():
    """The lower the profile's inter-node bandwidth, the smaller the message from which the
    hierarchical all-reduce wins; with equal links it never does."""
    crossovers = []
    for ratio in (2, 10, 100):
        profile = dataclasses.replace(CPU_GLOO, inter_node_bandwidth=CPU_GLOO.bandwidth / ratio)
        sizes = [1 << k for k in range(0, 30)]
        chosen = [choose_algorithm(profile, "all_reduce", n, 2, 2)[0] for n in sizes]
        assert chosen[0] == "flat" and chosen[-1] == "hierarchical", ratio
        first = chosen.index("hierarchical")
        assert set(chosen[first:]) == {"hierarchical"}  # one crossover
        crossovers.append(sizes[first])
    assert crossovers[0] > crossovers[1] > crossovers[2]


def test_hierarchical_time_is_its_steps():
    prof = dataclasses.replace(CPU_GLOO, inter_node_alpha_s=1e-3, inter_node_bandwidth=1e8)
    n, t = 1 << 20, prof.collective_time
    inter_ar = 1e-3 + 2 * 1 / 2 * (n // 4) * 4 / 1e8  # the shard across the slow link
    assert staged_time(prof, "all_reduce", n, 4, 2) == pytest.approx(
        t("reduce_scatter", n, 4) + inter_ar + t("all_gather", n, 4))
    assert algorithm_times(prof, "all_reduce", n, 4, 2)["flat"] == pytest.approx(
        1e-3 + 2 * 7 / 8 * n * 4 / 1e8)  # one ring at the slow link
    assert set(algorithm_times(prof, "all_reduce", n, 4, 1)) == {"flat"}  # one node
    assert set(algorithm_times(prof, "all_to_all", n, 4, 2)) == {"flat"}


def test_p2p_below_the_calibrated_threshold_only():
    assert p2p_faster(P2P, 1000) and not p2p_faster(P2P, 1 << 16)
    assert not p2p_faster(CPU_GLOO, 4)  # never measured: never chosen
    large_first = dataclasses.replace(P2P, p2p_small_messages="all_gather")
    assert not p2p_faster(large_first, 1000) and p2p_faster(large_first, 1 << 20)
    assert choose_algorithm(P2P, "all_reduce", 1000, 1, 2)[0] == "p2p"
    assert choose_algorithm(P2P, "all_reduce", 1 << 20, 1, 2)[0] == "flat"
    # all-gather / reduce-scatter exchange half of the logical tensor
    assert choose_algorithm(P2P, "all_gather", 2 * (1 << 14) - 2, 2, 1)[0] == "p2p"
    assert choose_algorithm(P2P, "all_gather", 2 * (1 << 14), 2, 1)[0] == "flat"
    assert choose_algorithm(P2P, "all_reduce", 1000, 2, 2)[0] == "flat"  # 4 ranks: no swap


# ---------------------------------------------------------------- on ranks

def _inputs(seed, shape, world):
    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed + r))
            for r in range(world)]


def _collectives(g, r, p):
    """All-reduce (odd size: padded), all-gather and reduce-scatter on group ``g`` (this rank is
    its ``r``-th of ``p``), sync and async, against the exact sums; returns the ledger."""
    xs = _inputs(0, (3, 7), p)  # 21 elements: not a multiple of the ranks per node
    full = sum(x.double() for x in xs).float()
    with CommLedger() as ledger:
        y = xs[r].clone()
        C.all_reduce(y, g)
        assert_rel(y, full, FP32_EXACT, "all_reduce")
        z = xs[r].clone()
        C.all_reduce(z, g, async_op=True).wait()
        assert torch.equal(z, y)
        shards = _inputs(10, (2, 5), p)
        out = torch.empty(2 * p, 5)
        C.all_gather_into(out, shards[r], g)
        assert torch.equal(out, torch.cat(shards))
        big = _inputs(20, (2 * p, 3), p)
        mine = torch.empty(2, 3)
        C.reduce_scatter_into(mine, big[r], g)
        assert_rel(mine, sum(b.double() for b in big).float()[2 * r:2 * r + 2], FP32_EXACT, "rs")
        m = xs[r].clone()
        C.all_reduce(m, g, op=C.ReduceOp.MAX)
        assert torch.equal(m, torch.stack(xs).amax(0))
    return y, ledger


def _autograd(g, r, p):
    """The TP primitives built on these collectives: forward and input gradients vs dense."""
    xs, grads = _inputs(30, (2 * p, 6), p), _inputs(40, (2 * p, 6), p)
    x = xs[r].clone().requires_grad_()
    y = reduce_from_tp_region(x, g)
    assert_rel(y, sum(xs), FP32_EXACT, "reduce_from fwd")
    x2 = xs[r].clone().requires_grad_()
    gathered = all_gather_along(x2, g, 0)  # (2p·2p, 6)
    assert torch.equal(gathered, torch.cat(xs))
    upstream = _inputs(60, gathered.shape, p)  # each rank a different upstream gradient
    gathered.backward(upstream[r])
    total = sum(u.double() for u in upstream).float()
    assert_rel(x2.grad, total[2 * p * r:2 * p * (r + 1)], FP32_EXACT, "all_gather_along bwd")
    x3 = xs[r].clone().requires_grad_()
    scattered = reduce_scatter_along(x3, g, 0)
    assert_rel(scattered, sum(xs)[2 * r:2 * r + 2], FP32_EXACT, "reduce_scatter_along fwd")
    scattered.backward(grads[r][:2])
    assert torch.equal(x3.grad, torch.cat([gr[:2] for gr in grads]))


def _priced(g):
    """Each kind at sizes the ranks per node divide (no padding), fp32 and bf16: the records."""
    with CommLedger() as ledger:
        for dtype in (torch.float32, torch.bfloat16):
            for n in (8, 1 << 14, 1 << 16):
                C.all_reduce(torch.ones(n, dtype=dtype), g)
                C.all_gather_into(torch.empty(n, dtype=dtype), torch.ones(n // 4, dtype=dtype), g)
                C.reduce_scatter_into(torch.empty(n // 4, dtype=dtype), torch.ones(n, dtype=dtype),
                                      g)
    return ledger.records


def _hierarchical_worker(profile):
    ctx = init_parallel(tp=4, ranks_per_node=2, profile=profile)
    found = lookup(ctx.tp_group)
    y, ledger = _collectives(ctx.tp_group, ctx.tp_rank, ctx.tp_size)
    _autograd(ctx.tp_group, ctx.tp_rank, ctx.tp_size)
    return (ctx.ranks_per_node, found.describe(), y, ledger.summary(), ledger.by_algorithm(),
            ledger.by_level(), [r.steps for r in ledger.records], _priced(ctx.tp_group))


def test_hierarchical_equals_flat_at_2_nodes_x_2(run_ranks):
    hier = run_ranks(_hierarchical_worker, 4, SLOW_INTER)
    flat = run_ranks(_hierarchical_worker, 4, CPU_GLOO)
    for rank, (rpn, desc, y, summary, by_algo, by_level, steps, _) in enumerate(hier):
        assert rpn == 2 and desc["level"] == "inter" and (desc["per_node"], desc["nodes"]) == (2, 2)
        node, local = divmod(rank, 2)
        assert desc["intra_ranks"] == [2 * node, 2 * node + 1]
        assert desc["inter_ranks"] == [local, local + 2]
        assert torch.equal(y, hier[0][2])  # every rank the same bits
        assert_rel(y, flat[rank][2], FP32_EXACT, "hierarchical vs flat")
        assert summary == flat[rank][3]  # the same logical collectives
        assert set(by_algo) == {"hierarchical"} and set(flat[rank][4]) == {"flat"}
        # all-reduce of 21 elements, padded to 22: RS 22 intra, AR 11 inter, AG 22 intra
        intra, inter = (2 * node, 2 * node + 1), (local, local + 2)
        assert steps[0] == (CommStep("reduce_scatter", 22, 88, intra, "intra"),
                            CommStep("all_reduce", 11, 44, inter, "inter"),
                            CommStep("all_gather", 22, 88, intra, "intra"))
        assert by_level["inter"]["all_reduce"]["calls"] == 3  # sum, async sum, max
        assert set(by_level) == {"intra", "inter"}
        assert set(flat[rank][5]) == {"inter"}  # flat: one ring across the nodes


def test_cost_formula_equals_the_ledger(run_ranks):
    """The engine runs the algorithm the planner's formula prices lowest, and what the ledger says
    ran, priced step by step at its level, is the time the formula predicted for that algorithm.
    With a 10× slower link between the nodes, small messages run flat and large ones
    hierarchically: both are checked."""
    profile = dataclasses.replace(CPU_GLOO, inter_node_bandwidth=CPU_GLOO.bandwidth / 10)
    records = run_ranks(_hierarchical_worker, 4, profile)[1][-1]  # rank 1: node 0, local 1
    assert len(records) == 18
    for r in records:
        chosen, times = choose_algorithm(profile, r.kind, r.elements, 2, 2, r.bytes // r.elements)
        assert r.algorithm == chosen, (r.kind, r.elements, r.dtype)
        assert executed_time(profile, r.executed()) == pytest.approx(times[chosen], rel=1e-12)
        assert len(r.executed()) == (1 if chosen == "flat" else 3 if r.kind == "all_reduce"
                                     else 2)
    ran = {(r.elements, r.dtype): {q.algorithm for q in records
                                   if (q.elements, q.dtype) == (r.elements, r.dtype)}
           for r in records}
    assert ran[8, torch.float32] == ran[8, torch.bfloat16] == {"flat"}
    assert ran[1 << 16, torch.float32] == ran[1 << 16, torch.bfloat16] == {"hierarchical"}
    # the bytes decide, not the elements: 64 KiB of fp32 go hierarchical, 32 KiB of bf16 do not
    assert ran[1 << 14, torch.float32] == {"hierarchical"}
    assert ran[1 << 14, torch.bfloat16] == {"flat"}


def _p2p_worker(profile, numel):
    """dp 2 × tp 2 on 2 nodes × 2: TP groups of two inside a node, DP groups of two across."""
    ctx = init_parallel(tp=2, dp=2, ranks_per_node=2, profile=profile)
    out = {}
    for axis in ("tp", "dp"):
        g, r = getattr(ctx, f"{axis}_group"), getattr(ctx, f"{axis}_rank")
        xs = _inputs(50, (numel,), 2)
        y = xs[r].clone()
        with CommLedger() as ledger:
            C.all_reduce(y, g)
            _collectives(g, r, 2)
            _autograd(g, r, 2)
        out[axis] = (y, ledger.records[0], ledger.by_algorithm())
    return out


def test_p2p_equals_flat_bitwise_in_groups_of_two(run_ranks):
    small, large = run_ranks(_p2p_worker, 4, P2P, 1000), run_ranks(_p2p_worker, 4, P2P, 1 << 15)
    xs = _inputs(50, (1000,), 2)
    for rank in range(4):
        for axis, level in (("tp", "intra"), ("dp", "inter")):
            y, record, by_algo = small[rank][axis]
            assert torch.equal(y, xs[0] + xs[1])  # the flat sum of two, bit for bit
            assert record.algorithm == "p2p" and record.level == level
            peers = (rank - rank % 2, rank - rank % 2 + 1) if axis == "tp" else (rank % 2,
                                                                                 rank % 2 + 2)
            assert [(s.kind, s.elements, s.group_ranks) for s in record.steps] == \
                [("send", 1000, peers), ("recv", 1000, peers)]
            assert set(by_algo) == {"p2p"}
            assert large[rank][axis][1].algorithm == "flat"  # 128 KiB: above the threshold


def _layout_worker(tp, ranks_per_node, env_local_world_size, ep=1):
    if env_local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = env_local_world_size  # as torchrun sets it
    ctx = init_parallel(tp=tp, ep=ep, ranks_per_node=ranks_per_node)
    axes = ("tp", "dp", "world") if ep == 1 else ("dp", "ep", "dp_ep", "world")
    levels = {axis: lookup(getattr(ctx, f"{axis}_group")).level
              for axis in axes if getattr(ctx, f"{axis}_group") is not None}
    import torch.distributed as dist

    tp_ranks = tuple(dist.get_process_group_ranks(ctx.tp_group)) if ctx.tp_group else (ctx.rank,)
    return ctx.ranks_per_node, tp_ranks, levels


def test_tp_groups_stay_inside_a_node(run_ranks):
    out = run_ranks(_layout_worker, 4, 2, 2, None)
    assert [o[1] for o in out] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert all(o[0] == 2 and o[2] == {"tp": "intra", "dp": "inter", "world": "inter"}
               for o in out)
    from_env = run_ranks(_layout_worker, 4, 4, None, "2")  # ranks_per_node=None: torchrun's
    assert all(o[0] == 2 and o[2] == {"tp": "inter", "world": "inter"} for o in from_env)
    one_node = run_ranks(_layout_worker, 2, 2, None, None)  # launch's LOCAL_WORLD_SIZE: 2
    assert all(o[0] == 2 and o[2] == {"tp": "intra", "world": "intra"} for o in one_node)
    experts = run_ranks(_layout_worker, 4, 1, 2, None, 2)  # dp 2 × ep 2: the flattened group too
    assert all(o[2] == {"dp": "inter", "ep": "intra", "dp_ep": "inter", "world": "inter"}
               for o in experts)


def _bad_ranks_per_node(value):
    init_parallel(tp=2, ranks_per_node=value)


def test_bad_ranks_per_node_raises_on_every_rank(run_ranks):
    with pytest.raises(ValueError, match=r"ranks_per_node \(3\) must divide the world size \(2\)"):
        run_ranks(_bad_ranks_per_node, 2, 3)
