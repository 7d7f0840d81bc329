"""The data-parallel section of ``ParallelOptions`` (issue 33, item 4): ``parallelize(model, ctx,
data_parallel={"zero": N})`` lays out ZeRO 1/2/3 inside the one ordered preparation and builds the
gradient reducers once, in that layout's form. At dp 2 × tp 2 it trains exactly like the dense
model on one process (losses and weights after 3 AdamW steps, 1e-5) and like the earlier calls
(``ot.zero_optimizer`` / ``ot.shard_parameters`` after ``parallelize``), with the same chain and
the same collectives in the ledger; a bad section is refused in one line."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rel
from ops_transformer import (GPT, CommLedger, ParallelOptions, gather_full_state_dict,
                             init_parallel, parallelize, shard_parameters, zero_optimizer)
from ops_transformer.models import preset

B, T, STEPS = 4, 16, 3
CONFIG = preset("llama-tiny", vocab_size=64, max_seq_len=T, n_layers=2)
ADAMW = {"lr": 1e-3, "eps": 1e-3, "weight_decay": 0.1}


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, CONFIG.vocab_size, (B, T + 1), generator=g) for _ in range(STEPS)]


def _train(tp, zero, how, sp=False):
    """3 AdamW steps; ``how``: ``"section"`` (``data_parallel={"zero": zero}``), ``"calls"`` (the
    earlier calls after ``parallelize``) or ``"dense"`` (one process). Returns the losses, the
    gathered weights, the reducer chain and the ledger's records of the steps."""
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if how != "dense":
        section = {"zero": zero} if how == "section" else {}
        model = parallelize(model, ctx, attention="heads", sequence_parallel=sp,
                            data_parallel=section)
        if how == "calls" and zero == 3:
            shard_parameters(model, ctx)
    if how != "dense" and zero in (1, 2):
        opt = zero_optimizer(model, ctx, torch.optim.AdamW, stage=zero if how == "calls" else None,
                             **ADAMW)
    else:
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    rows = slice(ctx.dp_rank * B // ctx.dp_size, (ctx.dp_rank + 1) * B // ctx.dp_size)
    losses = []
    with CommLedger() as ledger:
        for batch in _batches():
            loss = model(batch[rows, :-1], batch[rows, 1:])[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().reshape(1))
    losses = torch.cat(losses)
    if how != "dense":  # the global batch's loss: the mean over the data-parallel ranks
        from ops_transformer.comm import collectives as C
        C.all_reduce(losses, ctx.dp_group, label="test")
        losses /= ctx.dp_size
    chain = [(r.name, type(r).__name__) for r in model.parallel_state.reducers] \
        if how != "dense" else []
    records = sorted((r.kind, r.label, r.group_ranks, r.elements) for r in ledger.records)
    return losses, gather_full_state_dict(model, ctx), chain, records


CHAINS = {1: [("dp", "GradSync"), ("partial_sums", "GradSums")],
          2: [("dp", "ReduceScatterGradSync"), ("dp_partial", "GradSync"),
              ("partial_sums", "GradSums")],
          # ZeRO-3: FSDP2 shards the SP norms too (their TP sums in its all-reduce hooks)
          3: [("fsdp", "FSDPGradSync")]}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_section_equals_dense_and_the_earlier_calls(run_ranks, zero):
    dense_losses, dense_state, _, _ = run_ranks(_train, 1, 1, zero, "dense")[0]
    section = run_ranks(_train, 4, 2, zero, "section", sp=True)
    calls = run_ranks(_train, 4, 2, zero, "calls", sp=True)
    for (losses, state, chain, records), (_, state2, chain2, records2) in zip(section, calls):
        assert_rel(losses, dense_losses, rtol=1e-5, what=f"zero {zero} losses")
        for key, value in dense_state.items():
            assert_rel(state[key], value, rtol=1e-5, what=key, floor=0.02)
            assert torch.equal(state[key], state2[key]), key  # the same arithmetic
        assert chain == chain2 == CHAINS[zero]
        assert records == records2  # the same collectives, counts and sizes
        labels = {r[1] for r in records}
        assert ("zero_grads" in labels) == (zero == 2)
        assert ("fsdp_params" in labels) == (zero == 3)
        assert ("zero_params" in labels) == (zero in (1, 2))


def test_bad_sections_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"data_parallel: zero must be one of \(0, 1, 2, 3\), "
                                         r"got 4"):
        ParallelOptions(data_parallel={"zero": 4})
    with pytest.raises(ValueError, match=r"data_parallel: unknown key\(s\) \['stage'\]"):
        ParallelOptions(data_parallel={"stage": 2})
    with pytest.raises(ValueError, match="reshard_after_forward and mixed_precision apply to "
                                         "zero=3"):
        ParallelOptions(data_parallel={"zero": 2, "reshard_after_forward": False})
    with pytest.raises(ValueError, match="data_parallel must be a DataParallelOptions"):
        ParallelOptions(data_parallel=3)
    assert ParallelOptions(data_parallel={"zero": 3}).data_parallel.zero == 3


