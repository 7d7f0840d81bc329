"""``check_parity``: run the same inputs through the dense model and the parallel one, module by
module, and say where they part.

The reference is **the dense model on rank 0**, run there alone (micro-batch by micro-batch) before
rank 0 builds its own shard: the whole model's weights, gradients and activations exist on one
rank only; every other rank holds its shards — and, while ``parallelize`` slices it, the dense
model it was built from, unless ``build_parallel`` builds the parallel side directly
(``from_pretrained`` reads each rank's shards only). The other ranks wait in the first collective
meanwhile.
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from ..parallelize import parallelize
from ..precision.policy import precision_policy
from .attribute import attribute
from .compare import agree_on_calls, compare_calls, compare_params, style_of
from .layout import dense_candidates, infer_layout
from .noise import LOGITS_PATHS, bound
from .record import ROOT, Recorder
from .report import ParityReport
from .sequence import sequence_length, to_dense_sequence
from .run import (Schedule, batch_size, default_loss, micro_batch, prepare, restoring_rng,
                  run_reference)
from .tolerance import logits_kl, tolerance_for


def check_parity(build_model, ctx, inputs, *, plan="auto", steps: int = 0, loss_fn=None,
                 precision: str = "fp32", lr: float = 0.1, tolerance: float | None = None,
                 progress=None, build_parallel=None, **parallelize_kwargs) -> ParityReport:
    """Check, on every rank of ``ctx``, that ``parallelize(build_model(), ctx, plan,
    **parallelize_kwargs)`` computes what ``build_model()`` computes on one device.

    ``build_model()`` returns the dense model, the same on every rank (seed it); ``inputs`` is a
    tuple of positional arguments for its forward (or a dict of keyword arguments), the global
    batch: with ``dp × ep`` data ranks each runs its rows. The loss is the model's own (``labels``
    / targets in ``inputs``) or ``loss_fn(output)``, else a mean-square distance to a fixed random
    target. ``steps`` optimizer steps (SGD at ``lr``) add the loss of each, side by side;
    ``precision`` (``fp32``, ``bf16``, ``fp16``: autocast over fp32 weights) picks the tolerance
    (:mod:`.tolerance`; ``tolerance`` overrides the output bound). ``progress(message)``, if
    given, is called on rank 0 as each phase starts. ``build_parallel()``, instead of a plan and
    options, returns the parallel model already made (e.g. ``lambda: ot.from_pretrained(path,
    ctx, dtype=torch.float32, sequence_parallel=True)``: the parallel side then never holds the
    dense model); its options are read from its ``parallel_state``. ``overlap`` defaults to
    ``"none"`` here, so the report names the plan's own styles; ``overlap="chunked"`` checks the
    chunked collective matmuls instead.

    Returns the same :class:`ParityReport` on every rank: per module call in forward-finish
    order the output's (and input's, and output gradient's) difference in dense coordinates, per
    parameter its gradient's, the loss and logits, and the module blamed for a mismatch with its
    plan style (:mod:`.attribute`). An exception inside the parallel forward or backward is a
    mismatch at the module that raised; ``parallelize`` refusing the plan raises as usual.
    """
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr}")
    if build_parallel is not None and (plan != "auto" or parallelize_kwargs):
        given = ["plan"] * (plan != "auto") + list(parallelize_kwargs)
        raise ValueError(f"build_parallel makes the parallel model itself: pass the plan and "
                         f"options ({', '.join(given)}) to it, not to check_parity")
    tol = tolerance_for(precision, tolerance)
    policy = precision_policy(precision)
    autocast = None if precision == "fp32" else (lambda: policy.autocast(ctx.device))
    schedule = Schedule(ctx.dp_ep_size, steps, lr, loss_fn or default_loss, autocast)
    micro_batch(inputs, schedule.micro_batches, 0)  # the batch divides: checked on every rank
    say = (progress or (lambda message: None)) if ctx.rank == 0 else (lambda message: None)
    reference = None
    if ctx.rank == 0:
        say("parity: the dense model on rank 0" + (" (and in fp32)" if autocast else ""))
        with restoring_rng():  # the parallel model is built from the same draws as the reference
            reference = run_reference(build_model, inputs, schedule)
    say(f"parity: the parallel model on {ctx.world_size} rank(s)")
    # the plan's own styles: overlap's chunked variants (tested equal to "none" in
    # tests/parallelize/test_overlap.py) are checked only when asked for (overlap="chunked")
    parallelize_kwargs.setdefault("overlap", "none")
    model = build_parallel() if build_parallel is not None else \
        parallelize(build_model(), ctx, plan, **parallelize_kwargs)
    options = getattr(getattr(model, "parallel_state", None), "options", None)
    sequence_parallel = bool(getattr(options, "sequence_parallel", False))
    report = _check(model, ctx, reference, inputs, schedule, tol, sequence_parallel, say)
    return _describe(report, ctx, inputs, schedule, precision, tol, options)


def _describe(report: ParityReport, ctx, inputs, schedule: Schedule, precision: str, tol,
              options) -> ParityReport:
    """The run's description, and what explains a mismatch that is not a plan fault."""
    report.precision, report.tolerance = precision, tol.to_dict()
    if not report.ok and precision != "fp32" and _about_experts(report):
        report.reason += ("; in 16-bit precision a near-tied router can send a token to other "
                          "experts than the dense model does (an O(1) difference for that token, "
                          "not a plan fault): check in fp32 to tell them apart")
    cache = getattr(options, "activation_cache", "none")
    if not report.ok and cache not in (None, "none"):
        report.reason += (f"; activation_cache={cache!r} keeps the saved activations quantised: "
                          f"its gradients differ from the dense ones by design (a bounded error, "
                          f"docs/memory.md)")
    report.layout = {"tp": ctx.tp_size, "dp": ctx.dp_size, "ep": ctx.ep_size,
                     "cp": ctx.cp_size,
                     "sequence_parallel": bool(getattr(options, "sequence_parallel", False)),
                     "recompute": getattr(options, "recompute", "none")}
    n, b = schedule.micro_batches, batch_size(inputs) or 0
    report.reference = (f"the dense model on rank 0, alone ({n} micro-batch"
                        f"{'es' if n > 1 else ''} of {b // n} rows, one after another"
                        + ("; once more in fp32 for its own rounding" if schedule.autocast else "")
                        + ")")
    return report


