"""``diagnose(model, ctx, step_fn=None) -> list[Diagnostic]``: what is wrong, where, and the fix.

From the model alone (a dense model about to be parallelised at ``ctx.tp_size``, or a parallel one):

- ``not_divisible`` (error): a size the plan splits does not divide by ``tp`` (heads, KV heads,
  FFN, vocabulary — which is ``info`` when the embedding can pad it);
- ``unaligned_dim``: a matmul dimension of a rank that is not a multiple of 64, the Tensor-Core
  tile of 16-bit GEMMs (NVIDIA, *Matrix Multiplication Background User's Guide*: dimensions
  multiple of 64 elements for fp16/bf16 tiles; multiples of 8 are the minimum for Tensor Cores on
  earlier libraries). ``warning`` below a multiple of 8, ``info`` otherwise.

With ``step_fn`` (every rank calls ``diagnose``; the step runs once watched, :mod:`.watch`, then
three times under :func:`~.profile.profile_step`):

- ``implicit_broadcast`` (error): an element-wise operation inside a tensor-parallel region that
  broadcasts a statistic of this rank's slice back over a dimension the plan shards (a per-token
  statistic over the local ``h/tp`` features where the model means all ``h``; a norm or softmax
  over a sharded dimension), with the module, both shapes and the fix (:mod:`.broadcasts`; the
  step runs once more, watched by :class:`~.shards.ShardTracker`). Broadcasts along unsharded
  dimensions, and of tensors that do not come from a shard (rotary tables, masks), are not
  findings;
- ``host_sync`` (warning): ``.item()``, ``.tolist()``, ``.cpu()``, ``print(tensor)``,
  ``torch.cuda.synchronize()`` … inside the model, with the module (or backward node) that did it;
- ``redundant_collective`` (warning): collectives beyond the plan's minimum (the cost model's
  :func:`~ops_transformer.planner.strategies.model_comm_per_step`, reference GPT), the same
  tensor all-reduced twice on a rank, or an all-reduce whose input is already identical on every
  rank of its group (a sum of replicas: redundant, and ``tp`` times the intended value);
- ``small_collectives``: runs of collectives below the small-message threshold (the calibrated
  point-to-point/collective threshold, else Hockney's half-bandwidth size ``α·β``) with no
  computation between them, with the saving of coalescing them (``(n−1)·α``);
- ``exposed_comm``: exposed communication above ``exposed_threshold`` of the step;
- ``load_imbalance``: the ranks' compute differs by more than ``imbalance_threshold``;
- under context parallelism (:mod:`.context_checks`): ``cp_exposed_exchange``, a ring step's
  K/V transfer longer than the attention block it should hide behind, and ``cp_short_sequence``,
  a sequence too short for its ``cp`` (exposed CP communication above the attention it splits),
  each with the step's measured ``cp.*`` traffic.
- ``pp_unbalanced`` (``diagnose`` of a ``--pp`` run, :mod:`.pipeline`): the pipeline stages'
  work differs by more than the imbalance threshold — predicted from the model (the last stage
  also runs the LM head), and measured from the stages' busy times in the diagnosed steps.

The list is sorted by severity, then by estimated saving, and is the same on every rank.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from torch import nn

from ..planner.hardware import CPU_GLOO, HardwareProfile
from .broadcasts import broadcast_checks
from .dims import dimension_checks
from .steps import PROFILED_STEPS, comm_checks

SEVERITIES = ("error", "warning", "info")
# how many times diagnose() calls step_fn: once watched for implicit broadcasts, once watched for
# collectives and syncs, then the profiled steps
STEP_CALLS = 2 + PROFILED_STEPS
CODES = ("not_divisible", "unaligned_dim", "implicit_broadcast", "host_sync", "redundant_collective",
         "small_collectives", "exposed_comm", "load_imbalance", "cp_exposed_exchange",
         "cp_short_sequence", "pp_unbalanced")


@dataclass(frozen=True)
class Diagnostic:
    """One finding: ``code`` (:data:`CODES`), ``severity`` (:data:`SEVERITIES`), ``where`` (a
    module, operator, collective or rank), ``message``, ``suggestion`` and, where the cost model
    or the profile can say, ``estimated_saving_s`` per step."""

    code: str
    severity: str
    where: str
    message: str
    suggestion: str
    estimated_saving_s: float | None = None

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def diagnose(model: nn.Module, ctx, step_fn=None, *, profile: HardwareProfile | None = None,
             exposed_threshold: float = 0.10, imbalance_threshold: float = 0.10,
             small_run: int = 4) -> list[Diagnostic]:
    """Diagnose ``model`` (and one step of ``step_fn`` when given) on this rank of ``ctx``
    (module docstring). ``profile`` gives α, β and the small-message threshold (default: the
    profile the ranks of ``ctx`` agreed on, else the built-in CPU figures); ``small_run`` is the
    number of back-to-back small collectives that counts as frequent."""
    found = [Diagnostic(**d) for d in dimension_checks(model, ctx.tp_size)]
    if step_fn is not None:
        found += [Diagnostic(**d) for d in broadcast_checks(model, ctx, step_fn)]
        found += [Diagnostic(**d) for d in comm_checks(
            model, ctx, step_fn, profile or getattr(ctx, "profile", None) or CPU_GLOO,
            exposed_threshold=exposed_threshold,
            imbalance_threshold=imbalance_threshold, small_run=small_run)]
    return sort_diagnostics(found)


def sort_diagnostics(found: list[Diagnostic]) -> list[Diagnostic]:
    """By severity, then by estimated saving (the same order on every rank)."""
    return sorted(found, key=lambda d: (SEVERITIES.index(d.severity),
                                        -(d.estimated_saving_s or 0.0), d.code, d.where))


def counts(diagnostics: list[Diagnostic]) -> dict[str, int]:
    """``{severity: number}`` for a summary line."""
    got = Counter(d.severity for d in diagnostics)
    return {s: got.get(s, 0) for s in SEVERITIES}