def _misuse(case):
    ctx = init_parallel(tp=1, dp=2)
    torch.manual_seed(0)
    zero = {"plain_optimizer": 2, "stage": 1, "shard": 2, "twice": 1}[case]
    model = parallelize(GPT(CONFIG), ctx, data_parallel={"zero": zero})
    batch = _batches()[0][ctx.dp_rank * 2:(ctx.dp_rank + 1) * 2]
    with pytest.raises((RuntimeError, ValueError)) as err:
        if case == "plain_optimizer":
            torch.optim.AdamW(model.parameters())
            model(batch[:, :-1], batch[:, 1:])[1].backward()
        elif case == "stage":
            zero_optimizer(model, ctx, torch.optim.AdamW, stage=2)
        elif case == "shard":
            shard_parameters(model, ctx)
        else:
            zero_optimizer(model, ctx, torch.optim.AdamW)
            zero_optimizer(model, ctx, torch.optim.AdamW)
    return str(err.value)


@pytest.mark.parametrize("case,start", [
    ("plain_optimizer", "data_parallel zero=2 reduce-scatters the gradients into ZeRO buckets"),
    ("stage", "zero_optimizer: stage=2, but parallelize laid out ZeRO stage 1"),
    ("shard", "shard_parameters: a ZeRO optimizer already holds"),
    ("twice", "zero_optimizer: this model's parameters belong to a ZeRO optimizer already"),
])
def test_misuse_after_the_section_is_refused_in_one_line(run_ranks, case, start):
    for message in run_ranks(_misuse, 2, case):
        assert message.startswith(start) and "\n" not in message, message


def _zero3_at_dp1():
    ctx = init_parallel(tp=2)
    with pytest.raises(ValueError) as err:
        parallelize(GPT(CONFIG), ctx, data_parallel={"zero": 3})
    return str(err.value)


def test_zero3_needs_data_parallel_ranks(run_ranks):
    message = run_ranks(_zero3_at_dp1, 2)[0]
    assert message.startswith("data_parallel zero=3 shards over the data-parallel ranks, but dp "
                              "(1) × ep (1) is 1"), message


MOE = preset("moe-tiny", max_seq_len=T, moe_capacity_factor=None)  # dropless


def _train_moe(zero, how, dp, ep):
    """2 AdamW steps of the MoE preset at dp × ep, the section or the earlier calls: the gathered
    weights and the collectives."""
    ctx = init_parallel(ep=ep, dp=dp)
    torch.manual_seed(0)
    model = parallelize(GPT(MOE), ctx, data_parallel={"zero": zero} if how == "section" else {})
    if how == "calls" and zero == 3:
        shard_parameters(model, ctx)
    opt = (zero_optimizer(model, ctx, torch.optim.AdamW, stage=zero, **ADAMW) if zero in (1, 2)
           else torch.optim.AdamW(model.parameters(), **ADAMW))
    g = torch.Generator().manual_seed(0)
    with CommLedger() as ledger:
        for _ in range(2):
            rows = torch.randint(0, MOE.vocab_size, (8, T + 1), generator=g).chunk(dp * ep)
            rows = rows[ctx.dp_ep_rank]
            model(rows[:, :-1], rows[:, 1:])[1].backward()
            opt.step()
            opt.zero_grad()
    records = sorted((r.kind, r.label, r.group_ranks, r.elements) for r in ledger.records)
    return gather_full_state_dict(model, ctx), records


@pytest.mark.parametrize("zero,dp,ep", [(3, 2, 2), (3, 1, 2),
                                        pytest.param(2, 2, 2, marks=pytest.mark.slow)])
def test_section_with_experts_equals_the_earlier_calls(run_ranks, zero, dp, ep):
    """Experts over ``dp``, the dense parameters over ``dp × ep`` (at dp 1 the experts stay whole,
    their gradients scaled by ``1/ep`` in the chain); exactness against one process for these
    layouts: tests/memory/test_zero_experts.py."""
    section = run_ranks(_train_moe, dp * ep, zero, "section", dp, ep)
    calls = run_ranks(_train_moe, dp * ep, zero, "calls", dp, ep)
    for (state, records), (state2, records2) in zip(section, calls):
        assert records == records2
        for key in state2:
            assert torch.equal(state[key], state2[key]), key
