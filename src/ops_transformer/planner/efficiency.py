"""Achieved matmul efficiency per GPU and software stack, and the other fitted constants of the
time and memory model — each with where it comes from.

The efficiency is the fraction of the dense peak (:mod:`.catalogue`) that a large, square GEMM
of the stack reaches: the *ceiling* of the per-GEMM roofline (:mod:`.roofline`), which lowers it
for each matrix by its tile and wave quantisation and bounds it by the bytes the GEMM moves. It is an input of the planner, not a constant: ``plan --efficiency 0.45``
overrides it, a calibration on a GPU (``ops-transformer calibrate`` on a CUDA machine, see
:mod:`ops_transformer.profiler.calibrate`) supplies a measured one for that card, and otherwise the defaults below apply:
per GPU, and per ``(GPU, stack)`` when ``--stack`` names the software that will run the job.

The defaults are **fitted** by :func:`ops_transformer.planner.published.fit` on the ``fit`` rows of
``planner/data/published_runs.json`` — published runs of Megatron-LM (Narayanan et al. 2021,
Table 1), MosaicML llm-foundry (its benchmarking README) and torchtitan (its performance docs) —
and checked on the ``holdout`` rows (``ops-transformer plan --published``, docs/planner.md).
``tests/planner/test_planner_published.py`` re-runs the fit and fails if these numbers drift from it.
A card with no published run gets the figure of the card with the same compute die, or the median
of the fitted cards, as its ``source`` says.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

STACKS = ("megatron", "llm-foundry", "torchtitan", "llama3")
FIT = "fitted on the 'fit' rows of planner/data/published_runs.json"


@dataclass(frozen=True)
class Efficiency:
    value: float
    source: str


# Fitted by `ops-transformer plan --published --fit` (see the module docstring).
FITTED_BY_GPU: dict[str, float] = {'a100-40gb': 0.7, 'a100-80gb': 0.7, 'h100-sxm': 0.504, 'h100-sxm-96gb': 0.444}
FITTED_BY_STACK: dict[tuple[str, str], float] = {
    ('a100-40gb', 'llm-foundry'): 0.704,
    ('a100-40gb', 'megatron'): 0.733,
    ('a100-40gb', 'torchtitan'): 0.647,
    ('a100-80gb', 'llm-foundry'): 0.704,
    ('a100-80gb', 'megatron'): 0.733,
    ('a100-80gb', 'torchtitan'): 0.647,
    ('h100-sxm', 'llm-foundry'): 0.504,
    ('h100-sxm-96gb', 'torchtitan'): 0.444}
# The ceiling of the layers' projections run as Float8 (torchtitan's Float8 linears with
# torch.compile), as a fraction of the card's dense FP8 peak.
FITTED_FLOAT8_BY_GPU: dict[str, float] = {'h100-sxm-96gb': 0.475}
MEMORY_PASSES = 3.89  # passes over the activation bytes by memory-bound kernels
ATTENTION_RATIO = 0.41  # the attention core's achieved efficiency ÷ the projections'

# Cards that share a compute die with a fitted one (same SMs and clocks; only memory differs).
SAME_DIE = {"a100-40gb": "a100-80gb", "a100-80gb": "a100-40gb", "h200": "h100-sxm"}


def default_efficiency(gpu: str, stack: str | None = None,
                       precision: str = "default") -> Efficiency:
    """The planner's efficiency for ``gpu`` (a catalogue name) run by ``stack`` (one of
    :data:`STACKS`, or ``None`` for any); with ``precision="float8"`` the ceiling of Float8
    projections against the FP8 peak (the median of the fitted cards where ``gpu`` has none)."""
    if stack is not None and stack not in STACKS:
        raise ValueError(f"stack must be one of {STACKS}, got {stack!r}")
    if precision == "float8":
        if gpu in FITTED_FLOAT8_BY_GPU:
            return Efficiency(FITTED_FLOAT8_BY_GPU[gpu], f"{FIT} for {gpu} with Float8")
        twin = SAME_DIE.get(gpu)
        if twin in FITTED_FLOAT8_BY_GPU:
            return Efficiency(FITTED_FLOAT8_BY_GPU[twin],
                              f"{FIT} for {twin} with Float8 (same compute die as {gpu})")
        if gpu.startswith("h100") and "h100-sxm-96gb" in FITTED_FLOAT8_BY_GPU:
            return Efficiency(FITTED_FLOAT8_BY_GPU["h100-sxm-96gb"],
                              f"{FIT} for h100-sxm-96gb with Float8 (the H100 die)")
        if FITTED_FLOAT8_BY_GPU:
            return Efficiency(statistics.median(FITTED_FLOAT8_BY_GPU.values()),
                              f"no published Float8 run on {gpu}: the median of the fitted cards")
    if stack is not None and (gpu, stack) in FITTED_BY_STACK:
        return Efficiency(FITTED_BY_STACK[gpu, stack], f"{FIT} for {gpu} with {stack}")
    if gpu in FITTED_BY_GPU:
        return Efficiency(FITTED_BY_GPU[gpu], f"{FIT} for {gpu}")
    twin = SAME_DIE.get(gpu)
    if twin in FITTED_BY_GPU:
        return Efficiency(FITTED_BY_GPU[twin], f"{FIT} for {twin} (same compute die as {gpu})")
    median = statistics.median(FITTED_BY_GPU.values())
    return Efficiency(median, f"no published run on {gpu}: the median of the fitted cards "
                              f"({', '.join(sorted(FITTED_BY_GPU))})")


def check_efficiency(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"--efficiency must be in (0, 1] (a fraction of the dense peak), "
                         f"got {value}")
    return value
