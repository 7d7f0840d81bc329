"""The diagnostics that need a step: host synchronisations, redundant and small collectives,
exposed communication and load imbalance (see :mod:`.diagnose`)."""

from __future__ import annotations

import torch.distributed as dist

from ..comm.ledger import CommLedger
from ..memory.apply import transformer_layers
from ..training.optimizer import partial_numel
from ..memory.recompute import checkpointed
from ..parallelize.sequence_plan import is_sequence_parallel
from ..planner.layout import CostOptions, Layout
from ..planner.strategies import model_comm_per_step
from .context_checks import cp_checks
from .profile import gather_objects, profile_step, world_group
from .watch import BACKWARD, OUTSIDE, StepWatch

PROFILED_STEPS = 3


def overlap_fix(sequence_parallel: bool) -> str:
    """The options that hide exposed communication (sequence parallelism unless it is on)."""
    sp = ("" if sequence_parallel else "sequence parallelism (--sequence-parallel: reduce-scatter "
          "+ all-gather of the same volume, the norms and dropout on 1/tp of the tokens), ")
    return ("hide it behind compute: " + sp + "chunked collective matmuls (parallelize("
            "overlap='chunked'), train --overlap chunked; overlap='auto' chunks only where the "
            "profile says it pays), a smaller tp (fewer, larger shards) or tp inside "
            "one NVLink domain")


def _diag(code, severity, where, message, suggestion, saving=None) -> dict:
    return {"code": code, "severity": severity, "where": where, "message": message,
            "suggestion": suggestion, "estimated_saving_s": saving}


def _observe(model, ctx, step_fn) -> dict:
    """One watched step on this rank, as plain data (to be gathered)."""
    with CommLedger() as ledger, StepWatch(model) as seen:
        step_fn()
    records = [[r.kind, r.elements, r.bytes, list(r.group_ranks), r.label]
               for r in ledger.records]
    tp_ranks = (dist.get_process_group_ranks(ctx.tp_group) if ctx.tp_group is not None
                else [ctx.rank])
    return {"rank": ctx.rank, "tp_ranks": tp_ranks, "records": records,
            "syncs": [[s.what, s.where, s.needed] for s in seen.syncs
                      if s.on_device or s.where != OUTSIDE],
            "collectives": [[c.op, c.fingerprint, c.where, c.gemms_before]
                            for c in seen.collectives],
            "input_shape": seen.input_shape, "forwards": seen.forwards}


def host_syncs(ranks: list[dict]) -> list[dict]:
    """``warning`` per place that synchronises; ``info`` where the library needs the read."""
    counts: dict[tuple, int] = {}
    for s in ranks[0]["syncs"]:  # every rank runs the same code; rank 0 speaks for them
        counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    return [_diag("host_sync", "info" if needed else "warning", where,
                  f"{what} in {where} ({n}× per step) makes the host wait for the device: the "
                  f"GPU's queue drains and kernels stop overlapping with Python",
                  needed or "keep the value on the device (torch.where, masks, a tensor "
                  "accumulator) and read it outside the step, every N steps")
            for (what, where, needed), n in sorted(counts.items(), key=str)]


def _paired(rank: dict) -> list[tuple[list, list]] | None:
    """The ledger's records with what the watch noted about each, in call order (``None`` if the
    two do not line up, which they always do: both are filled by the same ledger call)."""
    if len(rank["records"]) != len(rank["collectives"]):
        return None
    return list(zip(rank["records"], rank["collectives"]))


def sequence_parallel_of(model) -> bool | str:
    """Whether ``model``'s plan is sequence-parallel (its layers keep a slice of the tokens):
    ``"regather"`` for the re-gathering variant, else ``True`` or ``False``."""
    return is_sequence_parallel(getattr(model, "parallel_plan", None))


def recompute_of(model) -> str:
    """``"full"`` when every Transformer layer of ``model`` replays its forward in backward
    (:func:`~ops_transformer.memory.apply_recompute`), else ``"none"`` (selective recompute replays
    no collective)."""
    try:
        layers = transformer_layers(model)
    except ValueError:
        return "none"
    replay = checkpointed(len).__code__  # every function checkpointed() wraps runs this code
    # a layer that is a region (layers/regions.py) checkpoints its own forward inside it
    wrapped = [any(getattr(getattr(b, name, None), "__code__", None) is replay
                   for name in ("forward", "own_forward")) for b in layers]
    return "full" if wrapped and all(wrapped) else "none"


