"""DynamicLossScaler: Megatron-Core's hysteresis / growth schedule, exactly; an overflow on one rank
skips the step on every rank (tp 2, dp 2 × tp 2) with one all-reduce of one element; state_dict."""

from __future__ import annotations


import pytest
import torch

from ops_transformer import (GPT, CommLedger, DynamicLossScaler, clip_grad_norm_, init_parallel,
                             parallelize)
from ops_transformer.models import preset
from ops_transformer.parallel import ParallelContext

INF = float("inf")


def _one_param_step(scaler, grad_value):
    """A step of a one-parameter SGD whose gradient is ``grad_value × scale``; returns
    (stepped, the parameter after)."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    w.grad = torch.full((3,), grad_value) * scaler.scale_value
    stepped = scaler.step(opt)
    scaler.update()
    return stepped, w.detach()


def test_hysteresis_backoff_and_growth_follow_megatron():
    scaler = DynamicLossScaler(ParallelContext.single(), init_scale=2.0 ** 16, growth_interval=3,
                               hysteresis=2)
    # (gradient, stepped, scale after update)
    schedule = [
        (INF, False, 2.0 ** 16),   # hysteresis 2 → 1: the scale holds
        (INF, False, 2.0 ** 15),   # 1 → 0: backoff
        (INF, False, 2.0 ** 14),   # still exhausted: every overflow backs off until a growth
        (1.0, True, 2.0 ** 14),    # clean steps count towards growth_interval
        (1.0, True, 2.0 ** 14),
        (1.0, True, 2.0 ** 15),    # 3 clean steps: growth, hysteresis reset to 2
        (float("nan"), False, 2.0 ** 15),  # NaN is an overflow too; hysteresis 2 → 1
        (1.0, True, 2.0 ** 15),    # a clean step resets the growth count, not the hysteresis
        (INF, False, 2.0 ** 14),   # 1 → 0: backoff
        (1.0, True, 2.0 ** 14),
    ]
    for i, (grad, stepped, scale) in enumerate(schedule):
        did_step, w = _one_param_step(scaler, grad)
        assert did_step == stepped, f"step {i}"
        assert scaler.scale_value == scale, f"step {i}: scale {scaler.scale_value} != {scale}"
        if not stepped:
            assert torch.equal(w, torch.ones(3)), f"step {i} changed the parameter"
        else:  # the gradient was unscaled before the step: w - lr * 1.0
            assert torch.allclose(w, torch.full((3,), 0.9)), f"step {i}"
    assert scaler.skipped_steps == 5


def test_growth_after_growth_interval_clean_steps():
    scaler = DynamicLossScaler(ParallelContext.single(), init_scale=4.0, growth_interval=5)
    scales = []
    for _ in range(11):
        _one_param_step(scaler, 1.0)
        scales.append(scaler.scale_value)
    assert scales == [4.0] * 4 + [8.0] * 5 + [16.0] * 2


def test_scale_never_drops_below_min_scale():
    scaler = DynamicLossScaler(ParallelContext.single(), init_scale=4.0, hysteresis=1,
                               min_scale=1.5)
    scales = [(_one_param_step(scaler, INF), scaler.scale_value)[1] for _ in range(4)]
    assert scales == [2.0, 1.5, 1.5, 1.5]


def test_state_dict_round_trip():
    a = DynamicLossScaler(ParallelContext.single(), growth_interval=4, hysteresis=3)
    for grad in (INF, 1.0, 1.0, INF, INF, INF, 1.0):
        _one_param_step(a, grad)
    state = a.state_dict()
    # 2 clean steps do not reset the hysteresis; the 2nd and 3rd overflow in a row back off
    assert state == {"scale": 2.0 ** 14, "growth_tracker": 1, "hysteresis_tracker": -1,
                     "skipped_steps": 4}
    b = DynamicLossScaler(ParallelContext.single(), growth_interval=4, hysteresis=3)
    b.load_state_dict(state)
    assert b.state_dict() == state and b.scale_value == a.scale_value
    for grad in (1.0, INF, 1.0, 1.0, 1.0, 1.0):  # both continue identically
        assert _one_param_step(a, grad)[0] == _one_param_step(b, grad)[0]
        assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match=r"missing \['growth_tracker', 'hysteresis_tracker'\]"):
        b.load_state_dict({"scale": 2.0})


def test_unscale_then_clip_then_step():
    scaler = DynamicLossScaler(ParallelContext.single(), init_scale=8.0)
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler.scale((w * torch.tensor([3.0, 4.0])).sum()).backward()
    assert torch.equal(w.grad, torch.tensor([24.0, 32.0]))
    assert scaler.unscale_(opt).item() == 0.0
    assert torch.equal(w.grad, torch.tensor([3.0, 4.0]))  # unscaled once, not again in step
    torch.nn.utils.clip_grad_norm_([w], 1.0)
    assert scaler.step(opt) is True
    scaler.update()
    assert torch.allclose(w.detach(), torch.tensor([-0.6, -0.8]))


@pytest.mark.parametrize("kwargs,needle", [
    ({"init_scale": 0.5}, r"init_scale \(0.5\) must be at least min_scale \(1.0\)"),
    ({"backoff": 1.0}, r"backoff must be in \(0, 1\), got 1.0"),
    ({"growth": 1.0}, "growth must be greater than 1, got 1.0"),
    ({"hysteresis": 0}, "hysteresis must be a positive integer, got 0"),
    ({"growth_interval": 2.5}, "growth_interval must be a positive integer, got 2.5"),
    ({"min_scale": 0}, "min_scale must be positive, got 0"),
])
def test_bad_settings_are_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DynamicLossScaler(ParallelContext.single(), **kwargs)


def test_update_before_step_and_double_unscale_are_errors():
    scaler = DynamicLossScaler(ParallelContext.single())
    with pytest.raises(RuntimeError, match=r"call step\(optimizer\) first"):
        scaler.update()
    w = torch.nn.Parameter(torch.ones(1))
    w.grad = torch.ones(1)
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already called for this step"):
        scaler.unscale_(opt)


# --- every rank skips together ---------------------------------------------------------------------

def _overflow_on_one_rank(tp):
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = parallelize(GPT(preset("tiny", n_layers=1, max_seq_len=8)), ctx, vocab="parallel")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(ctx, init_scale=2.0 ** 10, hysteresis=2)
    batch = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(1))
    rows = batch.chunk(ctx.dp_size)[ctx.dp_rank]
    history = []
    for step in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        scaler.scale(model(rows[:, :-1], rows[:, 1:])[1]).backward()
        if step < 2 and ctx.rank == ctx.world_size - 1:  # one rank, one gradient, one element
            model.layers[0].mlp.w_in.weight.grad[0, 0] = INF
        with CommLedger() as ledger:
            if step == 1:  # unscale, clip, step: the clip's all-reduce carries the flag
                scaler.unscale_(opt)
                clip_grad_norm_(model, 1.0, ctx)
            stepped = scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        records = [(r.kind, r.elements, r.group_ranks, r.label) for r in ledger.records]
        history.append((stepped, unchanged, scaler.scale_value, records))
    return history


@pytest.mark.parametrize("nprocs,tp", [(2, 2), (4, 2)])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(run_ranks, nprocs, tp):
    everyone = tuple(range(nprocs))
    agreement = [("all_reduce", 1, everyone, "found_inf")]  # one element, every rank of the job
    for rank, history in enumerate(run_ranks(_overflow_on_one_rank, nprocs, tp)):
        (s0, same0, scale0, rec0), (s1, same1, scale1, rec1), (s2, same2, scale2, _) = history
        assert (s0, same0, scale0) == (False, True, 2.0 ** 10), f"rank {rank}: hysteresis 2 → 1"
        assert (s1, same1, scale1) == (False, True, 2.0 ** 9), f"rank {rank}: 1 → 0, backoff"
        assert (s2, same2, scale2) == (True, False, 2.0 ** 9), f"rank {rank}: clean step"
        assert rec0 == agreement, f"rank {rank}"
        assert rec1 == [("all_reduce", 2, everyone, "grad_norm")], f"rank {rank}: one call"
