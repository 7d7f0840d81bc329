"""Parity checks (SPEC F12): does a model split over tensor-parallel ranks compute what the unsplit
model computes, and which module is the first that does not?

:func:`check_parity` runs the same inputs through the dense model (on rank 0 alone) and the
parallel one and returns a :class:`ParityReport`; ``ops-transformer check`` is its command line.
What is compared for each plan style: :mod:`.layout`; the tolerances per dtype: :mod:`.tolerance`;
which module is blamed: :mod:`.attribute`; see ``docs/parity.md``.
"""

from .check import check_parity
from .report import ParityReport
from .tolerance import TOLERANCES, Tolerance

__all__ = ["check_parity", "ParityReport", "TOLERANCES", "Tolerance"]
