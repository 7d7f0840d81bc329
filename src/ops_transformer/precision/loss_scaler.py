"""Dynamic loss scaling for fp16, agreed by every rank of the job.

fp16 flushes gradients below 2⁻²⁴ to zero, so the loss is multiplied by a scale ``S`` before
backward and the gradients divided by ``S`` before the optimizer step (Micikevicius et al. 2018).
Too large an ``S`` overflows some gradient to inf/NaN: the step is skipped and ``S`` shrinks;
after ``growth_interval`` clean steps ``S`` grows again.

Under tensor and data parallelism each rank sees only its shards and its micro-batch, so one rank
can overflow while the others do not. If that rank alone skipped the step, its shards would fall
behind and the replicas would silently diverge. Here the overflow flag is reduced with MAX over
**every** rank of the job (TP, DP and EP together) before anyone steps, so all ranks skip
together and all scales stay equal.

The schedule is Megatron-Core's ``DynamicGradScaler``: an overflow resets the clean-step count
and decrements a hysteresis counter; when that counter reaches 0 the scale is multiplied by
``backoff`` (never below ``min_scale``), and every further overflow backs off again until a
growth. ``growth_interval`` consecutive clean steps multiply the scale by ``growth`` and reset
the hysteresis counter.

The loop, with or without gradient clipping in between::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)            # optional: only to clip or inspect unscaled gradients
    ot.clip_grad_norm_(model, 1.0, ctx)
    stepped = scaler.step(optimizer)      # one all-reduce of one element (MAX over the job)
    scaler.update()

``step`` reads the gradients from ``optimizer.param_groups`` (so it works for any optimizer that
exposes them, a sharded one included). Without clipping it agrees on the flag with one all-reduce
of one element. After ``unscale_`` the gradients carry the scaler that unscaled them, and
:func:`~ops_transformer.precision.clip_grad_norm_` — a job-wide reduction anyway — carries the
flag in its own all-reduce, so ``step`` then communicates nothing: the loop above sends one small
collective, not two. :func:`~ops_transformer.precision.optimizer_step` packs the flag with the
norm and the logged metrics the same way (``found_inf=``).
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from ..parallel.sharding import local_tensor


def optimizer_grads(optimizer) -> list[torch.Tensor]:
    """The gradients of the parameters in ``optimizer.param_groups`` (each parameter once)."""
    params = dict.fromkeys(p for group in optimizer.param_groups for p in group["params"])
    return [local_tensor(p.grad) for p in params if p.grad is not None]  # (a shard's own rows)


class DynamicLossScaler:
    """The loss scale of fp16 training, with overflow checks agreed by every rank (see the module
    docstring). ``scale_value`` is the current scale; ``skipped_steps`` counts skipped steps."""

    def __init__(self, ctx, init_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                 hysteresis: int = 2, min_scale: float = 1.0, backoff: float = 0.5,
                 growth: float = 2.0):
        if not min_scale > 0:
            raise ValueError(f"min_scale must be positive, got {min_scale}")
        if not init_scale >= min_scale:
            raise ValueError(f"init_scale ({init_scale}) must be at least min_scale ({min_scale})")
        if not 0 < backoff < 1:
            raise ValueError(f"backoff must be in (0, 1), got {backoff}")
        if not growth > 1:
            raise ValueError(f"growth must be greater than 1, got {growth}")
        for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.ctx = ctx
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.min_scale, self.backoff, self.growth = float(min_scale), float(backoff), float(growth)
        self._scale = float(init_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis
        self.skipped_steps = 0
        self._local_inf: torch.Tensor | None = None  # this rank's flag, once unscaled
        self._agreed: bool | None = None  # the job's flag, once agreed (in step or a clip)
        self._found_inf: bool | None = None  # the flag this step acted on, once stepped

    @property
    def scale_value(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss × scale``: call ``backward()`` on this."""
        return loss * self._scale

    def unscale_(self, optimizer) -> torch.Tensor:
        """Divide the gradients in ``optimizer.param_groups`` by the scale, in place, and return
        this rank's overflow flag (a one-element float32 tensor, 1 when a gradient is inf or NaN).
        No communication. At most once per step; ``step`` calls it when you did not."""
        if self._local_inf is not None:
            raise RuntimeError("unscale_() was already called for this step; call step() and "
                               "update() before unscaling again")
        grads = optimizer_grads(optimizer)
        inverse = 1.0 / self._scale
        flags = []
        for g in grads:
            g.mul_(inverse)
            flags.append(torch.logical_not(torch.isfinite(g)).any())
        device = grads[0].device if grads else self.ctx.device
        found = torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool,
                                                                    device=device)
        self._local_inf = found.to(torch.float32).reshape(1)
        for g in grads:  # a reduction over the job that sees them can agree on the flag
            g.unscaled_by = self
        return self._local_inf

    @property
    def local_found_inf(self) -> torch.Tensor | None:
        """This rank's overflow flag since ``unscale_`` (``None`` before), not yet reduced."""
        return self._local_inf

    @property
    def awaits_agreement(self) -> bool:
        """Unscaled, with this rank's flag not yet agreed by every rank."""
        return self._local_inf is not None and self._agreed is None

    def agree_found_inf(self, found_inf: bool) -> None:
        """Record the overflow flag every rank agreed on (reduced by the caller over the job)."""
        self._agreed = bool(found_inf)

    def step(self, optimizer, *, found_inf: bool | torch.Tensor | None = None) -> bool:
        """Unscale (if not done), agree on overflow and step only if no rank overflowed. Returns
        whether the optimizer stepped.

        The agreement is one all-reduce of one element (MAX over every rank of the job).
        ``found_inf`` skips it: pass the flag already agreed by every rank — e.g. reduced with
        other small values in one coalesced all-reduce."""
        if self._found_inf is not None:
            raise RuntimeError("step() was already called for this step; call update() first")
        if self._local_inf is None:
            self.unscale_(optimizer)
        if found_inf is None:
            found_inf = self._agreed
        if found_inf is None:
            flag = self._local_inf.clone()
            C.all_reduce(flag, self.ctx.world_group, op=C.ReduceOp.MAX, label="found_inf")
            found_inf = flag
        self._found_inf = bool(found_inf > 0) if torch.is_tensor(found_inf) else bool(found_inf)
        if self._found_inf:
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Adjust the scale after ``step`` (the hysteresis / growth rule of the module
        docstring)."""
        if self._found_inf is None:
            raise RuntimeError("update() needs the overflow check of this step: call "
                               "step(optimizer) first")
        if self._found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale *= self.growth
        self._local_inf = self._agreed = self._found_inf = None

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state)
        if missing:
            raise ValueError(f"DynamicLossScaler state is missing {sorted(missing)}; it has "
                             f"{sorted(state)}")
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._local_inf = self._agreed = self._found_inf = None

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self._scale:g}, growth_tracker="
                f"{self._growth_tracker}/{self.growth_interval}, hysteresis_tracker="
                f"{self._hysteresis_tracker}/{self.hysteresis}, skipped_steps="
                f"{self.skipped_steps})")
