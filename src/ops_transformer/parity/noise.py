"""The dense model's own rounding in 16-bit precision: how far its bf16 (or fp16) run lands from
its fp32 run, tensor by tensor.

A tensor-parallel run rounds at different places than the dense one (a partial sum per rank, then
an all-reduce in 16 bits), so in 16-bit precision the two differ by about as much as either differs
from exact arithmetic — which grows through the layers, and is large wherever a near-tie decides
something discrete (a mixture of experts' top-k routing flips for a near-tied token). A fixed bound
is either too tight for a deep layer or too loose for the first one. So each comparison in 16 bits
is held to ``max(the precision's bound, NOISE_FACTOR × the dense model's own 16-bit-vs-fp32
difference of that tensor)`` — measured, not guessed. In fp32 the bounds are fixed.
"""

from __future__ import annotations

from .record import ROOT
from .tolerance import GRAD_FLOOR, difference, logits_kl

LOGITS_PATHS = ("logits", "0")  # where a model's output holds its logits

NOISE_FACTOR = 8.0  # measured: a TP run's 16-bit error is at most ~5× the dense one's (docs)


def _rel(a, b, floor=0.0) -> float | None:
    try:
        return difference(a, b, floor)[1]
    except ValueError:
        return None


def rounding_noise(low, exact) -> dict:
    """``{("output" | "input" | "grad", call key): rel, ("param", name): rel, "loss": rel,
    "kl": KL}`` of
    the 16-bit reference ``low`` against the fp32 one ``exact`` (each a ``Reference``)."""
    noise = {}
    exact_calls = {c.key: c for c in exact.calls}
    grads = [g for c in exact.calls for g in c.grads.values() if g.numel()]
    floor = GRAD_FLOOR * max((float(g.abs().max()) for g in grads), default=0.0)
    for call in low.calls:
        other = exact_calls.get(call.key)
        if other is None:
            continue
        for kind, mine, theirs, f in (
                ("output", call.outputs, other.outputs, 0.0),
                ("input", call.inputs, other.inputs, 0.0),
                ("grad", [call.grads.get(p) for p in call.paths],
                 [other.grads.get(p) for p in call.paths], floor)):
            values = [_rel(a, b, f) for a, b in zip(mine, theirs)
                      if a is not None and b is not None]
            values = [v for v in values if v is not None]
            if values:
                noise[(kind, call.key)] = max(values)
    pfloor = GRAD_FLOOR * max((float(g.abs().max()) for g in exact.grads.values() if g.numel()),
                              default=0.0)
    for name, g in low.grads.items():
        if name in exact.grads:
            noise[("param", name)] = _rel(g, exact.grads[name], pfloor)
    noise["loss"] = abs(low.losses[0] - exact.losses[0]) / max(abs(exact.losses[0]), 1e-30)
    root, exact_root = (next((c for c in r.calls if c.name == ROOT), None) for r in (low, exact))
    if root is not None and exact_root is not None and root.outputs and exact_root.outputs:
        path = next((p for p in LOGITS_PATHS if p in root.paths and p in exact_root.paths), None)
        if path is not None and root.outputs[root.paths.index(path)].dim() >= 2:
            noise["kl"] = logits_kl(root.outputs[root.paths.index(path)],
                                    exact_root.outputs[exact_root.paths.index(path)])
    return noise


def bound(noise: dict, key, fixed: float) -> float:
    """The bound of one comparison: the fixed one, or the measured noise times the factor (its
    square for the KL divergence, which grows with the square of a difference)."""
    value = noise.get(key)
    factor = NOISE_FACTOR ** 2 if key == "kl" else NOISE_FACTOR
    return fixed if value is None else max(fixed, factor * value)
