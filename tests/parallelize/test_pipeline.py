"""Pipeline parallelism (``ot.pipeline`` on ``torch.distributed.pipelining``) against the dense
model: the per-step loss and every gradient at pp 2 with each schedule, pp 2 × tp 2 over steps,
tied embeddings across the first and last stage, and the stage-boundary transfers in the ledger."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rel, local_part
from ops_transformer import GPT, CommLedger, init_parallel, parallelize, pipeline
from ops_transformer.models.gpt import GPTConfig
from ops_transformer.parallelize.pipeline_split import SCHEDULES, check_pipeline, stage_rank

RTOL = 1e-6  # fp32: the stages run the dense ops on the same rows, only summed in another order
CFG = GPTConfig(vocab_size=64, n_layers=4, d_model=32, n_heads=4, d_ff=64, max_seq_len=16)
B, T = 8, 8


def _data(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, CFG.vocab_size, (B, T), generator=g),
             torch.randint(0, CFG.vocab_size, (B, T), generator=g)) for _ in range(steps)]


def _dense(cfg, steps, lr=0.5):
    """Per-step loss and the first step's gradients (by name) of the one-device model."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], None
    for idx, y in _data(steps):
        opt.zero_grad()
        loss = model(idx, y)[1]
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
        opt.step()
    return losses, grads


def _piped(cfg, schedule, v, m, tp, steps, dense_grads, lr=0.5, dp=1, **options):
    torch.set_num_threads(1)
    ctx = init_parallel(pp=2, tp=tp, dp=dp)
    torch.manual_seed(0)
    model = GPT(cfg)
    if tp * dp > 1:
        model = parallelize(model, ctx, **options)
    pipe = pipeline(model, ctx, schedule, microbatches=m, stages_per_rank=v)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads, ledger = [], None, None
    for step, (idx, y) in enumerate(_data(steps)):
        opt.zero_grad()
        idx, y = idx.chunk(dp)[ctx.dp_rank], y.chunk(dp)[ctx.dp_rank]  # this replica's rows
        with CommLedger() as led:
            loss = pipe.step(idx, y)
        if loss is not None and dp > 1:  # the dense loss: the mean over the replicas' rows
            loss = torch.tensor(run_mean(loss, ctx))
        if step == 1:
            ledger = [(r.kind, r.elements, r.label) for r in led.records if r.label == "pp_boundary"]
        if grads is None:
            grads = {n: (p.grad.clone(), local_part(p, dense_grads[_dense_name(n, cfg)]))
                     for n, p in model.named_parameters()}
        losses.append(None if loss is None else loss.item())
        opt.step()
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return ctx.pp_rank, losses, grads, ledger, names


def run_mean(loss, ctx):
    from ops_transformer.comm import collectives as C

    total = loss.clone()
    C.all_reduce(total, ctx.dp_group)
    return total.item() / ctx.dp_size


def _dense_name(name, cfg):
    return "tok_emb.weight" if name == "lm_head.weight" and cfg.tie_embeddings else name


