"""Staged collectives over PCIe islands (SPEC F11, issue 29 item 4): islands from the topology or
``init_parallel(ranks_per_island=K)``, the cost model's choice between flat and staged, and every TP
primitive equal to flat — values and autograd gradients — on 4 ranks declared as 2 islands of 2,
with the stages in the ledger."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import assert_rel
from ops_transformer import (CommLedger, all_gather_along, all_to_all, copy_to_tp_region,
                             gather_from_tp_region, init_parallel, reduce_from_tp_region,
                             reduce_scatter_along, scatter_to_tp_region)
from ops_transformer.comm import collectives as C
from ops_transformer.comm.engine import NodeLayout, lookup, staging_can_win
from ops_transformer.comm.ledger import CommStep
from ops_transformer.comm.topology import (Topology, parse_nvidia_smi_topo, pcie_islands,
                                           ranks_per_island)
from ops_transformer.parallel.nodes import detect_islands
from ops_transformer.planner.collective_algorithms import (algorithm_times, choose_algorithm,
                                                           executed_time, island_staged_time)
from ops_transformer.planner.hardware import CPU_GLOO

FP32_EXACT = 1e-6  # only the order of the sums differs from flat
# The link between islands 10x slower than inside one, 10 µs per collective: messages above ~1000
# elements go staged.
SLOW_LINK = dataclasses.replace(CPU_GLOO, name="slow island link", alpha_s=1e-5,
                                inter_island_bandwidth=CPU_GLOO.bandwidth / 10)
# 1.5x slower: below the factor m = 2 that staging needs on 2 islands: always flat.
MILD_LINK = dataclasses.replace(CPU_GLOO, name="mild island link",
                                inter_island_bandwidth=CPU_GLOO.bandwidth / 1.5)

# Two PCIe switches, two GPUs behind each, the switches on different sockets (nvidia-smi topo -m).
TWO_SWITCHES = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tPIX\tSYS\tSYS\t0-15\t0
GPU1\tPIX\t X \tSYS\tSYS\t0-15\t0
GPU2\tSYS\tSYS\t X \tPIX\t16-31\t1
GPU3\tSYS\tSYS\tPIX\t X \t16-31\t1
"""


def _gpu(matrix_text: str) -> Topology:
    matrix = parse_nvidia_smi_topo(matrix_text)
    return Topology("gpu", len(matrix), len(matrix), matrix, "nvidia-smi")


# ---------------------------------------------------------------- islands (no process group)

def test_islands_from_the_topology():
    two = _gpu(TWO_SWITCHES)
    assert pcie_islands(two) == [[0, 1], [2, 3]] and ranks_per_island(two) == 2
    assert detect_islands(4, "nccl", two) == 2
    assert detect_islands(8, "nccl", two) is None  # not one device per local rank
    nvlink = _gpu(TWO_SWITCHES.replace("SYS", "NV12").replace("PIX", "NV12"))
    assert pcie_islands(nvlink) == [[0, 1, 2, 3]] and ranks_per_island(nvlink) is None
    host = _gpu(TWO_SWITCHES.replace("PIX", "PHB"))  # every pair through a host bridge
    assert ranks_per_island(host) is None  # islands of one GPU: nothing to stage inside
    crossed = _gpu(TWO_SWITCHES.replace("GPU1\tPIX\t X \tSYS\tSYS", "GPU1\tSYS\t X \tSYS\tPIX")
                   .replace("GPU0\t X \tPIX\tSYS\tSYS", "GPU0\t X \tSYS\tPIX\tSYS")
                   .replace("GPU2\tSYS\tSYS\t X \tPIX", "GPU2\tPIX\tSYS\t X \tSYS")
                   .replace("GPU3\tSYS\tSYS\tPIX\t X ", "GPU3\tSYS\tPIX\tSYS\t X "))
    assert pcie_islands(crossed) == [[0, 2], [1, 3]]
    assert ranks_per_island(crossed) is None  # interleaved devices: not modelled
    cpu = Topology("cpu", 4, 4, [["self" if i == j else "loopback" for j in range(4)]
                                 for i in range(4)], "cpu")
    assert ranks_per_island(cpu) is None and detect_islands(4, "gloo") is None


