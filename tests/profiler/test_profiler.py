"""The profiler (SPEC F12): per-kind communication time exactly where the ledger saw collectives,
compute + exposed communication against the wall clock of the same steps, valid Chrome traces;
each diagnostic on a model planted with its problem, and none on the reference GPT."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from torch import nn

import ops_transformer as ot
from ops_transformer.models.gpt import GPT, GPTConfig, preset
from ops_transformer.parallel.context import ParallelContext
from ops_transformer.profiler import timeline as T

SILENT_ON_REFERENCE = {"exposed_comm", "load_imbalance"}  # these depend on the machine


class Planted(nn.Module):
    """A column→row MLP with one planted problem: ``item`` (a host sync in forward), ``dup``
    (the reduced output reduced again: identical on every rank), ``chatty`` (twelve tiny
    all-reduces back to back)."""

    def __init__(self, ctx, problem: str | None = None, d: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.ctx, self.problem = ctx, problem
        self.fc1 = ot.ColumnParallelLinear.from_dense(nn.Linear(d, 4 * d), ctx)
        self.fc2 = ot.RowParallelLinear.from_dense(nn.Linear(4 * d, d), ctx)

    def forward(self, x):
        h = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        if self.problem == "item":
            h = h / (1.0 + h.abs().max().item())
        if self.problem == "dup":
            h = ot.reduce_from_tp_region(h, self.ctx.tp_group)
        if self.problem == "chatty":
            for i in range(12):
                part = torch.full((4,), float(self.ctx.tp_rank + i))  # differs across ranks
                h = h + ot.reduce_from_tp_region(part, self.ctx.tp_group).sum()
        return h


def _step(model, x):
    def step():
        model(x).square().mean().backward()
    return step


def _split_vocab_gpt(batch: int, seq: int):
    """The 1-layer tiny GPT at tp 2 with its vocabulary split (one all-gather in the loss), and
    a batch of tokens."""
    ctx = ot.init_parallel(tp=2)
    torch.manual_seed(0)
    model = ot.parallelize(GPT(preset("tiny", n_layers=1)), ctx, attention="heads",
                           vocab="parallel")
    return ctx, model, torch.randint(0, 256, (batch, seq + 1))


def _profile_worker():
    ctx, model, x = _split_vocab_gpt(8, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        model(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with ot.CommLedger() as ledger:
        step()
    prof = ot.profile_step(step, ctx, steps=3, warmup=1)
    path = os.path.join(tempfile.mkdtemp(), f"trace_rank{ctx.rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    return prof.summary(), sorted(ledger.summary()), trace


def test_profile_step_two_ranks(run_ranks):
    (s0, kinds, trace), (s1, _, _) = run_ranks(_profile_worker, 2)
    assert s0 == s1  # the same summary on every rank
    assert s0["ranks"] == 2 and s0["steps"] == 3 and len(s0["per_rank"]) == 2
    assert kinds == ["all_gather", "all_reduce"]  # vocab-parallel loss: one all-gather
    for r in s0["per_rank"]:
        assert sorted(r["collectives"]) == kinds
        for kind in kinds:
            c = r["collectives"][kind]
            assert c["time_s"] > 0 and c["mean_latency_s"] > 0 and c["bus_bandwidth_Bps"] > 0
        assert r["matmul_s"] > 0 and r["exposed_comm_s"] > 0
        # the split against the wall clock of the same steps (perf_counter around step_fn)
        accounted = r["compute_s"] + r["exposed_comm_s"] + r["idle_s"]
        wall = sum(r["wall_step_times_s"]) / len(r["wall_step_times_s"])
        assert abs(r["compute_s"] + r["exposed_comm_s"] - wall) <= 0.10 * wall
        assert accounted == pytest.approx(r["step_time_s"], rel=1e-6)
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert {"ops_transformer::all_reduce", "ops_transformer::all_gather"} <= names
    assert any(n.startswith("gloo:") for n in names)
    path = s0["critical_path"]
    assert path["segments"] and any(seg["type"] == "comm" for seg in path["segments"])
    assert sum(seg["ms"] for seg in path["segments"]) == pytest.approx(1e3 * path["step_s"],
                                                                       rel=0.02)


def test_step_split_on_synthetic_events():
    E = T.Event
    events = [E("ops_transformer::step#0", 1, 0, 100), E("aten::mm", 1, 0, 30),
              E("aten::gelu", 1, 35, 45), E("ops_transformer::all_reduce", 1, 50, 70),
              E("ops_transformer::wait:all_reduce", 1, 90, 95), E("gloo:all_reduce", 7, 52, 94),
              E("aten::add", 1, 72, 88)]
    s = T.split_step(events, 0, 100)
    assert s.exposed_comm == pytest.approx(25e-6)  # 20 in the call + 5 waiting
    assert s.matmul == pytest.approx(30e-6)
    assert s.compute == pytest.approx(75e-6) and s.host == pytest.approx(19e-6)
    assert s.comm == pytest.approx(45e-6)  # 50..95 in flight
    assert s.overlapped_comm == pytest.approx(20e-6) and s.idle == 0
    assert T.kind_latencies(events, [(0, 100)]) == {"all_reduce": [pytest.approx(42e-6)]}
    assert T.subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]


def test_multi_step_algorithms_count_once_under_their_kind():
    """A point-to-point or hierarchical all-reduce: its steps nest in its call and wait ranges and
    move data as other kinds (send/recv), so its latency is the outermost ranges."""
    E = T.Event
    events = [E("ops_transformer::all_reduce", 1, 10, 12),
              E("ops_transformer::all_reduce.p2p", 1, 10, 11), E("gloo:send", 7, 10, 20),
              E("ops_transformer::wait:all_reduce", 1, 15, 25),
              E("ops_transformer::all_reduce.intra.reduce_scatter", 1, 30, 34),
              E("ops_transformer::all_reduce", 1, 29, 40)]
    assert T.comm_kind("ops_transformer::all_reduce.inter.all_reduce") == "all_reduce"
    got = T.kind_latencies(events, [(0, 50)], transfers=False)
    assert got == {"all_reduce": [pytest.approx(x * 1e-6) for x in (2, 10, 11)]}
    s = T.split_step(events, 0, 50)
    assert s.exposed_comm == pytest.approx(23e-6)  # 10..12, 15..25, 29..40


def test_step_split_on_a_device_timeline():
    """On a GPU the kernels are the timeline: NCCL kernels not hidden behind compute kernels are
    exposed, and the device's gaps are idle."""
    E = T.Event
    events = [E("ops_transformer::step#0", 1, 0, 100), E("aten::mm", 1, 0, 5),
              E("ampere_sgemm_128x64_tn", -1, 0, 40, True),
              E("ncclDevKernel_AllReduce_Sum_f32_RING_LL", -2, 30, 60, True),
              E("vectorized_elementwise_kernel", -1, 65, 70, True)]
    s = T.split_step(events, 0, 100)
    assert (s.compute, s.matmul, s.exposed_comm) == pytest.approx((45e-6, 40e-6, 20e-6))
    assert (s.comm, s.overlapped_comm, s.idle, s.host) == pytest.approx((30e-6, 10e-6, 35e-6, 0))
    assert T.comm_kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "all_reduce"


