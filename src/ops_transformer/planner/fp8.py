"""What ``train --precision fp8`` (SPEC F20, :mod:`ops_transformer.precision.fp8`) changes in one
training step's tensor-parallel collectives, counted as the ledger counts them.

The fp8 layers issue the same collectives as the fp32 ones (the same kinds, calls and elements),
plus one all-reduce (MAX) of one fp32 scalar per split tensor whose amax every rank must agree on
(``fp8.amax``, ``fp8.grad_amax``); under sequence parallelism the region entries' forward
all-gathers move 1-byte e4m3 values in place of 4-byte ones (``fp8.gather.fwd``). Everything
else stays fp32 (4 bytes): the row exits' all-reduces / reduce-scatters, every backward
collective. Per block of the reference decoder (4 column layers ``q, k, v, w_in`` and 2 row
layers ``o, w_out``), per forward:

* 4 column weights + 2 row weights + 2 row inputs = 8 amax all-reduces, + the 2 entries' token
  amax under sequence parallelism (10);
* ``recompute="full"``: the forward runs again in backward, its amaxes (and gathers) again;
* ``fp8_backward="e5m2"``: one more per column layer, its output gradient's amax (4).

Matmuls: a GPU runs the fp8 products at its FP8 peak (``plan --matmul-precision float8``:
:func:`~.timing.gemm_parts`); a CPU's ``torch._scaled_mm`` dequantises and multiplies in fp32, so
the local model prices fp8 at fp32's rate (``calibrate`` fits no fp8 constants).
"""

from __future__ import annotations

from .cost import Comm

FP8_BYTES = 1  # an e4m3 element
COLUMN_LAYERS, ROW_LAYERS = 4, 2  # per block: q, k, v, w_in; o, w_out


def fp8_amax_calls(n_layers: int, *, sequence_parallel: bool | str = False,
                   recompute: str = "none", backward: str = "e5m2") -> int:
    """The amax all-reduces (one fp32 scalar each) of one step's forward and backward at tp > 1."""
    forward = COLUMN_LAYERS + 2 * ROW_LAYERS + (2 if sequence_parallel else 0)
    passes = 2 if recompute == "full" else 1
    return n_layers * (forward * passes + (COLUMN_LAYERS if backward == "e5m2" else 0))


def fp8_gathers(cfg, batch: int, seq: int, *, sequence_parallel: bool | str = False,
                recompute: str = "none") -> Comm:
    """The region entries' forward all-gathers that move e4m3 bytes (sequence parallelism only):
    2 per block of ``batch·seq·d_model`` elements, again under full recompute."""
    if not sequence_parallel:
        return Comm()
    calls = 2 * cfg.n_layers * (2 if recompute == "full" else 1)
    return Comm().add("all_gather", calls * batch * seq * cfg.d_model, calls)


def fp8_tp_comm(tp_comm: Comm, cfg, tp: int, batch: int, seq: int, *,
                sequence_parallel: bool | str = False, recompute: str = "none",
                backward: str = "e5m2") -> tuple[Comm, Comm]:
    """``(wide, narrow)``: the step's tensor-parallel collectives under fp8, split by element
    size — ``wide`` at 4 bytes (``tp_comm``, the fp32 model's, less the fp8 gathers, plus the
    amax all-reduces), ``narrow`` at :data:`FP8_BYTES` (the fp8 gathers)."""
    if tp == 1:
        return Comm(), Comm()
    narrow = fp8_gathers(cfg, batch, seq, sequence_parallel=sequence_parallel,
                         recompute=recompute)
    amax = fp8_amax_calls(cfg.n_layers, sequence_parallel=sequence_parallel,
                          recompute=recompute, backward=backward)
    return tp_comm.minus(narrow) + Comm().add("all_reduce", amax, amax), narrow