def test_node_layout_with_islands():
    layout = NodeLayout(8, 4, 2)
    assert layout.islands_per_node == 2 and [layout.island_of(r) for r in (0, 2, 5, 7)] == \
        [0, 1, 2, 3]
    assert layout.level([0, 1]) == "intra" and layout.level([0, 2]) == "inter_island"
    assert layout.level([2, 5]) == "inter"
    assert layout.split_islands([0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert layout.split_islands([0, 1, 2]) is None and layout.split_islands([0, 4]) is None
    assert NodeLayout(4, 4).level([0, 3]) == "intra"  # no islands declared: as before
    for bad, needle in ((3, r"ranks_per_island \(3\) must divide the ranks per node \(4\)"),
                        (0, "ranks_per_island must be a positive integer")):
        with pytest.raises(ValueError, match=needle):
            NodeLayout(8, 4, bad)


def test_equal_links_never_stage():
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        for n in (4, 1 << 10, 1 << 20, 1 << 28):
            chosen, times = choose_algorithm(CPU_GLOO, kind, n, 4, 1, islands=2)
            assert chosen == "flat" and "staged" in times, (kind, n)
    assert not staging_can_win(CPU_GLOO, 2, 2) and not staging_can_win(MILD_LINK, 2, 2)
    assert staging_can_win(SLOW_LINK, 2, 2) and not staging_can_win(SLOW_LINK, 1, 4)


def test_staging_wins_beyond_m_times_slower_link():
    """On bandwidth, staged beats flat exactly when the island links are more than ``m`` times
    faster than the link between islands (``m`` islands; the docstring's derivation)."""
    n = 1 << 28  # large: latencies negligible
    for m, k in ((2, 2), (4, 2), (2, 4)):
        for ratio, wins in ((0.9 * m, False), (1.1 * m, True)):
            prof = dataclasses.replace(CPU_GLOO, inter_island_bandwidth=CPU_GLOO.bandwidth / ratio)
            chosen, _ = choose_algorithm(prof, "all_reduce", n, k * m, 1, islands=m)
            assert (chosen == "staged") == wins, (m, k, ratio)


def test_staged_time_is_its_steps():
    prof = dataclasses.replace(SLOW_LINK, inter_island_alpha_s=1e-3)
    n, t = 1 << 20, prof.collective_time
    # the cross-island all-reduce of the n/2 shard: 2 flows share the link (1/10 of β, halved)
    cross = 1e-3 + 2 * 1 / 2 * (n // 2) * 4 / (CPU_GLOO.bandwidth / 10 / 2)
    assert island_staged_time(prof, "all_reduce", n, 2, 2) == pytest.approx(
        t("reduce_scatter", n, 2) + cross + t("all_gather", n, 2))
    times = algorithm_times(prof, "all_reduce", n, 4, 1, islands=2)
    assert times["flat"] == pytest.approx(1e-3 + 2 * 3 / 4 * n * 4 / (CPU_GLOO.bandwidth / 10))
    assert set(algorithm_times(prof, "all_reduce", n, 4, 2, islands=2)) == {"flat",
                                                                            "hierarchical"}
    assert set(algorithm_times(prof, "all_to_all", n, 4, 1, islands=2)) == {"flat"}
    steps = (CommStep("reduce_scatter", n, 4 * n, (0, 1), "intra"),
             CommStep("all_reduce", n // 2, 2 * n, (0, 2), "inter_island", 2),
             CommStep("all_gather", n, 4 * n, (0, 1), "intra"))
    assert executed_time(prof, steps) == pytest.approx(times["staged"], rel=1e-12)


# ---------------------------------------------------------------- on 4 ranks, 2 islands of 2

def _inputs(seed, shape, world):
    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed + r))
            for r in range(world)]


def _primitives(g, r, p):
    """Every TP primitive on group ``g``: outputs and input gradients (each rank feeds its own
    upstream gradient, seeded by rank), in a fixed order."""
    out = {}
    xs = _inputs(0, (2 * p, 2 * p, 160), p)  # 10240 elements at p = 4

    def run(name, fn, seed):
        x = xs[r].clone().requires_grad_()
        y = fn(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + r)))
        out[name] = (y.detach(), x.grad)

    run("copy_to_tp_region", lambda x: copy_to_tp_region(x, g) * 1.0, 100)
    run("reduce_from_tp_region", lambda x: reduce_from_tp_region(x * 1.0, g), 200)
    run("reduce_from_tp_region inplace",
        lambda x: reduce_from_tp_region(x * 1.0, g, inplace=True), 300)
    run("scatter_to_tp_region", lambda x: scatter_to_tp_region(x, g, -2), 400)
    run("gather_from_tp_region", lambda x: gather_from_tp_region(x, g, -1), 500)
    run("all_gather_along", lambda x: all_gather_along(x, g, 0), 600)
    run("reduce_scatter_along", lambda x: reduce_scatter_along(x, g, 0), 700)
    run("all_to_all", lambda x: all_to_all(x, g), 800)
    odd = xs[r].reshape(-1)[:2001].clone()  # padded to 2002 over an island of two
    C.all_reduce(odd, g)
    out["all_reduce odd"] = (odd, None)
    m = xs[r].clone()
    C.all_reduce(m, g, op=C.ReduceOp.MAX)
    out["all_reduce max"] = (m, None)
    return out