def beyond_minimum(model, ctx, rank: dict, latency: dict) -> list[dict]:
    """TP collectives beyond :func:`model_comm_per_step` for the reference GPT's plan (with its
    sequence parallelism and recompute, and as many micro-batches as the step ran forwards)."""
    plan, cfg, shape = getattr(model, "parallel_plan", None), getattr(model, "cfg", None), \
        rank["input_shape"]
    if plan is None or not hasattr(cfg, "d_model") or shape is None or len(shape) != 2:
        return []
    sp = sequence_parallel_of(model)
    options = getattr(getattr(model, "parallel_state", None), "options", None)
    priced = CostOptions.of(options, attention=plan.attention, vocab=plan.vocab,
                            sequence_parallel=sp, recompute=recompute_of(model))
    expected = model_comm_per_step(cfg, Layout(tp=ctx.tp_size, ep=ctx.ep_size), priced,
                                   batch=shape[0], seq=shape[1],
                                   partial_elements=partial_numel(model, ctx.tp_group),
                                   profile=ctx.profile,
                                   grad_accum=max(rank.get("forwards", 1), 1))
    described = ", ".join([f"{plan.attention} attention", f"{plan.vocab} vocabulary"]
                          + ["sequence parallel" + (" (regather)" if sp == "regather" else "")]
                          * bool(sp)
                          + ["full recompute"] * (recompute_of(model) == "full"))
    calls: dict[str, int] = {}
    for kind, _, _, group, _ in rank["records"]:
        if group == rank["tp_ranks"]:
            calls[kind] = calls.get(kind, 0) + 1
    out = []
    for kind, n in sorted(calls.items()):
        extra = n - expected.get(kind, {}).get("calls", 0)
        if extra > 0:
            out.append(_diag(
                "redundant_collective", "warning", f"{kind} on the TP group",
                f"{n} {kind} calls per step where the plan ({described}) needs {n - extra}: "
                f"{extra} more than the minimum",
                "remove the extra collectives (a second reduction of an already reduced "
                "activation, a replicated module that is reduced anyway)",
                extra * latency.get(kind, 0.0) or None))
    return out


def duplicated(ranks: list[dict], latency: dict, replays: bool = False) -> list[dict]:
    """The same input all-reduced twice on a rank, or an input identical on every rank of its
    group. With ``replays`` (full recompute) a forward all-reduce repeated once in backward is the
    layer's replay, not a duplicate."""
    seen_twice: dict[str, int] = {}
    replicated: dict[str, int] = {}
    pairs = [_paired(r) for r in ranks]
    for rank, pair in zip(ranks, pairs):
        prints: dict[str, int] = {}  # fingerprint -> forward calls not replayed yet
        for record, (op, fp, where, _) in pair or []:
            if fp is None:
                continue
            key = repr(fp)
            backward = where.startswith(BACKWARD)
            if replays and backward and prints.get(key, 0) > 0:
                prints[key] -= 1  # the replay of a forward call
                continue
            if key in prints:
                seen_twice[where] = seen_twice.get(where, 0) + 1
            prints[key] = prints.get(key, 0) + (not backward)
    if all(p is not None for p in pairs):
        order: dict[tuple, dict[int, list]] = {}  # group -> rank -> its all-reduces in order
        for rank, pair in zip(ranks, pairs):
            for record, col in pair:
                if record[0] == "all_reduce":
                    order.setdefault(tuple(record[3]), {}).setdefault(rank["rank"], []).append(col)
        for group, by_rank in order.items():
            if set(by_rank) != set(group):
                continue
            for calls in zip(*(by_rank[r] for r in group)):
                fps = {repr(c[1]) for c in calls}
                if len(fps) == 1 and calls[0][1] is not None:
                    replicated[calls[0][2]] = replicated.get(calls[0][2], 0) + 1
    alpha = latency.get("all_reduce", 0.0) or None
    out = [_diag("redundant_collective", "warning", where,
                 f"{where} all-reduces a tensor this rank already all-reduced in the step "
                 f"({n}×): the same tensor reduced twice", "reduce it once and reuse the result",
                 alpha and n * alpha) for where, n in sorted(seen_twice.items())]
    out += [_diag("redundant_collective", "warning", where,
                  f"{where} all-reduces a tensor that is already identical on every rank of the "
                  f"group ({n}×): the sum multiplies it by the group size and moves bytes for "
                  f"nothing", "drop the all-reduce (the value is replicated), or reduce the "
                  "partial values before they are combined", alpha and n * alpha)
            for where, n in sorted(replicated.items()) if where not in seen_twice]
    return out


