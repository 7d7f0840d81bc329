"""Profiler, diagnostics and sweeps (SPEC F12), and the measurements of this machine.

- :func:`profile_step` / :class:`Profile`: where a step's time goes on every rank, from
  ``torch.profiler`` (compute, exposed and overlapped communication, per-collective latency and
  bandwidth, top operators, the critical path);
- :func:`diagnose` / :class:`Diagnostic`: what is wrong in a model or a step and how to fix it;
- :mod:`.sweep`: several training configurations side by side; :mod:`.bench`: ours against
  DTensor TP and the plain model;
- :mod:`.calibrate` (``ops-transformer calibrate``) and :mod:`.validate` (``plan --validate``):
  this machine measured for the cost model, and the cost model checked against runs.
"""

from .diagnose import CODES, SEVERITIES, Diagnostic, diagnose
from .profile import Profile, profile_step

__all__ = ["CODES", "Diagnostic", "Profile", "SEVERITIES", "diagnose", "profile_step"]