def _check(model, ctx, reference, inputs, schedule: Schedule, tol, sequence_parallel: bool, say):
    world, compared = ctx.world_group, ctx.dp_ep_rank == 0
    meta = C.broadcast_object(reference.meta() if reference else None, 0, world)
    prepare(model)
    plan = getattr(model, "parallel_plan", None)
    weights = compare_params(reference.init if reference else None, model, ctx, plan,
                             tol.output, grads=False)
    recorder = Recorder(model, keep=compared)
    mine = micro_batch(inputs, schedule.micro_batches, ctx.dp_ep_rank)
    failure = None
    try:
        with recorder.recording():
            output, loss = schedule.forward(model, mine)
    except Exception as exc:  # noqa: BLE001 - a plan that cannot run is the finding
        failure = _failure("forward", recorder.innermost or ROOT, exc, ctx, plan)
    failure = _agree(failure, ctx)
    if failure is None:
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001
            failure = _failure("backward", recorder.last_gradient or ROOT, exc, ctx, plan)
        failure = _agree(failure, ctx)
    rows, kl = [], None
    if failure is None and compared:
        differ = agree_on_calls(recorder.calls, ctx.tp_group, ctx.device)
        if differ is None and ctx.cp_size > 1:
            differ = agree_on_calls(recorder.calls, ctx.cp_group, ctx.device)
        if differ is not None:
            failure = _uneven(recorder.calls, differ, ctx, plan)
        else:
            say(f"parity: comparing {len(meta)} module calls in dense coordinates")
            to_dense_sequence(meta, recorder.calls, sequence_length(mine), ctx)
            rows = compare_calls(meta, reference.calls if reference else None, recorder.calls,
                                 model, plan, ctx, tol, sequence_parallel,
                                 reference.noise if reference else None)
            kl = _logits_kl(meta, reference, recorder, ctx, sequence_parallel)
    recorder.remove()
    failure = C.broadcast_object(failure, 0, world)
    if failure is not None:
        return _broadcast(_error_report(failure, weights) if ctx.rank == 0 else None, ctx)
    params = compare_params(reference.grads if reference else None, model, ctx, plan, tol.grad,
                            grads=True, noise=reference.noise if reference else None)
    if schedule.steps > 1:
        say(f"parity: {schedule.steps - 1} more optimizer step(s)")
    losses = [_mean_loss(loss, ctx)] + _more_steps(model, mine, schedule, ctx)
    result = None
    if ctx.rank == 0:
        result = _summary(rows, params, weights, reference, losses, kl, tol)
    return _broadcast(result, ctx)


def _more_steps(model, mine, schedule: Schedule, ctx) -> list[float]:
    if not schedule.steps:
        return []
    opt = torch.optim.SGD(model.parameters(), lr=schedule.lr)
    losses = []
    for _ in range(1, schedule.steps):
        opt.step()
        opt.zero_grad()
        _, loss = schedule.forward(model, mine)
        loss.backward()
        losses.append(_mean_loss(loss, ctx))
    return losses


def _about_experts(report: ParityReport) -> bool:
    names = [report.first_mismatch or "", report.first_differing or "", report.style or ""]
    return any("expert" in n or "moe" in n for n in names)


