"""ZeRO-3 through FSDP2 (``shard_parameters``) on a dp × tp mesh: 5 AdamW steps equal the unsharded
model, each rank holds 1/(dp·tp) of the parameters, FSDP2's collectives show in the ledger on the
data-parallel group only, and the tensor-parallel collectives are those of the unsharded model."""

from __future__ import annotations

import pytest
import torch

from helpers import BF16_RTOL, assert_rel
from ops_transformer import (GPT, CommLedger, gather_full_state_dict, init_parallel, no_sync,
                             parallelize, shard_parameters)
from ops_transformer.precision import DynamicLossScaler, optimizer_step
from test_zero import ADAMW, B, CONFIG, STEPS, _batches  # the model and data of ZeRO 1 and 2


def _train(tp, shard, sp=False, recompute="none", autocast=False, clip=None, raf=True,
           mixed=None, config=CONFIG, scale=False):
    """5 AdamW steps through optimizer_step; returns the gathered dense weights, the losses of
    the global batch, the bytes of parameters this rank holds and the steps' ledger records."""
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(config)
    if ctx.world_size > 1:
        model = parallelize(model, ctx, attention="heads", sequence_parallel=sp,
                            recompute=recompute, vocab="parallel")
        if shard:
            shard_parameters(model, ctx, reshard_after_forward=raf, mixed_precision=mixed)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    rows = slice(ctx.dp_rank * B // ctx.dp_size, (ctx.dp_rank + 1) * B // ctx.dp_size)
    losses, norms = [], []
    scaler = DynamicLossScaler(ctx, init_scale=2.0 ** 10) if scale else None
    with CommLedger() as ledger:
        for batch in _batches():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(batch[rows, :-1], batch[rows, 1:])[1]
            (loss if scaler is None else scaler.scale(loss)).backward()
            report = optimizer_step(model, opt, ctx, scaler=scaler, max_norm=clip,
                                    metrics={"loss": loss})
            assert report.stepped
            losses.append(report.metrics["loss"])
            norms.append(report.grad_norm)
            opt.zero_grad()
    params = list(dict.fromkeys(model.parameters()))
    held = sum(_local(p).numel() * p.element_size() for p in params)
    # what FSDP2 gathers per step and unit: each DTensor's rows padded to a multiple of dp
    padded = sum(-(-p.shape[0] // ctx.dp_size) * ctx.dp_size * p[0].numel() for p in params
                 if _local(p) is not p)
    records = [(r.kind, r.label, r.group_ranks, r.elements, r.bytes) for r in ledger.records]
    return gather_full_state_dict(model, ctx), losses, norms, held, records, padded


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def _assert_equal(results, reference, rtol=1e-5):
    state_ref, losses_ref, norms_ref = reference[:3]
    for state, losses, norms, *_ in results:
        assert_rel(torch.tensor(losses), torch.tensor(losses_ref), rtol=rtol, what="losses")
        if norms_ref[0] is not None:
            assert_rel(torch.tensor(norms), torch.tensor(norms_ref), rtol=rtol, what="norms")
        for key, value in state_ref.items():
            assert_rel(state[key], value, rtol=rtol, what=key, floor=0.02)


@pytest.mark.parametrize("variant", [
    {},
    {"sp": True},
    pytest.param({"recompute": "full"}, marks=pytest.mark.slow),
    pytest.param({"sp": True, "recompute": "full"}, marks=pytest.mark.slow),
    pytest.param({"clip": 0.05}, marks=pytest.mark.slow),
    pytest.param({"raf": False}, marks=pytest.mark.slow),
    pytest.param({"clip": 0.05, "scale": True, "sp": True}, marks=pytest.mark.slow),
])
def test_five_adamw_steps_at_dp2_tp2_equal_the_unsharded_model(run_ranks, variant):
    reference = run_ranks(_train, 1, 1, False, clip=variant.get("clip"),
                          scale=variant.get("scale", False))[0]
    if "clip" in variant:
        assert min(reference[2]) > variant["clip"]  # every step clips
    _assert_equal(run_ranks(_train, 4, 2, True, **variant), reference)


@pytest.mark.slow
def test_bf16_autocast_equals_the_unsharded_parallel_model(run_ranks):
    """Under bf16 autocast the dense single-device model rounds differently from any tp layout
    (BF16_RTOL); the unsharded dp 2 × tp 2 model rounds alike, and sharding changes only the order
    of the fp32 gradient sums."""
    reference = run_ranks(_train, 4, 2, False, autocast=True)[0]
    _assert_equal(run_ranks(_train, 4, 2, True, autocast=True), reference, rtol=1e-4)
    dense = run_ranks(_train, 1, 1, False, autocast=True)[0]
    _assert_equal(run_ranks(_train, 4, 2, True, autocast=True), dense, rtol=BF16_RTOL)


@pytest.mark.slow
def test_mixed_precision_policy_keeps_fp32_master_shards(run_ranks):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                 cast_forward_inputs=False)
    dense = run_ranks(_train, 1, 1, False, autocast=True)[0]
    results = run_ranks(_train, 4, 2, True, autocast=True, mixed=mixed)
    _assert_equal(results, dense, rtol=BF16_RTOL)
    for result in results:
        gathers = [r for r in result[4] if r[1] == "fsdp_params"]
        assert gathers and all(b == 2 * e for *_, e, b in gathers)  # gathered in bf16
        scattered = [r for r in result[4] if r[1] == "fsdp_grads"]
        assert scattered and all(b == 4 * e for *_, e, b in scattered)  # reduced in fp32


def test_parameters_per_rank_and_the_ledger(run_ranks):
    dense = sum(p.numel() * 4 for p in GPT(CONFIG).parameters())
    plain = run_ranks(_train, 4, 2, False)
    sharded = run_ranks(_train, 4, 2, True)
    for rank, (result, unsharded) in enumerate(zip(sharded, plain)):
        records, tp = result[4], (rank - rank % 2, rank - rank % 2 + 1)
        dp = (rank % 2, rank % 2 + 2)
        # 1/(dp·tp) of the dense bytes, up to FSDP2's padding of each shard's rows
        assert abs(result[3] / (dense / 4) - 1) < 0.02
        fsdp = [r for r in records if r[1].startswith("fsdp")]
        assert fsdp and all(r[2] == dp for r in fsdp)  # the dp group only
        units = 4  # two layers, the LM head and the root
        assert sum(r[1] == "fsdp_params" for r in fsdp) == 2 * units * STEPS  # fwd + bwd
        assert {r[0] for r in fsdp if r[1] == "fsdp_params"} == {"all_gather"}
        assert {r[0] for r in fsdp if r[1] == "fsdp_grads"} == {"reduce_scatter"}
        assert sum(r[1] == "fsdp_grads" for r in fsdp) == units * STEPS
        gathered = sum(r[3] for r in fsdp if r[1] == "fsdp_params")
        assert gathered == 2 * STEPS * result[5]  # every sharded element, in forward and backward
        assert sum(r[3] for r in fsdp if r[1] == "fsdp_grads") == STEPS * result[5]
        # the tensor-parallel collectives are the unsharded model's, call for call
        assert [r for r in records if r[2] == tp] == [r for r in unsharded[4] if r[2] == tp]
        assert not [r for r in records if r[1] in ("dp_grads", "zero_grads", "zero_params")]


def _accumulate(micro):
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    model = shard_parameters(parallelize(GPT(CONFIG), ctx, attention="heads"), ctx)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = _batches()[0][ctx.dp_rank * 2:(ctx.dp_rank + 1) * 2]
    with CommLedger() as ledger:
        for i, part in enumerate(rows.chunk(micro)):
            loss = model(part[:, :-1], part[:, 1:])[1] / micro
            if i < micro - 1:
                with no_sync(model):
                    loss.backward()
            else:
                loss.backward()
    opt.step()
    return gather_full_state_dict(model, ctx), sum(r.label == "fsdp_grads"
                                                   for r in ledger.records)


@pytest.mark.slow
def test_no_sync_accumulates_and_reduce_scatters_once(run_ranks):
    once = run_ranks(_accumulate, 4, 1)
    twice = run_ranks(_accumulate, 4, 2)
    assert once[0][1] == twice[0][1] == 4  # one reduce-scatter per unit, outside no_sync only
    for key, value in once[0][0].items():
        assert_rel(twice[0][0][key], value, what=key, floor=0.02)


def test_shard_parameters_checks_its_input(run_ranks):
    def bad(case):
        ctx = init_parallel(tp=2 if case == "dp1" else 1)
        model = GPT(CONFIG)
        if case == "plain":
            shard_parameters(model, ctx)
        model = parallelize(model, ctx, attention="heads")
        shard_parameters(model, ctx)
        if case == "twice":
            shard_parameters(model, ctx)

    with pytest.raises(ValueError, match=r"parallelize\(model, ctx\) first"):
        run_ranks(bad, 2, "plain")
    with pytest.raises(ValueError, match=r"dp \(1\) × ep \(1\) is 1"):
        run_ranks(bad, 2, "dp1")
    with pytest.raises(ValueError, match="already sharded"):
        run_ranks(bad, 2, "twice")


@pytest.mark.slow
def test_int8_activation_cache_under_sharding_equals_the_unsharded_parallel_model(run_ranks):
    """The 8-bit cache rounds the same activations alike; only the fp32 order of the gradient
    sums differs, and a code may round the other way after it (a few quanta)."""
    def run(shard):
        ctx = init_parallel(tp=2)
        torch.manual_seed(0)
        model = parallelize(GPT(CONFIG), ctx, attention="heads", activation_cache="int8")
        if shard:
            shard_parameters(model, ctx)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        rows = slice(ctx.dp_rank * 2, ctx.dp_rank * 2 + 2)
        for batch in _batches():
            model(batch[rows, :-1], batch[rows, 1:])[1].backward()
            opt.step()
            opt.zero_grad()
        return gather_full_state_dict(model, ctx)

    reference = run_ranks(run, 4, False)[0]
    for state in run_ranks(run, 4, True):
        for key, value in reference.items():
            assert_rel(state[key], value, rtol=1e-4, what=key, floor=0.02)


def test_train_runs_the_planners_zero3_plan_and_exports_it(tmp_path, capsys):
    """``plan --zero 3`` → ``train --plan``: ZeRO-3 as planned (no warning), the same losses as
    without sharding, half the parameter bytes per rank at dp 2, and a checkpoint that exports to
    the same dense tensors as the unsharded run's."""
    import json
    import warnings

    from ops_transformer.checkpoint import export as ex
    from ops_transformer.cli.main import main

    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "tiny", "--gpu", "local", "--tp", "1", "--dp", "2", "--zero",
                 "3", "--batch", "4", "--seq", "32", "--out", str(plan), "--json"]) == 0
    runs = {}
    for name, layout in (("plan", ["--plan", str(plan)]), ("plain", ["--nproc", "2"])):
        capsys.readouterr()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert main(["train", *layout, "--steps", "2", "--batch", "4", "--seq", "32",
                         "--ckpt-dir", str(tmp_path / f"ckpt-{name}"), "--no-progress",
                         "--out", str(tmp_path / name)]) == 0
        runs[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert runs["plan"]["config"]["zero"] == 3 and runs["plain"]["config"]["zero"] == 0
    assert runs["plan"]["losses"] == pytest.approx(runs["plain"]["losses"], rel=1e-5)
    sharded, plain = (runs[n]["model_state_bytes_per_rank"] for n in ("plan", "plain"))
    assert abs(sharded["params"] / plain["params"] - 0.5) < 0.02
    assert abs(sharded["optimizer"] / plain["optimizer"] - 0.5) < 0.02
    got, _ = ex.dense_state_dict(tmp_path / "ckpt-plan")
    ref, _ = ex.dense_state_dict(tmp_path / "ckpt-plain")
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        assert_rel(got[key], value, rtol=1e-5, what=key, floor=0.02)


def _overflow_on_one_rank():
    """An inf in the gradient shard of one rank only: every rank skips the step."""
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    model = shard_parameters(parallelize(GPT(CONFIG), ctx, attention="heads"), ctx)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    scaler = DynamicLossScaler(ctx, init_scale=2.0 ** 10)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    batch = _batches()[0][ctx.dp_rank * 2:(ctx.dp_rank + 1) * 2]
    scaler.scale(model(batch[:, :-1], batch[:, 1:])[1]).backward()
    if ctx.rank == 3:
        model.layers[1].mlp.w_out.weight.grad.to_local().view(-1)[0] = float("inf")
    report = optimizer_step(model, opt, ctx, scaler=scaler, max_norm=1.0)
    same = all(torch.equal(p.to_local(), before[n]) for n, p in model.named_parameters())
    return report.stepped, same, scaler.scale_value


@pytest.mark.slow
def test_an_overflow_in_one_shard_skips_the_step_on_every_rank(run_ranks):
    # skipped everywhere, weights untouched; the same scale on every rank (hysteresis 2: the first
    # overflow keeps it)
    assert run_ranks(_overflow_on_one_rank, 4) == [(False, True, 2.0 ** 10)] * 4


def _sp_sharding():
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    model = shard_parameters(parallelize(GPT(CONFIG), ctx, attention="heads",
                                         sequence_parallel=True), ctx)
    norms = {n: type(p).__name__ for n, p in model.named_parameters() if "norm" in n}
    state = model.parallel_state
    return norms, len(state.sharding.unsharded), [r.name for r in state.reducers]


def test_sp_norms_are_sharded_and_summed_over_tp_by_the_hook(run_ranks):
    """ZeRO-3 under SP shards the norms (partial gradients over TP) too: each is an FSDP2 unit
    whose all-reduce hook sums its reduce-scattered gradient over TP — one ``fsdp_partial_sums``
    call per norm and step, on the TP group — and the chain has no reducer of its own left (the
    SP variant of the 5-step test above checks the values against the unsharded model)."""
    for norms, unsharded, chain in run_ranks(_sp_sharding, 4):
        assert norms and set(norms.values()) == {"DTensor"}, norms
        assert unsharded == 0 and chain == ["fsdp"]
    for rank, result in enumerate(run_ranks(_train, 4, 2, True, True)):
        tp = (rank - rank % 2, rank - rank % 2 + 1)
        sums = [r for r in result[4] if r[1] == "fsdp_partial_sums"]
        n_norms = 2 * CONFIG.n_layers + 1
        assert len(sums) == n_norms * STEPS and all(r[0] == "all_reduce" and r[2] == tp
                                                    for r in sums)