def small_runs(rank: dict, profile, small_run: int) -> list[dict]:
    """Runs of ``small_run`` or more small collectives of one kind and group with no matrix
    product between them (so they could travel as one message)."""
    pair = _paired(rank)
    if pair is None:
        return []
    threshold = getattr(profile, "p2p_threshold_bytes", None)
    if not threshold:
        alpha, beta = profile.alpha_beta("all_reduce", 2)
        threshold = alpha * beta  # Hockney's n½: transfer time equals the latency
    runs, current = [], []
    for record, col in pair:
        kind, _, nbytes, group, _ = record
        small = nbytes < threshold
        joins = current and col[3] == 0 and (current[-1][0][0], current[-1][0][3]) == (kind, group)
        if small and joins:
            current.append((record, col))
            continue
        runs.append(current)
        current = [(record, col)] if small else []
    runs.append(current)
    out = []
    for run in runs:
        if len(run) < small_run:
            continue
        kind, group = run[0][0][0], run[0][0][3]
        alpha, _ = profile.alpha_beta(kind, len(group))
        where = sorted({c[2] for _, c in run})
        largest = max(r[2] for r, _ in run)
        out.append(_diag(
            "small_collectives", "warning", ", ".join(where[:3]) + ("…" if len(where) > 3 else ""),
            f"{len(run)} {kind} calls of at most {largest} bytes each, back to back on a group "
            f"of {len(group)} (below the small-message threshold of {int(threshold)} bytes: "
            f"each costs about one latency α = {alpha * 1e6:.0f} µs)",
            "coalesce them into one flat buffer (one collective; see comm/bucketing) or "
            "reduce them together at the end of the step",
            (len(run) - 1) * alpha))
    return out


def balance(summary: dict, exposed_threshold: float, imbalance_threshold: float,
            sequence_parallel: bool = False) -> list[dict]:
    """Exposed communication and load imbalance from a profile summary."""
    ranks = summary["per_rank"]
    out = []
    worst = max(ranks, key=lambda r: r["exposed_comm_s"] / r["step_time_s"])
    share = worst["exposed_comm_s"] / worst["step_time_s"]
    if share > exposed_threshold:
        out.append(_diag("exposed_comm", "warning", f"rank {worst['rank']}",
                         f"{100 * share:.0f}% of the step ({1e3 * worst['exposed_comm_s']:.2f} ms "
                         f"of {1e3 * worst['step_time_s']:.2f} ms) waits for communication that "
                         f"no computation hides (threshold {100 * exposed_threshold:.0f}%)",
                         overlap_fix(sequence_parallel), worst["exposed_comm_s"]))
    compute = [r["compute_s"] for r in ranks]
    if len(ranks) > 1 and max(compute) > 0:
        spread = (max(compute) - min(compute)) / max(compute)
        slow = max(ranks, key=lambda r: r["compute_s"])
        if spread > imbalance_threshold:
            out.append(_diag("load_imbalance", "warning", f"rank {slow['rank']}",
                             f"the ranks' compute per step ranges from {1e3 * min(compute):.2f} "
                             f"to {1e3 * max(compute):.2f} ms ({100 * spread:.0f}% apart): the "
                             f"others wait for rank {slow['rank']} in every collective",
                             "give every rank the same work (equal shards, equal micro-batches); "
                             "on a shared machine, check what else runs on its cores",
                             max(compute) - sum(compute) / len(compute)))
    return out


def comm_checks(model, ctx, step_fn, profile, *, exposed_threshold: float,
                imbalance_threshold: float, small_run: int) -> list[dict]:
    """Every rank: one watched step, then :data:`PROFILED_STEPS` profiled ones."""
    ranks = gather_objects(_observe(model, ctx, step_fn), world_group(ctx), ctx.device)
    summary = profile_step(step_fn, ctx, steps=PROFILED_STEPS, warmup=0).summary()
    latency = {k: v["mean_latency_s"] for k, v in summary["collectives"].items()}
    me = next(r for r in ranks if r["rank"] == 0)
    return (host_syncs(ranks) + beyond_minimum(model, ctx, me, latency)
            + duplicated(ranks, latency, replays=recompute_of(model) == "full")
            + small_runs(me, profile, small_run) + cp_checks(model, ctx, me, profile)
            + balance(summary, exposed_threshold, imbalance_threshold, sequence_parallel_of(model)))
