"""Which combinations of layout options ``train`` (and ``parallelize``) can run: the one rule the
planner's search and the runtime's checks share, so that the planner never proposes a plan that
``train --plan`` must change or refuse.

The sizes that must divide (heads, FFN width, the batch) are the search's
(:func:`~.search.layout_problem`); this rule covers how the options combine:

=============================  ===============================================================
option                         runs with
=============================  ===============================================================
sequence parallelism           ``tp > 1``, ``attention="heads"`` (the one strategy with a
                               sequence-parallel form), the sequence divisible by ``tp`` (an
                               MoE layer runs on the gathered sequence:
                               ``layers.regions.FullSequenceRegion``)
ZeRO stage 1, 2 or 3           ``dp × ep × cp > 1`` (each parameter sharded over its own
                               data-parallel group: ``dp × ep × cp`` for the dense ones, ``dp``
                               for the experts; stage 3 through FSDP2)
``recompute="selective"``      not with ``attention="kv_split"`` at ``tp > 1`` (its attention
                               core communicates)
``pp > 1``                     the reference GPT and Hugging Face decoders with TP, dp,
                               ZeRO-1/2/3, sequence parallelism and recompute inside each stage
                               (``parallelize.pipeline``); not yet with MoE / ``ep > 1`` or
                               ``cp > 1``
``cp > 1``                     ``train --cp`` (SPEC F18), with sequence parallelism (each
                               rank's ``s/cp`` tokens split over ``tp``), recompute and ZeRO
                               (over ``dp × ep × cp``), ``heads`` attention; not yet with MoE
                               (the search proposes cp; ``train --plan`` runs it)
=============================  ===============================================================

Messages name the command-line flags, which ``train`` and ``plan`` share.
"""

from __future__ import annotations

from ..schema.choices import ZERO_STAGES

SEQUENCE_PARALLEL_ATTENTION = ("auto", "heads")  # "auto" becomes "heads" under SP


def runtime_problem(*, tp: int, dp: int, ep: int = 1, pp: int = 1, cp: int = 1,
                    attention: str = "heads",
                    sequence_parallel: bool = False, recompute: str = "none",
                    zero_stage: int = 0, experts: int = 1, seq: int | None = None,
                    model: str = "the model") -> str | None:
    """Why ``train`` cannot run this combination, or ``None`` when it can."""
    if pp > 1:
        problem = _pipeline_problem(pp, ep=ep, experts=experts, sequence_parallel=sequence_parallel,
                                    recompute=recompute, zero_stage=zero_stage, model=model)
        if problem:
            return problem
        if cp > 1:
            return f"--pp {pp} does not combine with --cp yet: drop one of them"
        if tp > 1 and experts > 1:
            return (f"--pp {pp} does not split an MoE preset at --tp {tp} yet: use --tp 1 "
                    f"(--ep inside each stage works)")
    if cp > 1:
        if attention not in SEQUENCE_PARALLEL_ATTENTION:
            return f"--cp {cp} splits the tokens of --attention heads (or auto), got {attention!r}"
    if zero_stage not in ZERO_STAGES:
        return f"--zero must be 0, 1, 2 or 3, got {zero_stage!r}"
    if zero_stage and dp * ep * cp == 1:
        what = "" if zero_stage == 3 else "the optimizer "  # ZeRO-3 shards the parameters too
        return (f"--zero {zero_stage} shards {what}over data-parallel ranks, but dp is 1: run "
                f"more processes than --tp ({tp}), or drop --zero")
    if sequence_parallel:
        if tp == 1:
            return ("--sequence-parallel splits the sequence over tensor-parallel ranks, but tp "
                    "is 1: set --tp 2 or more, or drop --sequence-parallel")
        if seq is not None and cp > 1 and (seq // cp) % tp:
            return (f"--sequence-parallel with --cp splits each rank's s/cp = {seq // cp} "
                    f"tokens over tp ({tp}): the sequence length s ({seq}) must be divisible by "
                    f"cp × tp ({cp * tp})")
        if seq is not None and seq % tp:
            return (f"--sequence-parallel splits the sequence over tp ({tp}) ranks: the sequence "
                    f"length s ({seq}) must be divisible by tp ({tp})")
        if attention not in SEQUENCE_PARALLEL_ATTENTION:
            return f"--sequence-parallel needs --attention heads (or auto), got {attention!r}"
    if recompute == "selective" and attention == "kv_split" and tp > 1:
        return ("--recompute selective replays the attention core, which --attention kv_split "
                "spreads over the ranks with communication: use --recompute full or another "
                "attention strategy")
    return None


def _pipeline_problem(pp: int, *, ep: int, experts: int, sequence_parallel: bool, recompute: str,
                      zero_stage: int, model: str) -> str | None:
    """What ``train --pp`` does not combine with yet (docs/pipeline.md)."""
    # (ZeRO-1/2 run per stage: the optimizer shards over each stage's dp; ZeRO-3: FSDP2 with
    # each stage module a root, its syncs driven by pipelining)
    # (MoE, --ep inside each stage: each stage adds its layers' load-balancing loss, routed per
    # micro-batch as one process with --grad-accum m routes it: parallelize/pipeline_moe.py)
    return None
