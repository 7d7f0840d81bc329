"""How close a parallel run must come to the dense one, per compute dtype, and the measures used.

Every difference is **relative to the reference tensor's largest entry**:
``rel = max|parallel − reference| / max|reference|`` (per-element ratios blow up where the reference
is near zero; a reordered sum errs in proportion to the magnitudes it adds). Gradients (of
parameters and of module outputs) take a floor: their scale is at least 1 % of the largest
gradient of their kind in the model, so a tensor whose gradient is pure rounding noise (a key bias
under softmax, a parameter the loss barely reaches) is not judged against its own noise.

The bounds (``docs/parity.md`` lists what was measured against them):

========= ======= ========= ======= ========== ========================================================
precision output  gradients loss    logits KL  why
========= ======= ========= ======= ========== ========================================================
fp32      1e-5    1e-4      1e-5    1e-9       reordered fp32 sums (ulp 6e-8) through a few layers;
                                               gradients pass twice as many reductions, and softcapped
                                               tiny models reach ~2e-5 (the zoo's own bound)
bf16      5e-2    1e-1      1e-2    1e-3       8-bit mantissa (ulp 4e-3): a TP all-reduce rounds its
                                               partial sums to bf16 once more than the dense matmul
fp16      1e-2    5e-2      2e-3    1e-4       11-bit mantissa (ulp 5e-4), same extra rounding
========= ======= ========= ======= ========== ========================================================

The losses of ``steps`` optimizer steps are held to the loss bound times the number of the step
(rounding differences grow as the weights drift apart).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

GRAD_FLOOR = 1e-2  # a gradient's scale is at least this share of the largest gradient of its kind


@dataclass(frozen=True)
class Tolerance:
    output: float
    grad: float
    loss: float
    kl: float

    def to_dict(self) -> dict:
        return asdict(self)


TOLERANCES = {
    "fp32": Tolerance(output=1e-5, grad=1e-4, loss=1e-5, kl=1e-9),
    "bf16": Tolerance(output=2e-2, grad=5e-2, loss=5e-3, kl=1e-4),
    "fp16": Tolerance(output=5e-3, grad=1e-2, loss=1e-3, kl=1e-5),
}


def tolerance_for(precision: str, override: float | None = None) -> Tolerance:
    """The bounds of ``precision``; ``override`` replaces the output bound and scales the others
    in proportion."""
    if precision not in TOLERANCES:
        raise ValueError(f"precision must be one of {tuple(TOLERANCES)}, got {precision!r}")
    tol = TOLERANCES[precision]
    if override is None:
        return tol
    if not override > 0:
        raise ValueError(f"tolerance must be positive, got {override}")
    f = override / tol.output
    return Tolerance(output=override, grad=tol.grad * f, loss=tol.loss * f, kl=tol.kl * f * f)


@torch.no_grad()
def difference(actual: torch.Tensor, expected: torch.Tensor,
               floor: float = 0.0) -> tuple[float, float]:
    """``(max abs difference, relative difference)``; the relative one divides by the larger of
    ``max|expected|`` and ``floor``. Shapes must agree; a NaN or inf that the reference does not
    have is an infinite difference."""
    a = actual.detach().double()
    e = expected.detach().double().to(a.device)
    if a.shape != e.shape:
        raise ValueError(f"shape {tuple(a.shape)} != reference {tuple(e.shape)}")
    if a.numel() == 0:
        return 0.0, 0.0
    bad = ~torch.isfinite(a) & torch.isfinite(e)
    if bool(bad.any()):
        return float("inf"), float("inf")
    diff = (a - e).nan_to_num(0.0, 0.0, 0.0).abs().max().item()
    scale = max(e.nan_to_num(0.0, 0.0, 0.0).abs().max().item(), floor, 1e-30)
    return diff, diff / scale


@torch.no_grad()
def logits_kl(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``KL(softmax(expected) ‖ softmax(actual))`` over the last dimension, averaged over every
    other position (in float64)."""
    log_p = torch.log_softmax(expected.detach().double(), -1)
    log_q = torch.log_softmax(actual.detach().double().to(log_p.device), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return float(kl.mean()) if kl.numel() else 0.0
