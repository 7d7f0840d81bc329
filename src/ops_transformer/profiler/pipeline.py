"""Pipeline parallelism in ``profile`` and ``diagnose``: the bubble per rank, an unbalanced split.

**The bubble per rank** (``profile``, ``summary["pipeline"]``): while profiling, every step's
schedule is timed on each rank (``Pipeline.measure``): its wall time ``T`` and the rank's busy
time ``B`` — the wall time of its stages' forward and backward chunks
(``RecordedStage.forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``; on a
GPU with the device synchronised around each). The measured bubble is ``(T − B) / B``, the idle
time (waiting for a neighbour, the boundary transfers, the schedule's bookkeeping) over the busy
time, the same ratio as the planner's formula (``planner.pipeline.bubble_fraction``), which is
shown beside it. Medians over the profiled steps.

**An unbalanced split** (``diagnose``, code ``pp_unbalanced``, a warning): the stages hold equal
runs of layers, but the last one also runs the LM head and the loss (``6·V·h`` FLOPs per token,
``planner.pipeline.stage_flops_per_token``) — with a large vocabulary or few layers per stage that
stage is the slowest, and every other waits for it in every micro-batch. Found from the model
alone when the predicted work of the pp ranks differs by more than the imbalance threshold, and
from a diagnosed step when their measured busy times do.
"""

from __future__ import annotations

import statistics

from ..parallelize.pipeline_split import SCHEDULES, rank_stages
from ..planner.pipeline import SCHEDULES as PRICED, bubble_fraction, stage_flops_per_token
from ..utils.progress import format_table
from .profile import gather_objects, world_group

CODE = "pp_unbalanced"
MEASURED_FIX = ("if the slow rank holds the last stage, the head is its extra work: more layers "
                "per stage (a smaller --pp) or the vocabulary split over tp (--tp); the first "
                "stage's extra is the embedding; on a shared machine, check what else runs on "
                "its cores")
FIX = ("make the head a smaller share of the last stage: more layers per stage (a smaller --pp), "
       "or the head's vocabulary split over tp (--tp); uneven layer splits are not offered yet")


def rank_timings(pipe, steps: int) -> dict:
    """This rank's medians over its last ``steps`` timed schedules."""
    last = pipe.timings[-steps:] if steps else pipe.timings
    ctx = pipe.ctx
    mine = {"rank": ctx.rank, "pp_rank": ctx.pp_rank,
            "stages": [f"{s.layer_ids.start}-{s.layer_ids.stop - 1}"
                       + ("+head" if s.last else "") for s in pipe.stages]}
    if not last:
        return {**mine, "schedule_s": None, "busy_s": None, "bubble": None}
    bubbles = [t["bubble"] for t in last if t["bubble"] is not None]
    return {**mine, "schedule_s": statistics.median(t["schedule_s"] for t in last),
            "busy_s": statistics.median(t["busy_s"] for t in last),
            "bubble": statistics.median(bubbles) if bubbles else None}


def pipeline_summary(pipe, steps: int) -> dict:
    """Every rank calls it (a gather over the world group): the schedule, the formula's bubble
    and each rank's measured one."""
    per_rank = gather_objects(rank_timings(pipe, steps), world_group(pipe.ctx), pipe.ctx.device)
    ctx = pipe.ctx
    formula = (bubble_fraction(pipe.schedule_name, ctx.pp_size, pipe.microbatches,
                               pipe.stages_per_rank)
               if pipe.schedule_name in PRICED else None)
    return {"pp": ctx.pp_size, "schedule": pipe.schedule_name,
            "microbatches": pipe.microbatches, "stages_per_rank": pipe.stages_per_rank,
            "bubble_formula": formula, "per_rank": sorted(per_rank, key=lambda r: r["rank"])}


def pipeline_table(pipeline: dict) -> str:
    rows = [{"rank": r["rank"], "pp rank": r["pp_rank"], "layers": ", ".join(r["stages"]),
             "schedule ms": None if r["schedule_s"] is None else round(1e3 * r["schedule_s"], 3),
             "busy ms": None if r["busy_s"] is None else round(1e3 * r["busy_s"], 3),
             "bubble": None if r["bubble"] is None else round(r["bubble"], 3)}
            for r in pipeline["per_rank"]]
    formula = pipeline["bubble_formula"]
    head = (f"pipeline: pp {pipeline['pp']}, {pipeline['schedule']} "
            f"(v {pipeline['stages_per_rank']}), {pipeline['microbatches']} micro-batches; "
            f"bubble = (schedule − busy) / busy, formula "
            + ("not priced" if formula is None else f"{formula:.3f}"))
    return head + "\n" + format_table(rows)


def predicted_balance(model, pp: int, schedule: str, stages_per_rank: int,
                      threshold: float = 0.10) -> list[dict]:
    """``pp_unbalanced`` from the model alone (a :class:`~ops_transformer.planner.specs.
    ModelSpec`): each pp rank's predicted FLOPs per token, its stages' sum."""
    placement = SCHEDULES[schedule][2]
    per_stage = stage_flops_per_token(model, pp * stages_per_rank)
    work = [sum(per_stage[s] for s in rank_stages(r, pp, stages_per_rank, placement))
            for r in range(pp)]
    return _finding(work, threshold, "predicted", "MFLOP per token and step",
                    [f * 1e-6 for f in work])


def measured_balance(per_rank: list[dict], threshold: float = 0.10) -> list[dict]:
    """``pp_unbalanced`` from measured busy times (:func:`rank_timings` of every rank): the
    slowest rank of each pp rank."""
    busy: dict[int, float] = {}
    for r in per_rank:
        if r["busy_s"] is not None:
            busy[r["pp_rank"]] = max(busy.get(r["pp_rank"], 0.0), r["busy_s"])
    if len(busy) < 2:
        return []
    work = [busy[k] for k in sorted(busy)]
    return _finding(work, threshold, "measured", "ms busy per step", [1e3 * w for w in work],
                    saving=max(work) - sum(work) / len(work), fix=MEASURED_FIX)


def _finding(work: list[float], threshold: float, how: str, unit: str, shown: list[float],
             saving=None, fix: str = FIX) -> list[dict]:
    spread = (max(work) - min(work)) / max(work) if max(work) > 0 else 0.0
    if spread <= threshold:
        return []
    slow = max(range(len(work)), key=work.__getitem__)
    values = ", ".join(f"{v:.3g}" for v in shown)
    return [{"code": CODE, "severity": "warning", "where": f"pp rank {slow}",
             "message": f"the pipeline stages' work is unequal ({how}, {unit} per pp rank: "
                        f"{values}; {100 * spread:.0f}% apart): every other stage waits for pp "
                        f"rank {slow} in every micro-batch",
             "suggestion": fix, "estimated_saving_s": saving}]