def _mean_loss(loss: torch.Tensor, ctx) -> float:
    """The loss averaged over the data ranks (each ran its own micro-batch)."""
    value = loss.detach().float().reshape(1).clone()
    C.all_reduce(value, ctx.dp_ep_group, label="parity.loss")
    return float(value) / ctx.dp_ep_size


def _logits_kl(meta, reference, recorder, ctx, sequence_parallel: bool) -> float | None:
    """KL of the dense and the parallel logits (the whole model's ``logits`` output, or the
    first element of a tuple), gathered like any other output."""
    entry = next((e for e in meta if e["name"] == ROOT), None)
    call = next((c for c in recorder.calls if c.name == ROOT), None)
    path = next((p for p in LOGITS_PATHS if entry and p in entry["paths"]), None)
    if entry is None or call is None or path is None or path not in call.paths:
        return None
    shape = entry["outputs"][entry["paths"].index(path)]
    local = call.outputs[call.paths.index(path)]
    layout = infer_layout(tuple(local.shape), shape, ctx.tp_rank, ctx.tp_size,
                          sequence_parallel=sequence_parallel)
    dense = dense_candidates(local, layout, ctx.tp_group)
    if reference is None or not dense or len(shape) < 2:
        return None
    ref = next(c for c in reference.calls if c.name == ROOT)
    return logits_kl(dense[0], ref.outputs[ref.paths.index(path)])


def _failure(phase: str, module: str, exc: BaseException, ctx, plan) -> dict:
    message = " ".join(str(exc).split())[:500] or type(exc).__name__
    return {"phase": phase, "module": module, "style": style_of(module, plan),
            "type": type(exc).__name__, "message": message, "rank": ctx.rank}


def _agree(failure: dict | None, ctx) -> dict | None:
    """Every rank learns the failure of the lowest rank that failed (or that none did)."""
    flag = torch.tensor([ctx.rank if failure else ctx.world_size], device=ctx.device)
    C.all_reduce(flag, ctx.world_group, op=C.ReduceOp.MIN, label="parity.agree")
    src = int(flag)
    return None if src == ctx.world_size else C.broadcast_object(failure, src, ctx.world_group)


def _uneven(calls, position: int, ctx, plan) -> dict:
    name = calls[position].name if position < len(calls) else ROOT
    return {"phase": "forward", "module": name, "style": style_of(name, plan),
            "type": "RankDisagreement", "rank": ctx.rank,
            "message": "the tensor-parallel ranks' calls of this module differ in shape or "
                       "number (each rank should run the same modules on same-shaped shards)"}


def _error_report(failure: dict, weights: list[dict]) -> ParityReport:
    bad = [w for w in weights if not w["ok"]]
    module, style, reason, first = attribute([], [], [], failure)
    return ParityReport(ok=False, first_mismatch=module, style=style, reason=reason,
                        first_differing=first, weights=bad, error=failure)


def _summary(rows, params, weights, reference, losses, kl, tol) -> ParityReport:
    bad_weights = [w for w in weights if not w["ok"]]
    verdict = attribute(rows, params, bad_weights)
    ref_losses = reference.losses
    loss_abs = abs(losses[0] - ref_losses[0])
    loss = {"reference": ref_losses[0], "parallel": losses[0], "abs": loss_abs,
            "rel": loss_abs / max(abs(ref_losses[0]), 1e-30),
            "bound": bound(reference.noise, "loss", tol.loss)}
    steps = []
    if len(losses) > 1 or len(ref_losses) > 1:
        for i, (r, p) in enumerate(zip(ref_losses, losses)):
            rel = abs(p - r) / max(abs(r), 1e-30)
            steps.append({"step": i + 1, "reference": r, "parallel": p, "rel": rel,
                          "bound": loss["bound"] * (i + 1),
                          "status": "ok" if rel <= loss["bound"] * (i + 1) else "mismatch"})
    problems = []
    if loss["rel"] > loss["bound"]:
        problems.append(f"the loss differs (relative {loss['rel']:.1e} > {loss['bound']:.1e})")
    kl_bound = bound(reference.noise, "kl", tol.kl)
    if kl is not None and kl > kl_bound:
        problems.append(f"the logits differ (KL {kl:.1e} > {kl_bound:.1e})")
    late = next((s for s in steps if s["status"] != "ok"), None)
    if late:
        problems.append(f"the loss of step {late['step']} differs (relative {late['rel']:.1e})")
    ok = verdict is None and not problems
    module, style, reason, first = verdict or (None, None, "; ".join(problems), None)
    return ParityReport(ok=ok, first_mismatch=module, style=style, reason=reason,
                        first_differing=first, rows=rows + params, loss=loss, kl=kl,
                        steps=steps, weights=bad_weights)


def _broadcast(report: ParityReport | None, ctx) -> ParityReport:
    data = C.broadcast_object(report.to_dict() if report else None, 0, ctx.world_group)
    return ParityReport.from_dict(data)
