"""Kernel time by shape: a roofline per GEMM with tile and wave quantisation, the flash-attention
core, and memory-bound work (SPEC F10).

A GEMM ``(m × k) · (k × n)`` does ``2mnk`` FLOPs and moves at least ``(mk + kn + mn)`` elements
through HBM. Its time is the larger of the two bounds (Williams et al. 2009, "Roofline")::

    t = max(2mnk / (peak · ceiling · wave(m, n)), (mk + kn + mn) · bytes / bandwidth)

* ``ceiling`` is the fraction of the dense peak a large, square GEMM of the stack reaches (fitted
  per card on the published runs, :mod:`.efficiency`, or measured by ``calibrate`` on a GPU);
* ``wave(m, n)`` is the tile and wave quantisation of the output: the ``m × n`` output is cut
  into ``TILE × TILE`` tiles (the last row and column of tiles padded), the tiles run in waves of
  one tile per SM, and the last wave may leave SMs idle (NVIDIA, "Matrix Multiplication
  Background User's Guide", Deep Learning Performance docs: tile and wave quantisation)::

      wave = m·n / (waves · SMs · TILE²),  waves = ⌈⌈m/TILE⌉·⌈n/TILE⌉ / SMs⌉

  so a GEMM a little larger than a whole number of waves runs at about half the rate, a skinny
  one (small ``m`` or ``n``) below peak, a large square one at the ceiling.

Training runs each projection three times: forward ``(T × k)·(k × n)``, the input gradient
``(T × n)·(n × k)`` and the weight gradient ``(k × T)·(T × n)`` for ``T`` tokens.

The flash-attention core (Dao et al. 2022) is one kernel over ``b · heads`` blocks of ``TILE``
queries; its FLOPs run at ``ceiling × attention_ratio`` (fitted) times its own wave quantisation,
and it reads Q, K, V and writes O once — bounded by the larger of the two as a GEMM is.
Memory-bound work (norms, activation functions, residuals, the loss) is bytes over bandwidth.
"""

from __future__ import annotations

import math

TILE = 128  # output tile edge of the tensor-core GEMM kernels (CUTLASS/cuBLAS 128 × 128 class)


def wave_efficiency(m: int, n: int, sms: int, tile: int = TILE) -> float:
    """The fraction of the SMs' tile slots an ``m × n`` output fills (padding of the last tiles
    and the idle SMs of the last wave); 1 when ``sms`` is 0 (not modelled, e.g. a CPU)."""
    if sms <= 0:
        return 1.0
    tiles = math.ceil(m / tile) * math.ceil(n / tile)
    waves = math.ceil(tiles / sms)
    return (m * n) / (waves * sms * tile * tile)


def gemm_time(m: int, n: int, k: int, *, peak: float, bandwidth: float, bytes_per_element: int,
              ceiling: float, sms: int = 0) -> float:
    """Seconds of one ``(m × k)·(k × n)`` GEMM: the larger of its compute bound (at ``ceiling ×
    wave_efficiency`` of ``peak``) and its memory bound (the three matrices once)."""
    compute = 2.0 * m * n * k / (peak * ceiling * wave_efficiency(m, n, sms))
    memory = (m * k + k * n + m * n) * bytes_per_element / bandwidth
    return max(compute, memory)


def gemm_bounds(m: int, n: int, k: int, *, peak: float, bandwidth: float,
                bytes_per_element: int, sms: int = 0) -> tuple[float, float]:
    """``(compute_s at ceiling 1, memory_s)`` of one GEMM: ``gemm_time`` is ``max(compute_s /
    ceiling, memory_s)`` — the form the fit uses, which varies the ceiling only."""
    compute = 2.0 * m * n * k / (peak * wave_efficiency(m, n, sms))
    memory = (m * k + k * n + m * n) * bytes_per_element / bandwidth
    return compute, memory


def training_gemms(tokens: int, k: int, n: int) -> list[tuple[int, int, int]]:
    """The three GEMMs ``(m, n, k)`` of one projection with ``k`` inputs and ``n`` outputs over
    ``tokens`` rows in a training step: forward, input gradient, weight gradient."""
    return [(tokens, n, k), (tokens, k, n), (k, n, tokens)]


def attention_bounds(*, flops: float, batch: int, heads: int, q_len: int, kv_len: int,
                     head_dim: int, kv_heads: int, peak: float, bandwidth: float,
                     bytes_per_element: int, sms: int = 0) -> tuple[float, float]:
    """``(compute_s at ceiling 1, memory_s)`` of a flash-attention pass of ``flops`` FLOPs:
    ``batch × heads × ⌈q_len / TILE⌉`` query blocks in waves over the SMs; Q and O of
    ``q_len``, K and V of ``kv_len`` rows read or written once."""
    blocks = batch * heads * math.ceil(q_len / TILE)
    wave = 1.0 if sms <= 0 else blocks / (math.ceil(blocks / sms) * sms)
    moved = batch * head_dim * (2 * heads * q_len + 2 * kv_heads * kv_len) * bytes_per_element
    return flops / (peak * wave), moved / bandwidth


def memory_bound_time(bytes_moved: float, bandwidth: float) -> float:
    """Seconds of elementwise or normalisation work that moves ``bytes_moved`` through HBM."""
    return bytes_moved / bandwidth


def bounded(bounds: list[tuple[float, float, float]], ceiling: float) -> float:
    """``Σ count · max(compute_s / ceiling, memory_s)`` over ``(compute_s, memory_s, count)``."""
    return sum(c * max(f / ceiling, mem) for f, mem, c in bounds)
