"""Learning-rate schedules of ``train`` (``--lr-schedule {constant,cosine} --warmup STEPS``).

The rate of a step is a pure function of the step, so a resumed run follows the same schedule::

    warmup:    lr · (step + 1) / warmup                      for step < warmup
    constant:  lr
    cosine:    lr · ½ (1 + cos(π · (step − warmup) / (steps − warmup)))    decaying towards 0

(linear warmup, then the cosine decay of Loshchilov & Hutter 2017, SGDR, without restarts).
"""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine")


def check_schedule(schedule: str, warmup: int, steps: int) -> None:
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got "
                         f"{schedule!r}")
    if warmup < 0:
        raise ValueError(f"--warmup must be at least 0 steps, got {warmup}")
    if warmup >= steps and warmup > 0:
        raise ValueError(f"--warmup ({warmup}) must be shorter than --steps ({steps})")


def lr_at(step: int, *, lr: float, steps: int, schedule: str = "constant",
          warmup: int = 0) -> float:
    """The learning rate of step ``step`` (0-based) of a run of ``steps`` steps."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    progress = (step - warmup) / max(steps - warmup, 1)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
