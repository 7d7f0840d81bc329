"""CommLedger: recording, nesting, the element convention of every kind."""

from __future__ import annotations

import torch

from ops_transformer import CommLedger, init_parallel
from ops_transformer.comm import collectives as C
from ops_transformer.comm.ledger import ledger_active, wire_elements


def test_ledger_opens_and_closes():
    assert not ledger_active()
    with CommLedger() as outer:
        assert ledger_active()
        with CommLedger():
            pass
        assert ledger_active()
    assert not ledger_active()
    assert outer.summary() == {} and outer.calls == 0


def test_wire_elements_ring_formulas():
    assert wire_elements("all_reduce", 100, 4) == 150.0  # 2(p-1)/p n
    assert wire_elements("all_gather", 100, 4) == 75.0  # (p-1)/p n
    assert wire_elements("reduce_scatter", 100, 4) == 75.0
    assert wire_elements("all_reduce", 100, 1) == 0.0


def _every_kind():
    ctx = init_parallel(tp=2)
    g, rank = ctx.tp_group, ctx.rank
    x = torch.arange(6, dtype=torch.float32) + rank
    unrecorded = x.clone()
    C.all_reduce(unrecorded, g)  # no ledger open: must not be recorded anywhere
    with CommLedger() as outer:
        C.all_reduce(x, g)  # 6 elements, fp32
        with CommLedger() as inner:
            gathered = torch.empty(12, dtype=torch.float64)
            C.all_gather_into(gathered, torch.ones(6, dtype=torch.float64), g)
            scattered = torch.empty(3)
            C.reduce_scatter_into(scattered, torch.ones(6), g)
        # uneven: rank 0 sends [3 to itself, 1 to rank 1], rank 1 sends [2 to rank 0, 2 to itself]
        received = torch.empty(5 if rank == 0 else 3)
        C.all_to_all_into(received, torch.full((4,), float(rank)), g,
                          output_split_sizes=[3, 2] if rank == 0 else [1, 2],
                          input_split_sizes=[3, 1] if rank == 0 else [2, 2])
        C.broadcast(torch.ones(7, dtype=torch.bfloat16), 0, g)
        if rank == 0:
            C.send(torch.ones(4), 1, g).wait()
        else:
            C.recv(torch.empty(4), 0, g).wait()
    return outer.summary(), inner.summary(), outer.by_dtype(), list(outer.by_group()), \
        x.tolist(), scattered.tolist(), received.tolist()


def test_every_kind_with_the_element_convention(run_ranks):
    (o0, i0, d0, g0, x0, s0, r0), (o1, i1, d1, g1, x1, s1, r1) = run_ranks(_every_kind, 2)
    assert o0["all_reduce"] == {"calls": 1, "elements": 6, "bytes": 24}
    assert o0["all_gather"] == {"calls": 1, "elements": 12, "bytes": 96}  # the gathered output
    assert o0["reduce_scatter"] == {"calls": 1, "elements": 6, "bytes": 24}  # the full input
    assert o0["all_to_all"] == {"calls": 1, "elements": 4, "bytes": 16}  # what this rank sends
    assert o0["broadcast"] == {"calls": 1, "elements": 7, "bytes": 14}
    assert o0["send"]["calls"] == 1 and "recv" not in o0
    assert o1["recv"] == {"calls": 1, "elements": 4, "bytes": 16} and "send" not in o1
    assert set(i0) == {"all_gather", "reduce_scatter"}  # nested ledger sees only its own span
    assert d0["float64"] == {"calls": 1, "bytes": 96} and d0["bfloat16"]["bytes"] == 14
    assert g0 == [(0, 1)]
    assert x0 == x1 == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    assert r0 == [0.0, 0.0, 0.0, 1.0, 1.0] and r1 == [0.0, 1.0, 1.0]
    assert o1["all_to_all"]["elements"] == 4
    assert s0 == s1 == [2.0, 2.0, 2.0]


def _nothing_on_one_rank():
    ctx = init_parallel(tp=1)
    with CommLedger() as ledger:
        x = torch.ones(3)
        C.all_reduce(x, ctx.tp_group)
    return ledger.summary(), x.tolist()


def test_group_of_one_records_nothing(run_ranks):
    assert run_ranks(_nothing_on_one_rank, 1) == [({}, [1.0, 1.0, 1.0])]
