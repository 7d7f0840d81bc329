"""MoE statistics over the global batch (issue 33; ``moe_statistics="global"``,
:mod:`ops_transformer.layers.moe_stats`): at dp 2, ep 2 and ep 2 × tp 2, with and without a
capacity, three SGD steps equal one process running the whole batch (losses averaged over the
ranks, gathered weights); the default per-rank statistics differ from it (what the option is
for); one all-gather of ``E + 1`` counts per MoE layer and forward."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rel
from ops_transformer import GPT, CommLedger, gather_full_state_dict, init_parallel, parallelize
from ops_transformer.models import preset
from test_moe import B, T, _batches, moe_model


def _train(tp, ep, dp, capacity, statistics):
    ctx, model, _ = moe_model(tp, ep, dp, capacity, moe_statistics=statistics)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rows = B // ctx.dp_ep_size
    losses, calls = [], None
    for batch in _batches():
        batch = batch[ctx.dp_ep_rank * rows:(ctx.dp_ep_rank + 1) * rows]
        with CommLedger() as ledger:
            loss = model(batch[:, :-1], batch[:, 1:])[1]
        calls = [r.elements for r in ledger.records if r.label == "moe_stats"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, gather_full_state_dict(model, ctx), calls


def _compare(run_ranks, tp, ep, dp, capacity, statistics):
    ref_losses, ref_state, _ = run_ranks(_train, 1, 1, 1, 1, capacity, statistics)[0]
    runs = run_ranks(_train, tp * ep * dp, tp, ep, dp, capacity, statistics)
    losses = torch.tensor([r[0] for r in runs]).mean(0)  # each micro-batch's loss, averaged
    state = runs[0][1]
    worst = max(float((state[k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
                for k, v in ref_state.items())
    return losses, torch.tensor(ref_losses), state, ref_state, worst, runs[0][2]


@pytest.mark.parametrize("tp,ep,dp,capacity", [
    (1, 2, 1, None),
    (1, 1, 2, 1.0),
    pytest.param(1, 2, 1, 1.0, marks=pytest.mark.slow),
    pytest.param(2, 2, 1, 1.0, marks=pytest.mark.slow),
    pytest.param(1, 2, 2, None, marks=pytest.mark.slow),
])
def test_global_statistics_equal_one_process(run_ranks, tp, ep, dp, capacity):
    losses, ref_losses, state, ref_state, _, calls = _compare(run_ranks, tp, ep, dp, capacity,
                                                              "global")
    assert_rel(losses, ref_losses, what="losses")
    assert list(state) == list(ref_state)
    for key, value in ref_state.items():
        assert_rel(state[key], value, what=key)
    n_experts = preset("moe-tiny").n_experts
    assert calls == [(n_experts + 1) * ep * dp] * 2  # moe-tiny's 2 MoE layers: one gather each


def test_local_statistics_differ_from_one_process(run_ranks):
    """Per-rank statistics (the default, Megatron's): capacity and aux loss of each rank's rows."""
    *_, worst, calls = _compare(run_ranks, 1, 2, 1, 1.0, "local")
    assert worst > 1e-5 and calls == []


def _sp_train(tp, sequence_parallel, overlap="none"):
    ctx = init_parallel(tp=tp)
    cfg = preset("moe-tiny", max_seq_len=T, moe_capacity_factor=1.0)
    torch.manual_seed(0)
    model = parallelize(GPT(cfg), ctx, sequence_parallel=sequence_parallel, overlap=overlap,
                        attention="heads")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in _batches():
        loss = model(batch[:, :-1], batch[:, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, gather_full_state_dict(model, ctx)


@pytest.mark.parametrize("sequence_parallel,overlap", [(True, "none"), ("regather", "chunked")])
def test_moe_under_sequence_parallelism_equals_tp1(run_ranks, sequence_parallel, overlap):
    """Issue 33: MoE × SP used to be refused; the MoE layer now runs on the gathered sequence
    (router, capacity and experts as without SP) and its output is cut back to this rank's share."""
    ref_losses, ref_state = run_ranks(_sp_train, 1, 1, False)[0]
    losses, state = run_ranks(_sp_train, 2, 2, sequence_parallel, overlap)[0]
    assert_rel(torch.tensor(losses), torch.tensor(ref_losses), what="losses")
    for key, value in ref_state.items():
        assert_rel(state[key], value, what=key)
