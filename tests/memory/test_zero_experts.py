"""ZeRO with experts over ``ep``: each parameter's state (ZeRO-1/2) or the parameter itself (ZeRO-3,
``shard_parameters``) sharded over its own data-parallel group — ``dp × ep`` for the dense
parameters, ``dp`` for the experts — equals the unsharded AdamW on the single-device MoE fed the
same micro-batches (5 steps at dp 2 × ep 2)."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import (GPT, CommLedger, gather_full_state_dict, init_parallel, parallelize,
                             shard_parameters, zero_optimizer)
from ops_transformer.models import preset
from ops_transformer.precision import optimizer_step

B, T, STEPS = 8, 16, 5
CONFIG = preset("moe-tiny", max_seq_len=T, moe_capacity_factor=None)  # dropless
ADAMW = {"lr": 1e-3, "eps": 1e-3, "weight_decay": 0.1}  # eps: see test_gpt_parallel._optimizer


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (B, T + 1), generator=g) for _ in range(STEPS)]


def _train(zero, dp=2, ep=2, clip=None):
    """5 AdamW steps; ``zero`` -1: the single-device MoE fed the dp × ep micro-batches (gradients
    averaged), 0: dp × ep without ZeRO, 1/2: ZeRO, 3: shard_parameters."""
    parallel = int(os.environ["WORLD_SIZE"]) > 1
    ctx = init_parallel(ep=ep, dp=dp) if parallel else init_parallel()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if parallel:
        model = parallelize(model, ctx)
        if zero == 3:
            shard_parameters(model, ctx)
    opt = (zero_optimizer(model, ctx, torch.optim.AdamW, stage=zero, **ADAMW) if zero in (1, 2)
           else torch.optim.AdamW(model.parameters(), **ADAMW))
    micro = dp * ep
    with CommLedger() as ledger:
        for batch in _batches():
            chunks = batch.chunk(micro)
            for rows in [chunks[ctx.dp_ep_rank]] if parallel else chunks:
                loss = model(rows[:, :-1], rows[:, 1:])[1]
                (loss if parallel else loss / micro).backward()
            if parallel:
                optimizer_step(model, opt, ctx, max_norm=clip)
            else:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
            opt.zero_grad()
    groups = {r.label: r.group_size for r in ledger.records}
    return gather_full_state_dict(model, ctx), groups


@pytest.mark.parametrize("zero", [1, 3, pytest.param(2, marks=pytest.mark.slow)])
def test_zero_with_experts_over_ep_equals_the_unsharded_optimizer(run_ranks, zero):
    reference, _ = run_ranks(_train, 1, -1)[0]
    for state, groups in run_ranks(_train, 4, zero):
        assert list(state) == list(reference)
        for key, value in reference.items():
            assert_rel(state[key], value, rtol=1e-5, what=key, floor=0.02)
        if zero == 3:  # dense over dp × ep (4 ranks), experts over dp (2)
            assert groups["fsdp_params"] in (2, 4) and "dp_grads" not in groups
        else:
            assert "zero_params" in groups


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_clipping_with_experts_and_zero(run_ranks, zero):
    reference, _ = run_ranks(_train, 1, -1, clip=0.05)[0]
    for state, _ in run_ranks(_train, 4, zero, clip=0.05):
        for key, value in reference.items():
            assert_rel(state[key], value, rtol=1e-5, what=key, floor=0.02)
