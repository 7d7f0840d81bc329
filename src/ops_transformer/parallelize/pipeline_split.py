"""Where each pipeline stage sits and which layers it holds: pure logic, no process group.

``pp`` ranks hold ``pp × v`` stages (``v = stages_per_rank``), each an equal run of consecutive
layers; the embedding goes with stage 0, the final norm and the head with the last stage. Stages
are placed on the ``pp`` ranks in a loop (stage ``k`` on rank ``k mod pp``: GPipe, 1F1B,
interleaved 1F1B, looped BFS, interleaved zero-bubble) or in a V (``zbv``: rank ``r`` holds
stages ``r`` and ``2·pp − 1 − r``, so the first and the last stage share rank 0)::

    loop, pp 2, v 2:  rank 0: stages 0, 2    rank 1: stages 1, 3
    V,    pp 2, v 2:  rank 0: stages 0, 3    rank 1: stages 1, 2

:func:`check_pipeline` is what every entry point (``ot.pipeline``, ``train --pp``) calls before any
rank starts, so a split the layers do not divide is a one-line ``ValueError``, never a hang.
"""

from __future__ import annotations

# schedule name -> (torch.distributed.pipelining class, stages per rank, placement)
from ..schema.choices import PIPELINE_SCHEDULES as SCHEDULES


def check_pipeline(n_layers: int, pp: int, *, schedule: str = "1f1b", microbatches: int = 1,
                   stages_per_rank: int = 1) -> None:
    """Raise a one-line ``ValueError`` naming the value when ``pp`` stages of ``schedule`` with
    ``stages_per_rank`` each cannot split ``n_layers`` layers into equal runs, or ``microbatches``
    does not suit the schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    for name, value in (("pp", pp), ("microbatches", microbatches),
                        ("stages_per_rank", stages_per_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    _, per_rank, placement = SCHEDULES[schedule]
    v = stages_per_rank
    if per_rank == "one" and v != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank, got stages_per_rank {v}; "
                         f"use 'interleaved', 'looped_bfs' or 'zero_bubble' for several")
    if placement == "v" and v != 2:
        raise ValueError(f"schedule {schedule!r} places exactly 2 stages per rank (a V), got "
                         f"stages_per_rank {v}")
    stages = pp * v
    if stages > n_layers:
        raise ValueError(f"pp ({pp}) × stages_per_rank ({v}) = {stages} stages, more than the "
                         f"model's {n_layers} layers")
    if n_layers % stages:
        raise ValueError(f"pp ({pp}) × stages_per_rank ({v}) = {stages} stages do not divide the "
                         f"model's {n_layers} layers into equal runs")
    if per_rank == "many" and microbatches % pp:
        raise ValueError(f"schedule {schedule!r} needs microbatches ({microbatches}) to be a "
                         f"multiple of pp ({pp})")
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(f"schedule '1f1b' needs at least as many microbatches as stages "
                         f"({pp}), got {microbatches}")


def stage_layers(n_layers: int, n_stages: int, stage: int) -> range:
    """The layers of ``stage``: an equal run of consecutive ones."""
    per = n_layers // n_stages
    return range(stage * per, (stage + 1) * per)


def stage_rank(stage: int, pp: int, placement: str) -> int:
    """The ``pp`` rank that holds ``stage`` (module docstring)."""
    if placement == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def rank_stages(pp_rank: int, pp: int, stages_per_rank: int, placement: str) -> list[int]:
    """The stages ``pp_rank`` holds, in increasing order."""
    return [s for s in range(pp * stages_per_rank) if stage_rank(s, pp, placement) == pp_rank]
