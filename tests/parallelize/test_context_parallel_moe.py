"""Context parallelism with mixture-of-experts (``moe-tiny``): at cp 2, tp 2 × cp 2 and ep 2 × cp 2
(with ``moe_statistics="global"``), the loss and every gradient (gathered to dense) equal one
process running the whole batch, fp32 within 1e-5, with a capacity that drops token-slots — the
capacity queues and the load-balancing loss are taken over the whole rows (the other cp ranks'
chunks interleave with this rank's), :mod:`ops_transformer.layers.moe_context`; and the ledger
shows one ``cp.moe_stats`` all-gather of ``b·2·E + E`` elements per MoE layer and forward."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import rel_err
from ops_transformer import CommLedger, GPT, init_parallel, parallelize
from ops_transformer.models.gpt import preset
from ops_transformer.models.moe import moe_stats
from test_context_parallel_compose import dense_grads

B, S = 4, 16


def _batches(steps):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (B, S + 1), generator=g) for _ in range(steps)]


def moe_steps(tp, ep, cp, strategy="ring", statistics="local", capacity=1.0, steps=2):
    """Per step on this rank: ``(loss, dense loss, worst gradient error and its name, dropped
    slots on one process)``, and the first forward's ``cp.moe_stats`` / ``moe_stats`` sizes."""
    torch.set_num_threads(1)
    ctx = init_parallel(tp=tp, ep=ep, cp=cp)
    torch.manual_seed(0)
    dense = GPT(preset("moe-tiny", max_seq_len=32, moe_capacity_factor=capacity))
    model = parallelize(copy.deepcopy(dense), ctx, context_parallel=strategy,
                        moe_statistics=statistics)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(dense.parameters(), lr=0.5)
    rows = B // ctx.dp_ep_size
    out, sizes = [], None
    for batch in _batches(steps):
        _, ref = dense(batch[:, :-1], batch[:, 1:])
        dropped = moe_stats(dense)["dropped"]
        ref.backward()
        mine = batch[ctx.dp_ep_rank * rows:(ctx.dp_ep_rank + 1) * rows]  # every cp rank all
        with CommLedger() as ledger:
            _, loss = model(mine[:, :-1], mine[:, 1:])
        loss.backward()
        if sizes is None:
            sizes = {label: [r.elements for r in ledger.records if r.label == label]
                     for label in ("cp.moe_stats", "moe_stats")}
        grads = dense_grads(model, ctx)
        worst = max((rel_err(grads[n], p.grad), n) for n, p in dense.named_parameters()
                    if p.grad is not None)
        out.append((float(loss.detach()), float(ref.detach()), worst, dropped))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return out, sizes


def _check(results, ranks_per_loss=1):
    """Every step: the losses (averaged over the micro-batches) and the gradients of one
    process, with slots dropped there."""
    steps = len(results[0][0])
    for step in range(steps):
        losses = [r[0][step][0] for r in results]
        ref = results[0][0][step][1]
        mean = sum(losses) / len(losses)
        assert abs(mean - ref) <= 1e-6 * abs(ref), (step, losses, ref)
        for rank, (out, _) in enumerate(results):
            worst = out[step][2]
            assert worst[0] <= 1e-5, f"rank {rank} step {step}: {worst[1]} differs {worst[0]:.2e}"
        assert results[0][0][step][3] > 0  # the capacity dropped slots: the queues matter


@pytest.mark.parametrize("strategy", ["ring", pytest.param("allgather_kv",
                                                            marks=pytest.mark.slow)])
def test_moe_at_cp2_equals_one_process(run_ranks, strategy):
    results = run_ranks(moe_steps, 2, 1, 1, 2, strategy)
    _check(results)
    cfg = preset("moe-tiny")
    e = cfg.n_experts
    assert results[0][1] == {"cp.moe_stats": [2 * (B * 2 * e + e)] * 2, "moe_stats": []}


def test_moe_at_cp2_ep2_global_statistics_equals_one_process(run_ranks):
    """4 ranks: two micro-batches (ep), each split over cp 2; the capacity and the aux loss over
    the global batch (``moe_statistics="global"``)."""
    results = run_ranks(moe_steps, 4, 1, 2, 2, "ring", "global")
    _check(results)
    e = preset("moe-tiny").n_experts
    rows = B // 2
    assert results[0][1] == {"cp.moe_stats": [2 * (rows * 2 * e + e)] * 2,
                             "moe_stats": [2 * (e + 1)] * 2}


@pytest.mark.slow
def test_moe_at_tp2_cp2_and_dropless_equal_one_process(run_ranks):
    _check(run_ranks(moe_steps, 4, 2, 1, 2, "allgather_kv"))
    dropless = run_ranks(moe_steps, 2, 1, 1, 2, "ring", "local", None)
    for out, _ in dropless:
        assert all(worst[0] <= 1e-5 for _, _, worst, _ in out), out


def _train_losses(cfg):
    from ops_transformer.training.loop import join, setup_training

    with join(cfg) as ctx:
        state = setup_training(cfg, ctx)
        return [state.step(*state.batch(step))[0].metrics["loss"] for step in range(cfg.steps)]


@pytest.mark.slow
@pytest.mark.parametrize("zero,dp", [(1, 1), (2, 1), (3, 1), (3, 2)])
def test_zero_with_moe_under_cp_equals_without_cp(run_ranks, zero, dp):
    """``train --preset moe-tiny --ep 2 --cp 2 --zero N`` (global statistics): the experts' state
    sharded (or, at dp 1, kept whole and averaged) over dp × cp, three steps equal to the same run
    without cp and ZeRO (1e-5)."""
    from ops_transformer.training.loop import TrainConfig

    base = dict(preset="moe-tiny", layers=2, batch=8, seq=16, lr=1e-2, progress=False, steps=3,
                ep=2, moe_statistics="global", tp=1, dp=dp)
    ref = run_ranks(_train_losses, 2 * dp, TrainConfig(**base))[0]
    got = run_ranks(_train_losses, 4 * dp, TrainConfig(**base, cp=2, zero=zero))[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-5, (got, ref)
