"""Checkpoints of FSDP2-sharded models (ZeRO-3, ``shard_parameters``): parameters and optimizer state
in the same dense coordinates as every other checkpoint, so a ZeRO-3 checkpoint saved at
dp 2 × tp 2 loads at tp 2 without sharding, at tp 1 (the unparallelised model), under ZeRO-1/2,
and back into ZeRO-3 — each continuing training as the saving run did."""

from __future__ import annotations

import pytest
import torch

import ops_transformer as ot
from ops_transformer.memory.zero import zero_optimizer
from ops_transformer.parallelize.gpt_plan import gpt_plan

from helpers import assert_rel
from test_checkpoint import CFG, _eval_loss, _train


def _job(tp, dp, *, seed, zero):
    ctx = ot.init_parallel(tp=tp, dp=dp)
    torch.manual_seed(seed)
    model = ot.GPT(CFG)
    if ctx.world_size > 1:
        model = ot.parallelize(model, ctx, gpt_plan(CFG, tp, "heads", vocab="parallel"))
    kwargs = dict(lr=1e-2, weight_decay=0.1, eps=1e-3)  # eps: see test_gpt_parallel._optimizer
    if zero == 3:
        ot.shard_parameters(model, ctx)
    if zero in (1, 2):
        return ctx, model, zero_optimizer(model, ctx, torch.optim.AdamW, stage=zero, **kwargs)
    return ctx, model, torch.optim.AdamW(model.parameters(), **kwargs)


def _save(root, tp, dp, zero):
    ctx, model, opt = _job(tp, dp, seed=0, zero=zero)
    _train(ctx, model, opt, range(2))
    ot.save_checkpoint(root, model, opt, ctx, 2)
    before = _eval_loss(model)
    _train(ctx, model, opt, range(2, 4))
    return before, _eval_loss(model), ot.gather_full_state_dict(model, ctx)


def _load(root, tp, dp, zero):
    ctx, model, opt = _job(tp, dp, seed=1, zero=zero)
    info = ot.load_checkpoint(root, model, opt, ctx)
    before = _eval_loss(model)
    _train(ctx, model, opt, range(2, 4))
    return before, _eval_loss(model), ot.gather_full_state_dict(model, ctx), info


def _assert_continues(saved, loaded, exact=False):
    before, trained, state = saved
    got_before, got_trained, got_state, info = loaded
    assert_rel(got_before, before, 1e-6, "loss of the loaded model")
    assert_rel(got_trained, trained, 1e-5, "loss after two more steps")
    for key, value in state.items():
        assert_rel(got_state[key], value, 1e-5, key, floor=0.02)
    if exact:
        assert all(torch.equal(got_state[k], v) for k, v in state.items())


@pytest.mark.parametrize("loaded", [
    (2, 1, 0),  # tp 2, no sharding
    (1, 1, 0),  # the unparallelised model
    pytest.param((2, 2, 3), marks=pytest.mark.slow),  # the same layout: bit for bit
    pytest.param((1, 2, 1), marks=pytest.mark.slow),  # ZeRO-1 at dp 2
    pytest.param((2, 2, 2), marks=pytest.mark.slow),  # ZeRO-2 at dp 2 × tp 2
    pytest.param((1, 4, 3), marks=pytest.mark.slow),  # ZeRO-3 at dp 4
], ids=lambda v: f"tp{v[0]}-dp{v[1]}-zero{v[2]}")
def test_zero3_checkpoint_at_dp2_tp2_loads_at_another_layout(run_ranks, tmp_path, loaded):
    saved = run_ranks(_save, 4, tmp_path, 2, 2, 3)[0]
    got = run_ranks(_load, loaded[0] * loaded[1], tmp_path, *loaded)[0]
    _assert_continues(saved, got, exact=loaded == (2, 2, 3))
    assert got[3]["resharded"] == (loaded[:2] != (2, 2))


@pytest.mark.parametrize("saved", [
    (1, 1, 0),  # the unparallelised model → ZeRO-3 at dp 2 × tp 2
    pytest.param((2, 2, 1), marks=pytest.mark.slow),  # ZeRO-1 at dp 2 × tp 2 → ZeRO-3
], ids=lambda v: f"tp{v[0]}-dp{v[1]}-zero{v[2]}")
def test_a_checkpoint_loads_into_zero3(run_ranks, tmp_path, saved):
    reference = run_ranks(_save, saved[0] * saved[1], tmp_path, *saved)[0]
    _assert_continues(reference, run_ranks(_load, 4, tmp_path, 2, 2, 3)[0])