def test_dimension_diagnostics_without_ranks():
    ctx = ParallelContext(rank=0, world_size=2, tp_size=2, tp_rank=0, dp_size=1, dp_rank=0)
    odd = GPT(GPTConfig(d_model=60, n_heads=5, d_ff=240, vocab_size=251))
    found = {(d.code, d.where): d for d in ot.diagnose(odd, ctx)}
    assert found[("not_divisible", "attention")].severity == "warning"  # only kv_split runs it
    assert found[("unaligned_dim", "hidden")].severity == "warning"  # 60: not even 8
    assert found[("not_divisible", "vocabulary")].severity == "info"
    assert found[("unaligned_dim", "vocabulary")].severity == "warning"
    assert ("unaligned_dim", "ffn") in found  # 240 = 3.75 × 64
    bad = GPT(GPTConfig(d_model=64, n_heads=4, n_kv_heads=4, d_ff=256))
    four = ParallelContext(rank=0, world_size=3, tp_size=3, tp_rank=0, dp_size=1, dp_rank=0)
    errors = [d for d in ot.diagnose(bad, four) if d.severity == "error"]
    assert {d.where for d in errors} == {"attention", "mlp"}  # 4 heads, 256 FFN over 3 ranks
    assert ot.diagnose(GPT(preset("tiny")), ctx) == []


def _diagnose_worker(problem):
    ctx = ot.init_parallel(tp=2)
    model = Planted(ctx, problem)
    x = torch.randn(4, 8, 64)
    return [d.to_dict() for d in ot.diagnose(model, ctx, _step(model, x))]


@pytest.mark.parametrize("problem,code", [
    ("item", "host_sync"),
    pytest.param("dup", "redundant_collective", marks=pytest.mark.slow),
    pytest.param("chatty", "small_collectives", marks=pytest.mark.slow)])
def test_each_planted_problem_is_diagnosed(run_ranks, problem, code):
    found, other = run_ranks(_diagnose_worker, 2, problem)
    assert found == other  # the same list on every rank
    hits = [d for d in found if d["code"] == code]
    assert hits and all(d["severity"] == "warning" and d["suggestion"] for d in hits)
    if problem == "item":
        assert ".item()" in hits[0]["message"] and hits[0]["where"] == "Planted"
    if problem == "chatty":
        assert hits[0]["estimated_saving_s"] > 0
    others = {d["code"] for d in found} - {code} - SILENT_ON_REFERENCE
    assert not others, found


