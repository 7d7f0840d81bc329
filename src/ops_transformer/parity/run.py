"""Running one side of a parity check: the inputs split into micro-batches, a forward whose
loss is the model's own (or a fixed one), a backward, optimizer steps.

Both sides run the same schedule. With ``n = dp × ep`` data ranks the global batch is split into
``n`` micro-batches by rows; data rank ``i`` of the parallel model runs micro-batch ``i``, and the
dense reference runs all ``n`` one after another and averages their gradients — what the parallel
model's data-parallel averaging computes (and, for a mixture of experts with a capacity, the same
routing: capacity is per micro-batch on both sides).

Dropout is off on both sides (:func:`prepare`): a mask drawn on a shard cannot equal the dense
one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from ..layers.dropout import ParallelDropout
from .noise import rounding_noise
from .record import Call, Recorder

TARGET_SEED = 2  # the fixed random target of the default loss


def as_call_inputs(inputs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from a tuple of positional arguments, or a dict of keyword arguments."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise ValueError(f"inputs must be a tuple of positional arguments for the model's forward "
                     f"(or a dict of keyword arguments), got {type(inputs).__name__}")


def batch_size(inputs) -> int | None:
    """The batch: the first dimension of the first tensor input."""
    args, kwargs = as_call_inputs(inputs)
    first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)
                  and t.dim()), None)
    return None if first is None else first.shape[0]


def micro_batch(inputs, n: int, i: int):
    """Rows ``[i·B/n, (i+1)·B/n)`` of every tensor input whose first dimension is the batch."""
    args, kwargs = as_call_inputs(inputs)
    if n == 1:
        return args, kwargs
    b = batch_size(inputs)
    if b is None or b % n:
        raise ValueError(f"the batch ({b}) must divide by the number of data-parallel ranks "
                         f"dp × ep ({n}): each runs its own rows")
    rows = b // n

    def part(t):
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == b:
            return t[i * rows:(i + 1) * rows]
        return t

    return tuple(part(a) for a in args), {k: part(v) for k, v in kwargs.items()}


def call_model(model: nn.Module, inputs: tuple[tuple, dict]):
    args, kwargs = inputs
    device = next((p.device for p in model.parameters()), None)
    if device is not None:
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return model(*args, **kwargs)


def default_loss(output) -> torch.Tensor:
    """The model's own loss — a ``loss`` attribute (Hugging Face, with ``labels``) or the second
    element of a ``(logits, loss)`` tuple (the reference GPT, with targets) — else the mean-square
    distance of its first output tensor to a fixed random target (whose gradient, unlike the
    output's own mean square, is not rounding noise)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)) and len(output) > 1:
        loss = output[1] if isinstance(output[1], torch.Tensor) and output[1].dim() == 0 else None
    if isinstance(loss, torch.Tensor):
        return loss
    out = primary_output(output)
    if out is None:
        raise ValueError(f"cannot find a loss or an output tensor in the model's output "
                         f"({type(output).__name__}); pass loss_fn=")
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(TARGET_SEED))
    return (out.float() - target.to(out.device)).square().mean()


def primary_output(output) -> torch.Tensor | None:
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _no_dropout_attributes(obj) -> None:
    for key, value in list(vars(obj).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(obj, key, 0.0)


def prepare(model: nn.Module) -> nn.Module:
    """Train mode, dropout off: every dropout module's ``p``, every float attribute of a module
    named ``*dropout*`` / ``*pdrop*`` (Hugging Face attention's ``attention_dropout``) and the
    same entries of a Hugging Face config and its sub-configs set to 0."""
    model.train()
    for m in model.modules():
        if isinstance(m, (nn.modules.dropout._DropoutNd, ParallelDropout)):
            m.p = 0.0
        _no_dropout_attributes(m)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        for sub in [config] + [v for v in vars(config).values() if hasattr(v, "to_dict")]:
            _no_dropout_attributes(sub)
    return model


@dataclass
class Schedule:
    """What both sides run: ``steps`` optimizer steps (0: one forward and backward, no step) of
    SGD at ``lr``, under ``autocast`` (a context factory), with ``loss_fn``."""

    micro_batches: int
    steps: int = 0
    lr: float = 0.1
    loss_fn: object = default_loss
    autocast: object = None  # None: fp32

    def in_fp32(self) -> Schedule:
        """The same schedule without autocast, one step (the rounding-noise reference)."""
        return dataclasses.replace(self, steps=0, autocast=None)

    def forward(self, model, inputs):
        with (self.autocast() if self.autocast else contextlib.nullcontext()):
            output = call_model(model, inputs)
            return output, self.loss_fn(output)


@dataclass
class Reference:
    """The dense run (on one rank): the record of micro-batch 0, the initial weights, the averaged
    gradients of the first step, the loss of every step."""

    calls: list[Call]
    init: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    losses: list[float] = field(default_factory=list)
    noise: dict = field(default_factory=dict)  # 16-bit runs: the dense model's own rounding

    def meta(self) -> list[dict]:
        """Shapes and names the other ranks need to lay their tensors out like these."""
        return [{"key": c.key, "name": c.name, "index": c.index, "paths": c.paths,
                 "inputs": [tuple(t.shape) for t in c.inputs],
                 "outputs": [tuple(t.shape) for t in c.outputs],
                 "grads": [p in c.grads for p in c.paths]} for c in self.calls]


def run_reference(build_model, inputs, schedule: Schedule) -> Reference:
    """The dense run, on this rank only (micro-batch by micro-batch). Under autocast the dense
    model runs a second time in fp32, and how far its own 16-bit run lands from that is kept as
    each tensor's rounding noise (:func:`.noise.rounding_noise`); both builds start from the
    same random state."""
    if schedule.autocast is None:
        return _run_dense(build_model, inputs, schedule)

    with restoring_rng():
        exact = _run_dense(build_model, inputs, schedule.in_fp32())
    reference = _run_dense(build_model, inputs, schedule)
    reference.noise = rounding_noise(reference, exact)
    return reference


def _run_dense(build_model, inputs, schedule: Schedule) -> Reference:
    model = prepare(build_model())
    params = dict(model.named_parameters())
    init = {k: p.detach().clone() for k, p in params.items()}
    recorder = Recorder(model)
    opt = torch.optim.SGD(model.parameters(), lr=schedule.lr) if schedule.steps else None
    n, grads, losses = schedule.micro_batches, {}, []
    try:
        for step in range(max(schedule.steps, 1)):
            total = 0.0
            for i in range(n):
                with recorder.recording(step == 0 and i == 0):
                    _, loss = schedule.forward(model, micro_batch(inputs, n, i))
                loss.backward()
                total += float(loss.detach()) / n
            for p in params.values():
                if p.grad is not None and n > 1:
                    p.grad.div_(n)
            if step == 0:
                grads = {k: (p.grad.detach().clone() if p.grad is not None
                             else torch.zeros_like(p)) for k, p in params.items()}
            losses.append(total)
            if opt is not None:
                opt.step()
                opt.zero_grad()
    finally:
        recorder.remove()
    return Reference(recorder.calls, init, grads, losses)


@contextlib.contextmanager
def restoring_rng():
    """The global random state (CPU and CUDA) as it was on entry, once the block ends."""
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
