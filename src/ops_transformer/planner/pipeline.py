"""Pipeline parallelism's terms: the bubble of each schedule, the micro-batches whose activations
the first stage keeps in flight, and the activations sent between stages (SPEC F19).

With ``p`` stages, ``m`` micro-batches per optimizer step and ``v`` model chunks per stage
(interleaved), the idle time of a stage, as a fraction of its busy time ``m · t_stage``:

==================  ====================  ===============================================  =====
schedule            bubble                first stage holds (micro-batches of its layers)  source
==================  ====================  ===============================================  =====
``gpipe``           ``(p−1)/m``           ``m``                                            [1]
``1f1b``            ``(p−1)/m``           ``min(p, m)``                                    [2]
``interleaved``     ``(p−1)/(v·m)``       ``min(p, m)·(1 + (p−1)/(p·v))``                  [2, 3]
``zero_bubble``     ``(p−1)/(3·m)``       ``min(p, m)``                                    [4]
``zbv``             ``0``                 ``min(p, m)``                                    [4]
==================  ====================  ===============================================  =====

[1] Huang et al. 2019 (GPipe). [2] Narayanan et al. 2021 (Megatron-LM, SC'21), §2.2.1–2.2.2.
[3] Korthikanti et al. 2022, §4.2.3 (the interleaved schedule's extra in-flight memory).
[4] Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (ICLR): splitting the backward into its
input- and weight-gradient parts, ZB-H1 keeps 1F1B's memory with about a third of its bubble;
ZB-V (two chunks per stage in a V shape) reaches a zero bubble at 1F1B's peak memory, in the
ideal where forward, input- and weight-gradient passes take equal time.

The schedules are ``torch.distributed.pipelining``'s (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``).
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")


def check_schedule(schedule: str, pp: int, virtual: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if pp < 1 or virtual < 1:
        raise ValueError(f"pp ({pp}) and virtual stages ({virtual}) must be at least 1")
    if schedule == "zbv" and virtual != 2:
        raise ValueError(f"the zbv schedule runs 2 chunks per stage, got virtual stages "
                         f"{virtual}")


def bubble_fraction(schedule: str, pp: int, micro_batches: int, virtual: int = 1) -> float:
    """The pipeline's idle time over its busy time (table above); 0 for one stage."""
    check_schedule(schedule, pp, virtual)
    if pp == 1:
        return 0.0
    m = micro_batches
    return {"gpipe": (pp - 1) / m, "1f1b": (pp - 1) / m, "interleaved": (pp - 1) / (virtual * m),
            "zero_bubble": (pp - 1) / (3 * m), "zbv": 0.0}[schedule]


def in_flight_micro_batches(schedule: str, pp: int, micro_batches: int, virtual: int = 1) -> float:
    """Micro-batches of the first stage's layers whose activations are live at its peak (table
    above); ``1`` without pipelining."""
    check_schedule(schedule, pp, virtual)
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(micro_batches)
    warm = float(min(pp, micro_batches))
    if schedule == "interleaved":
        return warm * (1 + (pp - 1) / (pp * virtual))
    return warm


def stage_layers(layers: int, pp: int) -> int:
    """Layers of the largest stage (the layers spread as evenly as they divide)."""
    return -(-layers // pp)


def boundary_elements(micro_batch: int, seq: int, hidden: int, *, tp: int = 1, cp: int = 1,
                      scatter: bool = True) -> int:
    """Elements of one activation (or its gradient) sent from one stage to the next per
    micro-batch: ``b·(s/cp)·h``, over ``tp`` when the ranks of a TP group each send their slice
    (Megatron's scatter/gather optimisation, Narayanan et al. 2021 §4.1; sequence parallelism
    gives the same split)."""
    return micro_batch * (seq // cp) * hidden // (tp if scatter else 1)


def stage_flops_per_token(model, stages: int) -> list[float]:
    """Training FLOPs per token of each of ``stages`` equal runs of ``model``'s layers (a
    :class:`~.specs.ModelSpec`), the last one with the LM head: ``6·V·h`` per token on top of
    its layers' share of :meth:`~.specs.ModelSpec.flops_per_token` (the embedding lookup does not
    count). The first and the last stage are the ones an equal split leaves unequal."""
    if stages < 1 or model.layers % stages:
        raise ValueError(f"{stages} stages do not split the model's {model.layers} layers "
                         f"into equal runs")
    head = 6.0 * model.vocab * model.hidden
    per_layer = (model.flops_per_token() - head) / model.layers
    layers = model.layers // stages
    return [layers * per_layer + (head if s == stages - 1 else 0.0) for s in range(stages)]