def _reference_worker(**memory):
    ctx = ot.init_parallel(tp=2)
    torch.manual_seed(0)
    model = ot.parallelize(GPT(preset("tiny")), ctx, **memory)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (8, 65))

    def step():
        model(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return [d.to_dict() for d in ot.diagnose(model, ctx, step)]


def test_reference_gpt_is_silent_but_for_machine_dependent_findings(run_ranks):
    found = run_ranks(_reference_worker, 2)[0]
    assert {d["code"] for d in found} <= SILENT_ON_REFERENCE, found


@pytest.mark.slow
def test_reference_gpt_with_sequence_parallelism_and_recompute_is_silent(run_ranks):
    """Sequence parallelism's reduce-scatters and all-gathers and full recompute's replayed
    forward collectives are the plan's, not redundant ones."""
    found = run_ranks(_reference_worker, 2, sequence_parallel=True, recompute="full")[0]
    assert {d["code"] for d in found} <= SILENT_ON_REFERENCE, found


def _vocab_parallel_worker():
    ctx, model, x = _split_vocab_gpt(4, 32)
    step = lambda: model(x[:, :-1], x[:, 1:])[1].backward()  # noqa: E731
    return [d.to_dict() for d in ot.diagnose(model, ctx, step)]


@pytest.mark.slow
def test_reference_gpt_with_a_split_vocabulary_is_silent(run_ranks):
    """The embedding's token-range check reads a CPU tensor only on a CPU: no host sync."""
    found = run_ranks(_vocab_parallel_worker, 2)[0]
    assert {d["code"] for d in found} <= SILENT_ON_REFERENCE, found


def test_a_sync_the_library_needs_is_info_with_its_reason():
    from ops_transformer.profiler.steps import host_syncs

    found = host_syncs([{"syncs": [[".item()", "Planted", None], [".item()", "Planted", None],
                                   [".tolist()", "layers.0.mlp.experts", "counts size it"]]}])
    assert [(d["severity"], d["where"], d["suggestion"]) for d in found][1] == \
        ("info", "layers.0.mlp.experts", "counts size it")
    assert found[0]["severity"] == "warning" and "(2× per step)" in found[0]["message"]


def _moe_worker():
    ctx = ot.init_parallel(ep=2)
    torch.manual_seed(0)
    model = ot.parallelize(GPT(preset("moe-tiny")), ctx)
    x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(ctx.rank))
    # (each EP rank reads its own rows, as in training: equal rows would make the dense
    # gradients' all-reduce a sum of replicas, which diagnose rightly reports)
    step = lambda: model(x[:, :-1], x[:, 1:])[1].backward()  # noqa: E731
    return [d.to_dict() for d in ot.diagnose(model, ctx, step)]


@pytest.mark.slow
def test_expert_parallel_moe_has_only_its_needed_syncs(run_ranks):
    """The dropless all-to-all reads its token counts on the host: an info finding per MoE
    layer, no warning beyond the machine's."""
    found = run_ranks(_moe_worker, 2)[0]
    syncs = [d for d in found if d["code"] == "host_sync"]
    assert syncs and all(d["severity"] == "info" and "experts" in d["where"] for d in syncs)
    assert {d["code"] for d in found} - {"host_sync"} <= SILENT_ON_REFERENCE, found


def _p2p_worker():
    """Every collective of the TP group as a point-to-point swap (a profile that measured swaps
    faster at every size): one ledger entry each, send/recv on the wire."""
    from ops_transformer.planner.calibrated import CalibratedProfile

    swaps = CalibratedProfile("swaps at every size", 4.5e10, 2.2e-4, 0.94e9,
                              p2p_threshold_bytes=None, p2p_small_messages="send_recv")
    ctx = ot.init_parallel(tp=2, profile=swaps)
    model = Planted(ctx, "dup")
    step = _step(model, torch.randn(4, 8, 64))
    with ot.CommLedger() as ledger:
        step()
    summary = ot.profile_step(step, ctx, steps=2, warmup=0).summary()
    found = [d.to_dict() for d in ot.diagnose(model, ctx, step)]
    return {r.algorithm for r in ledger.records}, summary["collectives"], found


@pytest.mark.slow
def test_point_to_point_collectives_are_profiled_and_diagnosed(run_ranks):
    algorithms, collectives, found = run_ranks(_p2p_worker, 2)[0]
    assert algorithms == {"p2p"}
    assert sorted(collectives) == ["all_reduce"] and collectives["all_reduce"]["time_s"] > 0
    assert "redundant_collective" in {d["code"] for d in found}, found
