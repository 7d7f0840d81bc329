"""Mixed precision (SPEC F8): the precision policy, dynamic loss scaling agreed by every rank, the
dense model's gradient-norm clipping, and a training step that reduces its small values at once."""

from .clip import clip_grad_norm_, grad_norm_partial
from .loss_scaler import DynamicLossScaler
from .policy import PRECISIONS, PrecisionPolicy, precision_policy, resolve_grad_reduce_dtype
from .step import StepReport, optimizer_step, read_reports

__all__ = ["DynamicLossScaler", "clip_grad_norm_", "grad_norm_partial", "PRECISIONS",
           "PrecisionPolicy", "precision_policy", "resolve_grad_reduce_dtype", "StepReport",
           "optimizer_step", "read_reports"]
