"""ZeRO 1 and 2 over dp, tensor-parallel aware: training equals the unsharded optimizer, each rank
holds ≈1/dp of its state, stage 2 reduce-scatters instead of all-reducing, state dicts restore."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import GPT, CommLedger, gather_full_state_dict, init_parallel, parallelize
from ops_transformer.memory import zero_optimizer
from ops_transformer.models import preset

B, T, STEPS = 4, 16, 5
CONFIG = preset("llama-tiny", vocab_size=250, max_seq_len=T)
ADAMW = {"lr": 1e-3, "eps": 1e-3, "weight_decay": 0.1}  # eps: see test_gpt_parallel._optimizer


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 250, (B, T + 1), generator=g) for _ in range(STEPS)]


def _train(tp, stage, sp=False):
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if int(os.environ["WORLD_SIZE"]) > 1:
        model = parallelize(model, ctx, attention="heads", sequence_parallel=sp)
    if stage:
        opt = zero_optimizer(model, ctx, torch.optim.AdamW, stage=stage, **ADAMW)
    else:
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    rows = slice(ctx.dp_rank * B // ctx.dp_size, (ctx.dp_rank + 1) * B // ctx.dp_size)
    with CommLedger() as ledger:
        for batch in _batches():
            model(batch[rows, :-1], batch[rows, 1:])[1].backward()
            opt.step()
            opt.zero_grad()
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values()
                      for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    # AdamW keeps two moments per element of this rank's (tensor-parallel) parameters
    unsharded = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    dp_ranks = tuple(r for r in range(ctx.world_size) if r % ctx.tp_size == ctx.tp_rank)
    return (gather_full_state_dict(model, ctx), state_bytes / unsharded,
            ledger.by_group().get(dp_ranks, {}))


@pytest.mark.parametrize("nprocs,tp,stage,sp", [
    (2, 1, 2, False),
    pytest.param(4, 2, 1, True, marks=pytest.mark.slow),
    pytest.param(2, 1, 1, False, marks=pytest.mark.slow),
    pytest.param(4, 2, 2, False, marks=pytest.mark.slow),
    pytest.param(4, 2, 2, True, marks=pytest.mark.slow),
])
def test_zero_equals_the_unsharded_optimizer(run_ranks, nprocs, tp, stage, sp):
    reference, share, _ = run_ranks(_train, 1, 1, 0)[0]
    assert share == 1.0
    dp = nprocs // tp
    for state, share, dp_comm in run_ranks(_train, nprocs, tp, stage, sp):
        for key, value in reference.items():
            assert_rel(state[key], value, rtol=1e-6, what=key, floor=0.02)
        assert abs(share * dp - 1) < 1e-3  # 1/dp, up to the padding of each bucket to dp
        assert dp_comm["all_gather"]["calls"] >= STEPS  # updated chunks, every step
        if stage == 2:  # gradients reduce-scattered, never all-reduced (norms' sums under SP aside)
            assert dp_comm["reduce_scatter"]["calls"] >= STEPS
            assert "all_reduce" not in dp_comm or sp


def _steps(model, opt, ctx, batches):
    rows = slice(ctx.dp_rank * B // ctx.dp_size, (ctx.dp_rank + 1) * B // ctx.dp_size)
    for batch in batches:
        model(batch[rows, :-1], batch[rows, 1:])[1].backward()
        opt.step()
        opt.zero_grad()


def _resume(stage):
    """Save after 2 steps, continue 2; a fresh model + optimizer loading the save continues the
    same 2 steps to the same weights, bit for bit."""
    ctx = init_parallel(tp=1)
    batches = _batches()

    def build():
        torch.manual_seed(0)
        model = parallelize(GPT(CONFIG), ctx)
        return model, zero_optimizer(model, ctx, torch.optim.AdamW, stage=stage, **ADAMW)

    model, opt = build()
    _steps(model, opt, ctx, batches[:2])
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # like torch's, it refers to the live state
    _steps(model, opt, ctx, batches[2:4])
    again, opt2 = build()
    again.load_state_dict(saved_model)
    opt2.load_state_dict(copy.deepcopy(saved_opt))  # torch's loading aliases the tensors
    _steps(again, opt2, ctx, batches[2:4])
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  again.state_dict().values()))
    return same, saved_opt


def _unsharded_state(names):
    ctx = init_parallel(tp=1)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    _steps(model, opt, ctx, _batches()[:2])
    by_name = {id(p): n for n, p in model.named_parameters()}
    return {by_name[id(p)]: s for p, s in opt.state.items()}


@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_state_dict_restores_exactly_and_reshards(run_ranks, stage):
    from ops_transformer.memory.zero_state import consolidate_zero_state, shard_zero_state

    results = run_ranks(_resume, 2, stage)
    assert all(same for same, _ in results)
    shards = [sd for _, sd in results]
    assert shards[0]["zero"]["dp_size"] == 2 and [s["zero"]["dp_rank"] for s in shards] == [0, 1]
    full = consolidate_zero_state(shards)
    # the consolidated per-parameter state is the unsharded AdamW's after the same steps
    reference = run_ranks(_unsharded_state, 1, None)[0]
    assert set(full["params"]) == set(reference)
    for name, state in reference.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_rel(full["params"][name][key], state[key], rtol=1e-6, what=f"{name} {key}",
                       floor=1e-6)
    # cut anew for the same layout: the saved shards again
    for shard in shards:
        again = shard_zero_state(full, shard["zero"])
        for index, chunk in shard["state"].items():
            assert all(torch.equal(chunk[k], again["state"][index][k]) for k in chunk)
    # and for one rank (dp 1): every parameter whole, one piece each
    buckets = shards[0]["zero"]["buckets"]
    one = {**shards[0]["zero"], "dp_size": 1, "dp_rank": 0, "buckets": [
        {**b, "padded_numel": b["numel"], "shard_offset": 0, "shard_numel": b["numel"],
         "group_size": 1, "group_rank": 0} for b in buckets],
        "pieces": [{"bucket": i, "name": p["name"], "start": 0, "stop": p["numel"]}
                   for i, b in enumerate(buckets) for p in b["params"]]}
    single = shard_zero_state(full, one)
    assert len(single["state"]) == len(one["pieces"])
    for j, piece in enumerate(one["pieces"]):
        assert torch.equal(single["state"][j]["exp_avg"].view(reference[piece["name"]][
            "exp_avg"].shape), full["params"][piece["name"]]["exp_avg"])


def _accumulate(stage, micro):
    from ops_transformer import no_sync

    ctx = init_parallel(tp=1)
    torch.manual_seed(0)
    model = parallelize(GPT(CONFIG), ctx)
    opt = zero_optimizer(model, ctx, torch.optim.SGD, stage=stage, lr=0.1)
    rows = _batches()[0][ctx.dp_rank * 2:(ctx.dp_rank + 1) * 2]
    for i, part in enumerate(rows.chunk(micro)):
        loss = model(part[:, :-1], part[:, 1:])[1] / micro
        if i < micro - 1:
            with no_sync(model):
                loss.backward()
        else:
            loss.backward()
    opt.step()
    return gather_full_state_dict(model, ctx)


@pytest.mark.slow
def test_stage2_gradient_accumulation_with_no_sync(run_ranks):
    once = run_ranks(_accumulate, 2, 2, 1)
    twice = run_ranks(_accumulate, 2, 2, 2)
    for key, value in once[0].items():
        assert_rel(twice[0][key], value, what=key, floor=0.02)


def test_zero_needs_a_parallelized_model_at_dp_above_one(run_ranks):
    def build():
        ctx = init_parallel(tp=1)
        zero_optimizer(GPT(CONFIG), ctx, torch.optim.AdamW, stage=1)

    with pytest.raises(ValueError, match="parallelize"):
        run_ranks(build, 2)
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        zero_optimizer(GPT(CONFIG), init_parallel(tp=1), torch.optim.AdamW, stage=3)


def _train_clipped(tp, stage, sp=False):
    """5 AdamW steps through optimizer_step with a loss scaler and clipping to a norm below the
    gradients' (every step clips)."""
    from ops_transformer.precision import DynamicLossScaler, optimizer_step

    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if ctx.world_size > 1:
        model = parallelize(model, ctx, attention="heads", sequence_parallel=sp)
    opt = zero_optimizer(model, ctx, torch.optim.AdamW, stage=stage, **ADAMW) if stage else \
        torch.optim.AdamW(model.parameters(), **ADAMW)
    scaler = DynamicLossScaler(ctx, init_scale=2.0 ** 10)
    rows = slice(ctx.dp_rank * B // ctx.dp_size, (ctx.dp_rank + 1) * B // ctx.dp_size)
    norms = []
    for batch in _batches():
        loss = model(batch[rows, :-1], batch[rows, 1:])[1]
        scaler.scale(loss).backward()
        report = optimizer_step(model, opt, ctx, scaler=scaler, max_norm=0.05)
        assert report.stepped
        norms.append(report.grad_norm)
        opt.zero_grad()
    return gather_full_state_dict(model, ctx), norms


@pytest.mark.parametrize("nprocs,tp,stage,sp", [
    (2, 1, 2, False),
    pytest.param(2, 1, 1, False, marks=pytest.mark.slow),
    pytest.param(4, 2, 2, True, marks=pytest.mark.slow),
    pytest.param(4, 2, 1, True, marks=pytest.mark.slow),
])
def test_clipping_and_loss_scaling_on_the_shards_equal_the_unsharded_run(run_ranks, nprocs, tp,
                                                                        stage, sp):
    reference, ref_norms = run_ranks(_train_clipped, 1, 1, 0)[0]
    assert min(ref_norms) > 0.05  # every step clipped
    for state, norms in run_ranks(_train_clipped, nprocs, tp, stage, sp):
        assert_rel(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, what="grad norms")
        for key, value in reference.items():
            assert_rel(state[key], value, rtol=1e-5, what=key, floor=0.02)