def _staged_worker(profile):
    ctx = init_parallel(tp=4, ranks_per_island=2, profile=profile)
    with CommLedger() as ledger:
        out = _primitives(ctx.tp_group, ctx.tp_rank, ctx.tp_size)
    return (ctx.ranks_per_island, lookup(ctx.tp_group).describe(), out, ledger.summary(),
            ledger.by_algorithm(), ledger.by_level(), ledger.records)


def test_every_tp_primitive_staged_equals_flat(run_ranks):
    staged = run_ranks(_staged_worker, 4, SLOW_LINK)
    flat = run_ranks(_staged_worker, 4, CPU_GLOO)
    for rank, (rpi, desc, out, summary, by_algo, by_level, records) in enumerate(staged):
        island, local = divmod(rank, 2)
        assert rpi == 2 and desc["level"] == "inter_island" and desc["islands"] == 2
        assert desc["island_ranks"] == [2 * island, 2 * island + 1]
        assert desc["cross_ranks"] == [local, local + 2]
        for name, (y, grad) in out.items():
            y_flat, grad_flat = flat[rank][2][name]
            assert_rel(y, y_flat, FP32_EXACT, f"{name} forward")
            if grad is not None:
                assert_rel(grad, grad_flat, FP32_EXACT, f"{name} input gradient")
        assert summary == flat[rank][3]  # the same logical collectives
        assert set(flat[rank][4]) == {"flat"} and set(flat[rank][5]) == {"inter_island"}
        assert "staged" in by_algo and set(by_level) == {"intra", "inter_island"}
        for r in records:  # what ran is what the cost model preferred
            chosen, times = choose_algorithm(SLOW_LINK, r.kind, r.elements, 4, 1,
                                             r.bytes // r.elements, islands=2)
            assert r.algorithm == chosen, (r.kind, r.elements)
            padded = r.elements % 2 != 0  # the padding element: priced by the ledger only
            assert executed_time(SLOW_LINK, r.executed()) == pytest.approx(
                times[chosen], rel=1e-3 if padded else 1e-12)
        odd = next(r for r in records if r.kind == "all_reduce" and r.elements == 2001)
        intra, cross = (2 * island, 2 * island + 1), (local, local + 2)
        assert odd.algorithm == "staged" and odd.steps == (
            CommStep("reduce_scatter", 2002, 8008, intra, "intra"),
            CommStep("all_reduce", 1001, 4004, cross, "inter_island", 2),
            CommStep("all_gather", 2002, 8008, intra, "intra"))
        assert {r.algorithm for r in records if r.kind == "all_to_all"} == {"flat"}


def _sizes_worker(profile):
    ctx = init_parallel(tp=4, ranks_per_island=2, profile=profile)
    with CommLedger() as ledger:
        for n in (8, 1 << 10, 1 << 16):
            C.all_reduce(torch.ones(n), ctx.tp_group)
            C.all_gather_into(torch.empty(n), torch.ones(n // 4), ctx.tp_group)
            C.reduce_scatter_into(torch.empty(n // 4), torch.ones(n), ctx.tp_group)
    return {(r.kind, r.elements): r.algorithm for r in ledger.records}


def test_staged_only_where_the_cost_model_prefers_it(run_ranks):
    slow = run_ranks(_sizes_worker, 4, SLOW_LINK)[0]
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        assert slow[kind, 8] == "flat"  # latency-bound: two extra steps do not pay
        assert slow[kind, 1 << 16] == "staged"
    assert set(run_ranks(_sizes_worker, 4, MILD_LINK)[0].values()) == {"flat"}


def _bad_islands(value):
    init_parallel(tp=2, ranks_per_island=value)


def test_bad_ranks_per_island_raises_on_every_rank(run_ranks):
    with pytest.raises(ValueError, match=r"ranks_per_island \(3\) must divide the ranks per "
                                         r"node \(2\)"):
        run_ranks(_bad_islands, 2, 3)
