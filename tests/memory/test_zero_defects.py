"""Three defects of ZeRO-1/2 (and of plain data-parallel averaging), each found by a test case
translated from PyTorch's ``ZeroRedundancyOptimizer`` tests and each failing before its fix:

* a parameter with no gradient in a step (frozen or unused) must keep ``grad = None`` and be
  skipped by the optimizer, as ``torch.optim`` does — not be stepped with a zero gradient;
* ``ZeroOptimizer.load_state_dict`` must keep ``param_groups`` in sync, so that an LR scheduler
  on the wrapper keeps driving the real step after a resume;
* ``consolidate_zero_state`` must accept a rank whose chunk is only padding or only parameters
  that were never stepped (no state on that rank).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import assert_rel
from ops_transformer import GPT, gather_full_state_dict, init_parallel, parallelize
from ops_transformer.memory import zero_optimizer
from ops_transformer.memory.zero_state import consolidate_zero_state
from ops_transformer.models import preset
from ops_transformer.parallel.grad_reduce import GradSync
from ops_transformer.parallel.state import add_grad_reducer

B, T, STEPS = 4, 16, 5
CONFIG = preset("llama-tiny", vocab_size=250, max_seq_len=T, n_layers=1)
ADAMW = {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.1}
FROZEN = "layers.0.attn.wk.weight"  # frozen on every other step


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 250, (B, T + 1), generator=g) for _ in range(STEPS)]


def _frozen_every_other_step(stage):
    """5 AdamW steps with ``FROZEN`` frozen on steps 1 and 3; ``stage`` -1: no data parallelism
    (the reference), 0: plain data-parallel averaging with torch.optim.AdamW, 1/2: ZeRO."""
    ctx = init_parallel(tp=1)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if stage >= 0:
        model = parallelize(model, ctx)
    opt = (zero_optimizer(model, ctx, torch.optim.AdamW, stage=stage, **ADAMW) if stage > 0
           else torch.optim.AdamW(model.parameters(), **ADAMW))
    frozen = dict(model.named_parameters())[FROZEN]
    rows = slice(ctx.dp_rank * B // ctx.dp_size, (ctx.dp_rank + 1) * B // ctx.dp_size)
    grads_none = []
    for step, batch in enumerate(_batches()):
        frozen.requires_grad_(step % 2 == 0)
        model(batch[rows, :-1], batch[rows, 1:])[1].backward()
        grads_none.append(frozen.grad is None)
        opt.step()
        opt.zero_grad()
    frozen.requires_grad_(True)
    return gather_full_state_dict(model, ctx), grads_none


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_parameter_without_a_gradient_is_skipped_like_torch_optim(run_ranks, stage):
    reference, _ = run_ranks(_frozen_every_other_step, 1, -1)[0]
    for state, grads_none in run_ranks(_frozen_every_other_step, 2, stage):
        if stage == 0:  # the averaging leaves a gradient-less parameter's grad None
            assert grads_none == [False, True, False, True, False]
        for key, value in reference.items():
            assert_rel(state[key], value, rtol=1e-6, what=key, floor=0.02)


def _resume_with_schedule(stage):
    """4 steps under a StepLR schedule, uninterrupted, and resumed after 2 from the optimizer's
    and the scheduler's state dicts: the same learning rates reach the real step."""
    ctx = init_parallel(tp=1)
    batches = _batches()

    def build():
        torch.manual_seed(0)
        model = parallelize(GPT(CONFIG), ctx)
        opt = zero_optimizer(model, ctx, torch.optim.AdamW, stage=stage, **ADAMW)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def steps(model, opt, schedule, part):
        rows = slice(ctx.dp_rank * 2, ctx.dp_rank * 2 + 2)
        for batch in part:
            model(batch[rows, :-1], batch[rows, 1:])[1].backward()
            opt.step()
            opt.zero_grad()
            schedule.step()

    model, opt, schedule = build()
    steps(model, opt, schedule, batches[:2])
    saved = ({k: v.clone() for k, v in model.state_dict().items()},
             copy.deepcopy(opt.state_dict()), schedule.state_dict())  # (live tensors)
    steps(model, opt, schedule, batches[2:4])
    again, opt2, schedule2 = build()
    again.load_state_dict(saved[0])
    opt2.load_state_dict(copy.deepcopy(saved[1]))  # torch's loading aliases the tensors
    schedule2.load_state_dict(saved[2])
    lrs = [opt2.param_groups[0]["lr"], opt2.inner.param_groups[0]["lr"]]
    steps(again, opt2, schedule2, batches[2:4])
    lrs += [opt2.param_groups[0]["lr"], opt2.inner.param_groups[0]["lr"]]
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  again.state_dict().values()))
    return lrs, opt.param_groups[0]["lr"], same


@pytest.mark.parametrize("stage", [1, 2])
def test_an_lr_schedule_survives_a_resume(run_ranks, stage):
    for lrs, uninterrupted_lr, same in run_ranks(_resume_with_schedule, 2, stage):
        lr = ADAMW["lr"]
        assert lrs == [lr / 4, lr / 4, lr / 16, lr / 16] and uninterrupted_lr == lr / 16
        assert same


class _Tiny(nn.Module):
    """One bucket of 3 elements: at dp 4 each rank's chunk holds 1 element and the last rank's
    is only padding. ``c`` is frozen: at dp 2 rank 1's chunk holds only ``c``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor([1.0]))
        self.b = nn.Parameter(torch.tensor([2.0]))
        self.c = nn.Parameter(torch.tensor([3.0]))

    def forward(self, x):
        return (self.a * x + self.b * x * x + self.c * x ** 3).sum()


def _consolidate(freeze_c):
    ctx = init_parallel(tp=1)
    model = _Tiny()
    add_grad_reducer(model, GradSync(model.parameters(), ctx.dp_group))
    opt = zero_optimizer(model, ctx, torch.optim.SGD, stage=1, lr=0.1, momentum=0.9)
    model.c.requires_grad_(not freeze_c)
    for _ in range(2):
        model(torch.tensor([0.5 + ctx.dp_rank])).backward()
        opt.step()
        opt.zero_grad()
    return opt.state_dict()


def _unsharded_momentum(dp, freeze_c):
    model = _Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.c.requires_grad_(not freeze_c)
    for _ in range(2):
        sum(model(torch.tensor([0.5 + r])) / dp for r in range(dp)).backward()
        opt.step()
        opt.zero_grad()
    return {n: opt.state[p]["momentum_buffer"] for n, p in model.named_parameters()
            if p in opt.state}


@pytest.mark.parametrize("dp,freeze_c", [(4, False), (2, True)])
def test_consolidate_with_a_rank_that_holds_no_state(run_ranks, dp, freeze_c):
    full = consolidate_zero_state(run_ranks(_consolidate, dp, freeze_c))
    expected = _unsharded_momentum(dp, freeze_c)
    assert set(full["params"]) == set(expected)  # a frozen parameter has no state
    for name, momentum in expected.items():
        assert_rel(full["params"][name]["momentum_buffer"], momentum, rtol=1e-6, what=name)