def _check(results, dense_losses, dense_grads, cfg):
    seen = set()
    for pp_rank, losses, grads, _, names in results:
        seen |= names
        if losses[0] is not None:
            for got, want in zip(losses, dense_losses):
                assert abs(got - want) <= RTOL * abs(want), (got, want)
        for name, (grad, want) in grads.items():
            assert_rel(grad, want, RTOL, f"pp rank {pp_rank}: {name}")
    dense_names = set(dense_grads) | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert seen == dense_names  # dense names, every parameter on some stage


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_pp2_every_schedule_equals_dense(run_ranks, schedule):
    v = 1 if SCHEDULES[schedule][1] == "one" else 2
    m = 4
    dense_losses, dense_grads = _dense(CFG, 2)
    results = run_ranks(_piped, 2, CFG, schedule, v, m, 1, 2, dense_grads)
    _check(results, dense_losses, dense_grads, CFG)
    # the ledger: 2·m boundary transfers per boundary per step, (b/m)·s·h elements each
    placement = SCHEDULES[schedule][2]
    boundaries = sum(stage_rank(k, 2, placement) != stage_rank(k + 1, 2, placement)
                     for k in range(2 * v - 1))  # neighbours on one rank hand over locally
    sends = [r for res in results for r in res[3] if r[0] == "send"]
    recvs = [r for res in results for r in res[3] if r[0] == "recv"]
    assert len(sends) == len(recvs) == 2 * m * boundaries
    assert {r[1] for r in sends + recvs} == {B // m * T * CFG.d_model}


def test_pp2_tp2_equals_one_device(run_ranks):
    cfg = CFG.with_(tie_embeddings=False, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    dense_losses, dense_grads = _dense(cfg, 3)
    results = run_ranks(_piped, 4, cfg, "1f1b", 1, 2, 2, 3, dense_grads)
    _check(results, dense_losses, dense_grads, cfg)


ROPE = CFG.with_(tie_embeddings=False, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)


@pytest.mark.parametrize("options", [{"sequence_parallel": True},
                                     {"sequence_parallel": "regather"},
                                     {"recompute": "selective"}, {"recompute": "full"},
                                     {"sequence_parallel": True, "recompute": "full"}],
                         ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
def test_pp2_tp2_options_equal_one_device(run_ranks, options):
    """Sequence parallelism and recompute inside each stage of pp 2 × tp 2 (RoPE: a later stage's
    attention spans the whole sequence though it receives 1/tp of it): losses and gradients
    equal one device; under SP each boundary transfer is (b/m)·(s/tp)·h elements."""
    dense_losses, dense_grads = _dense(ROPE, 2)
    results = run_ranks(_piped, 4, ROPE, "1f1b", 1, 2, 2, 2, dense_grads, **options)
    _check(results, dense_losses, dense_grads, ROPE)
    sizes = {r[1] for res in results for r in res[3]}
    tp_split = 2 if options.get("sequence_parallel") else 1
    assert sizes == {B // 2 * T // tp_split * ROPE.d_model}


def test_pp2_dp2_equals_dense(run_ranks):
    """dp inside each stage: parallelize's reducers average the stage's gradients over its dp."""
    dense_losses, dense_grads = _dense(CFG, 2)
    results = run_ranks(_piped, 4, CFG, "1f1b", 1, 2, 1, 2, dense_grads, dp=2)
    _check(results, dense_losses, dense_grads, CFG)


@pytest.mark.slow
def test_pp2_tp2_ten_steps(run_ranks):
    dense_losses, dense_grads = _dense(CFG, 10)
    results = run_ranks(_piped, 4, CFG, "interleaved", 2, 2, 2, 10, dense_grads)
    _check(results, dense_losses, dense_grads, CFG)


def test_tied_embedding_gradient_summed_across_stages(run_ranks):
    """The tied weight lives on stage 0 (embedding) and stage 1 (head): each half's gradient
    alone is not the dense one; after the step both hold the sum."""
    assert CFG.tie_embeddings
    dense_losses, dense_grads = _dense(CFG, 1)
    results = run_ranks(_piped, 2, CFG, "gpipe", 1, 2, 1, 1, dense_grads)
    first = next(r for r in results if r[0] == 0)[2]["tok_emb.weight"][0]
    last = next(r for r in results if r[0] == 1)[2]["lm_head.weight"][0]
    assert_rel(first, dense_grads["tok_emb.weight"], RTOL, "embedding half")
    assert torch.equal(first, last)


@pytest.mark.parametrize("layers, pp, kwargs, match", [
    (4, 3, {}, r"3 stages do not divide the model's 4 layers"),
    (2, 2, {"schedule": "interleaved", "stages_per_rank": 2, "microbatches": 2},
     r"4 stages, more than the model's 2 layers"),
    (4, 2, {"schedule": "1f1b", "stages_per_rank": 2}, r"one stage per rank"),
    (4, 2, {"schedule": "zbv", "stages_per_rank": 1}, r"exactly 2 stages per rank"),
    (4, 2, {"schedule": "pipedream"}, r"schedule must be one of"),
    (4, 2, {"schedule": "1f1b", "microbatches": 1}, r"at least as many microbatches"),
    (4, 2, {"schedule": "interleaved", "stages_per_rank": 2, "microbatches": 3},
     r"multiple of pp \(2\)"),
])
def test_bad_split_is_one_line_error(layers, pp, kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        check_pipeline(layers, pp, **kwargs)
    assert "\n" not in str(err.value)


def _grid():
    ctx = init_parallel(pp=2, tp=2)
    return (ctx.rank, ctx.pp_rank, ctx.pp_size, ctx.tp_rank, ctx.dp_size, ctx.pp_prev_rank,
            ctx.pp_next_rank, ctx.pp_ranks, ctx.pp_group is not None)


def test_pp_is_the_outermost_axis(run_ranks):
    got = run_ranks(_grid, 4)
    # ranks 0, 1 are stage 0 (a TP pair), ranks 2, 3 stage 1; rank r's neighbour is r ± 2
    assert got == [(0, 0, 2, 0, 1, None, 2, (0, 2), True), (1, 0, 2, 1, 1, None, 3, (1, 3), True),
                   (2, 1, 2, 0, 1, 0, None, (0, 2), True), (3, 1, 2, 1, 1, 1, None, (1, 3), True)]


def test_degrees_name_every_factor():
    from ops_transformer.parallel.context import check_degrees

    with pytest.raises(ValueError, match=r"pp \(2\) × dp \(1\) × ep \(1\) × tp \(2\) = 4 must "
                                         r"equal the world size \(8\)"):
        check_degrees(8, 2, 1, 1, pp=2)
    with pytest.raises(ValueError, match=r"not divisible by pp \(3\) × tp \(2\) × ep \(1\) = 6"):
        check_degrees(8, 2, None, 1, pp=3)
    with pytest.raises(ValueError, match=r"pp must be a positive integer, got 0"):
        check_degrees(8, 2, None, 1, pp=0)
    assert check_degrees(8, 2, None, 1, pp=2) == (2, 1, 2)


def _overflow(poison):
    """pp 2 with a loss scaler: a clean step equals the dense gradients once unscaled; an inf
    planted in one stage's gradient skips the step on both stages."""
    from ops_transformer import DynamicLossScaler, optimizer_step

    torch.set_num_threads(1)
    ctx = init_parallel(pp=2)
    torch.manual_seed(0)
    model = GPT(CFG)
    pipe = pipeline(model, ctx, "1f1b", microbatches=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(ctx, init_scale=2.0 ** 8)
    idx, y = _data(1)[0]
    pipe.step(idx, y, scaler=scaler)
    if ctx.pp_rank == poison:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() / 2.0 ** 8 for n, p in model.named_parameters()}
    report = optimizer_step(model, opt, ctx, scaler=scaler, max_norm=1.0)
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    return ctx.pp_rank, report.stepped, unchanged, scaler.scale_value, grads


def test_fp16_overflow_on_one_stage_skips_every_stage(run_ranks):
    for rank, stepped, unchanged, scale, _ in run_ranks(_overflow, 2, 1):
        assert not stepped and unchanged, rank  # (the scale backs off after its hysteresis)
    _, dense_grads = _dense(CFG, 1)
    for rank, stepped, unchanged, _, grads in run_ranks(_overflow, 2, -1):
        assert stepped and not unchanged
        for name, grad in grads.items():  # the scaled backward, unscaled: the dense gradient
            assert_rel(grad, dense_grads[_dense_name(name, CFG)], RTOL, f"rank {rank}: {name}")


@pytest.mark.parametrize("model, match", [
    (torch.nn.Linear(2, 2), r"pipeline splits the reference GPT .* got Linear"),
    ("moe", r"pipeline needs a pp axis of 2 or more stages"),  # MoE splits (test_pipeline_moe)
    ("dense", r"pipeline needs a pp axis of 2 or more stages, but ctx has pp 1"),
])
def test_pipeline_refuses_what_it_cannot_split(model, match):
    from ops_transformer import ParallelContext
    from ops_transformer.models.gpt import preset

    if model == "moe":
        model = GPT(preset("moe-tiny"))
    elif model == "dense":
        model = GPT(CFG)
    with pytest.raises(ValueError, match=match):
        pipeline(model, ParallelContext.single(), "1f1b")


def _adamw_dense(steps, max_norm, lr=1e-3):
    """One process: ``steps`` AdamW steps of the dense model on the whole batch, clipped to
    ``max_norm`` by torch: the losses, the norms before clipping and the parameters after."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    for idx, y in _data(steps):
        opt.zero_grad()
        loss = model(idx, y)[1]
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        losses.append(loss.item())
        opt.step()
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero_run(zero, steps, max_norm, lr=1e-3, schedule="1f1b", v=1):
    """pp 2 × dp 2 (4 ranks), ZeRO ``zero``: ``steps`` AdamW steps with clipping through
    ``optimizer_step``; the losses, the gradient norms and the parameters after, by name."""
    from ops_transformer import optimizer_step, zero_optimizer

    torch.set_num_threads(1)
    ctx = init_parallel(pp=2, dp=2)
    torch.manual_seed(0)
    model = parallelize(GPT(CFG), ctx)
    pipe = pipeline(model, ctx, schedule, microbatches=2, stages_per_rank=v)
    if zero == 3:  # FSDP2 per stage: each stage module a root, pipelining drives its syncs
        from ops_transformer.memory.fsdp import shard_parameters

        shard_parameters(model, ctx)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    else:
        opt = zero_optimizer(model, ctx, torch.optim.AdamW, stage=zero, lr=lr)
    losses, norms = [], []
    for idx, y in _data(steps):
        idx, y = idx.chunk(2)[ctx.dp_rank], y.chunk(2)[ctx.dp_rank]  # this replica's rows
        opt.zero_grad()
        report = optimizer_step(model, opt, ctx, max_norm=max_norm,
                                metrics=pipe.step_metrics(idx, y))
        losses.append(report.metrics["loss"])
        norms.append(report.grad_norm)
    params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    return ctx.pp_rank, losses, norms, params


def _full(param):
    """A ZeRO-3 (FSDP2) shard gathered over dp; any other parameter as it is."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param


@pytest.mark.parametrize("zero,schedule,v", [(1, "1f1b", 1), (2, "1f1b", 1), (3, "1f1b", 1),
                                             pytest.param(3, "interleaved", 2,
                                                          marks=pytest.mark.slow)])
def test_pp2_dp2_zero_equals_one_process(run_ranks, zero, schedule, v):
    """pp 2 × dp 2 with ZeRO-1/2 equals one process (plain AdamW, torch's clipping): losses,
    norms before clipping and every updated parameter after 3 steps. The traps: the tied
    embedding's gradient is summed between the end stages *before* ZeRO-2's reduce-scatter cuts it
    into chunks, and its last-stage copy stays out of ZeRO's share of the norm."""
    want_losses, want_norms, dense = _adamw_dense(3, 0.05)
    for pp_rank, losses, norms, params in run_ranks(_zero_run, 4, zero, 3, 0.05, 1e-3, schedule,
                                                    v):
        assert losses == pytest.approx(want_losses, rel=1e-5), pp_rank
        assert norms == pytest.approx(want_norms, rel=1e-5), pp_rank
        for name, value in params.items():
            assert_rel(value, dense[_dense_name(name, CFG)], 1e-5, f"pp rank {pp_rank}: {name}")


def _dense_mixed(precision, m=2, scale=2.0 ** 8):
    """One process under the precision policy's autocast (each backward outside it), the batch
    in ``m`` accumulated micro-batches of loss ``scale · CE_i / m`` (fp16's loss scale; none for
    bf16): the mean loss and the unscaled gradients by name of one step."""
    from ops_transformer.precision.policy import precision_policy

    policy = precision_policy(precision)
    scale = scale if policy.loss_scaling else 1.0
    torch.manual_seed(0)
    model = GPT(CFG)
    losses = []
    for idx, y in zip(*(t.chunk(m) for t in _data(1)[0])):
        with policy.autocast():
            loss = model(idx, y)[1]
        (loss * (scale / m)).backward()
        losses.append(loss.item())
    return sum(losses) / m, {n: p.grad.clone() / scale for n, p in model.named_parameters()}


def _mixed(precision, poison):
    """pp 2 (1f1b, m 2) with ``precision``'s autocast and, for fp16, a loss scaler: the loss, the
    unscaled gradients, and whether the step ran; ``poison``: the pp rank whose gradient gets an
    inf before the step (-1: none)."""
    from ops_transformer import DynamicLossScaler, optimizer_step
    from ops_transformer.precision.policy import precision_policy

    torch.set_num_threads(1)
    ctx = init_parallel(pp=2)
    torch.manual_seed(0)
    model = GPT(CFG)
    pipe = pipeline(model, ctx, "1f1b", microbatches=2)
    policy = precision_policy(precision)
    scaler = DynamicLossScaler(ctx, init_scale=2.0 ** 8) if policy.loss_scaling else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = pipe.step(*_data(1)[0], scaler=scaler, policy=policy)
    if ctx.pp_rank == poison:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    scale = scaler.scale_value if scaler else 1.0
    grads = {n: p.grad.clone() / scale for n, p in model.named_parameters()}
    before = [p.detach().clone() for p in model.parameters()]
    report = optimizer_step(model, opt, ctx, scaler=scaler, max_norm=1.0)
    unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    return ctx.pp_rank, None if loss is None else loss.item(), grads, report.stepped, unchanged


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pp2_mixed_precision_equals_dense_autocast(run_ranks, precision):
    """The stages' forwards under bf16/fp16 autocast (fp16 with its loss scale) equal one process
    running the same 2 micro-batches under the same autocast: the loss and the unscaled gradients
    within 1e-5 — the same 16-bit products, summed in another order. (Against fp32 the gradients
    differ by 1e-2 (bf16) and 1e-3 (fp16): the check sees a stage left in fp32.)"""
    want_loss, want = _dense_mixed(precision)
    for pp_rank, loss, grads, stepped, _ in run_ranks(_mixed, 2, precision, -1):
        assert stepped
        if loss is not None:
            assert loss == pytest.approx(want_loss, rel=1e-5)
        for name, grad in grads.items():
            assert_rel(grad, want[_dense_name(name, CFG)], 1e-5, f"pp rank {pp_rank}: {name}")


def test_fp16_overflow_under_autocast_skips_every_stage(run_ranks):
    for pp_rank, _, _, stepped, unchanged in run_ranks(_mixed, 2, "fp16", 0):
        assert not stepped and unchanged, pp_rank


def _lora_run(pp, want=None, steps=3):
    """LoRA (rank 4, every attention and FFN linear) at pp ``pp`` × tp 2, added before the split
    (pp 1: one process, no tp): the losses and the trained adapters after ``steps`` SGD steps,
    by name (``want``: the one-process adapters, to compare this rank's slices with)."""
    from ops_transformer import ParallelContext, lora

    torch.set_num_threads(1)
    ctx = init_parallel(pp=2, tp=2) if pp > 1 else ParallelContext.single()
    torch.manual_seed(0)
    model = lora(parallelize(GPT(ROPE), ctx), ctx, rank=4, seed=3)
    pipe = pipeline(model, ctx, "1f1b", microbatches=2) if pp > 1 else None
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for idx, y in _data(steps):
        opt.zero_grad()
        if pipe is None:
            loss = model(idx, y)[1]
            loss.backward()
        else:
            loss = pipe.step(idx, y)
        losses.append(None if loss is None else loss.item())
        opt.step()
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if want is None:
        return losses, {n: p.detach().clone() for n, p in trained.items()}
    return losses, {n: (p.detach().clone(), local_part(p, want[n])) for n, p in trained.items()}


def test_pp2_tp2_lora_equals_one_process(run_ranks):
    """The adapters' factors are drawn in the dense model's order when LoRA comes before the
    split (after it, each stage would draw its layers' factors first: refused below): losses
    and the trained adapters equal one process over 3 steps."""
    want_losses, want = _lora_run(1)
    for losses, trained in run_ranks(_lora_run, 4, 2, want):
        if losses[0] is not None:
            assert losses == pytest.approx(want_losses, rel=1e-5)
        assert trained and all(".lora_" in n for n in trained)
        for name, (value, expected) in trained.items():
            assert_rel(value, expected, 1e-5, name)


def _lora_after_split():
    from ops_transformer import lora

    torch.set_num_threads(1)
    ctx = init_parallel(pp=2)
    model = parallelize(GPT(CFG), ctx)
    pipeline(model, ctx, "gpipe", microbatches=2)
    with pytest.raises(ValueError, match="lora must come before pipeline"):
        lora(model, ctx, rank=4)
    return True


def test_lora_after_the_split_is_refused(run_ranks):
    assert all(run_ranks(_lora_after_split, 2))


def _accumulated(cfg, n, m, dense_grads):
    """pp 2 with ``grad_accum=n``: n schedules of m micro-batches per step."""
    torch.set_num_threads(1)
    ctx = init_parallel(pp=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    pipe = pipeline(model, ctx, "1f1b", microbatches=m)
    with CommLedger() as led:
        (idx, y), = _data(1)
        loss = pipe.step(idx, y, grad_accum=n)
    grads = {n_: (p.grad.clone(), dense_grads[_dense_name(n_, cfg)])
             for n_, p in model.named_parameters()}
    sends = sum(r.kind == "send" for r in led.records if r.label == "pp_boundary")
    return None if loss is None else loss.item(), grads, sends


def test_pp2_grad_accum_equals_dense(run_ranks):
    """Micro-batches of micro-batches: 2 schedules of 2 micro-batches, each piece's loss
    CE / 4, the tied sum and the reducers once: the dense batch's loss and gradients."""
    dense_losses, dense_grads = _dense(CFG, 1)
    results = run_ranks(_accumulated, 2, CFG, 2, 2, dense_grads)
    assert results[0][0] is None and abs(results[1][0] - dense_losses[0]) <= RTOL * dense_losses[0]
    for _, grads, sends in results:
        assert sends == 2 * 2  # per rank: n · m sends (activations forward or gradients back)
        for name, (grad, want) in grads.items():
            assert_rel(grad, want, RTOL, name)


def test_pp_grad_accum_must_divide_the_batch(run_ranks):
    def bad():
        ctx = init_parallel(pp=2)
        torch.manual_seed(0)
        pipe = pipeline(GPT(CFG), ctx, "1f1b", microbatches=2)
        idx = torch.zeros(6, T, dtype=torch.long)
        with pytest.raises(ValueError, match=r"the batch \(6 rows\) is not divisible by "
                                             r"grad_accum \(2\) × microbatches \(2\)"):
            pipe.step(idx, idx, grad_accum=2)
        return True

    assert run_ranks(bad, 2) == [True, True]


def _dropout_run(pp, tp, schedule="1f1b", v=1, m=2, grad_accum=1, recompute="none", steps=2,
                 sequence_parallel=False, want=None):
    """Dropout 0.1 in training mode: the losses and the first step's gradients by name, at
    pp × tp (pp 1: one forward of the whole batch, the one-device masks)."""
    torch.set_num_threads(1)
    ctx = init_parallel(pp=pp, tp=tp)
    cfg = ROPE.with_(dropout=0.1)
    torch.manual_seed(0)
    model = parallelize(GPT(cfg), ctx, recompute=recompute, sequence_parallel=sequence_parallel)
    pipe = pipeline(model, ctx, schedule, microbatches=m, stages_per_rank=v) if pp > 1 else None
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], None
    for idx, y in _data(steps):
        opt.zero_grad()
        if pipe is None:
            loss = model(idx, y)[1]
            loss.backward()
        else:
            loss = pipe.step(idx, y, grad_accum=grad_accum)
        if grads is None:  # (with the one device's: this rank's part of each gradient)
            grads = {n: (p.grad.clone(), None if want is None else local_part(p, want[n][0]))
                     for n, p in model.named_parameters()}
        losses.append(None if loss is None else loss.item())
        opt.step()
    return ctx.pp_rank, ctx.tp_rank, losses, grads, torch.rand(()).item()


@pytest.mark.parametrize("schedule,v,grad_accum", [("1f1b", 1, 1), ("interleaved", 2, 2)])
def test_pp2_dropout_equals_one_device(run_ranks, schedule, v, grad_accum):
    """Dropout under pp draws the one-device masks: each stage's forward of a micro-batch seeks
    the seeds one device draws before its first site and takes the micro-batch's rows."""
    ref = run_ranks(_dropout_run, 1, 1, 1)[0]
    results = run_ranks(_dropout_run, 2, 2, 1, schedule, v, 2, grad_accum, want=ref[3])
    _, _, want_losses, _, want_rng = ref
    plain = _dense(ROPE, 2)[0]  # the same model without dropout: the masks do matter
    assert abs(want_losses[0] - plain[0]) > 1e-3 * plain[0]
    for pp_rank, _, losses, grads, rng in results:
        if losses[0] is not None:
            assert losses == pytest.approx(want_losses, rel=RTOL), pp_rank
        for name, (grad, want) in grads.items():
            assert_rel(grad, want, RTOL, f"pp rank {pp_rank}: {name}")
        assert rng == want_rng  # the generator where one device's is after the steps


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(sequence_parallel=True, recompute="full"),
                                     dict(recompute="selective")])
def test_pp2_tp2_dropout_equals_one_device(run_ranks, options):
    """pp 2 × tp 2 with dropout: the heads' and the tokens' (SP) parts of the one-device masks,
    recompute replaying them."""
    ref = run_ranks(_dropout_run, 1, 1, 1)[0]
    results = run_ranks(_dropout_run, 4, 2, 2, "1f1b", 1, 2, 1, options.get("recompute", "none"),
                        2, options.get("sequence_parallel", False), want=ref[3])
    _, _, want_losses, _, want_rng = ref
    for pp_rank, tp_rank, losses, grads, rng in results:
        if losses[0] is not None:
            assert losses == pytest.approx(want_losses, rel=RTOL), pp_rank
        for name, (grad, want) in grads.items():
            assert_rel(grad, want, RTOL, f"pp rank {pp_rank}, tp rank {tp_rank}: {name}")
        assert rng == want_rng
