"""Where the calibrated hardware profile lives, for the commands. The library never looks for it.

``$OPS_TRANSFORMER_PROFILE`` names the file, else ``~/.cache/ops-transformer/profile.json`` (where
``ops-transformer calibrate`` writes). Only one process of a job reads it: the launcher under
``--nproc`` (its ranks get the loaded profile), rank 0 under ``torchrun`` (the others pass nothing,
and ``init_parallel`` broadcasts rank 0's profile, so a file on some nodes only, or a different one on
each, changes nothing).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..planner.calibrated import load_profile
from ._common import is_lead

ENV_VAR = "OPS_TRANSFORMER_PROFILE"


def profile_path() -> Path:
    """``$OPS_TRANSFORMER_PROFILE`` if set, else ``~/.cache/ops-transformer/profile.json``."""
    override = os.environ.get(ENV_VAR)
    return Path(override) if override else Path.home() / ".cache" / "ops-transformer" / "profile.json"


def command_profile(needed_for: str | None):
    """The calibrated profile for a command, or ``None`` (the built-in one is used) when there is
    no file or this process is not the one that reads it.

    ``needed_for`` names the automatic choice that uses it (e.g. ``"--attention auto"``): a file
    that cannot be used is then a one-line ``ValueError`` naming it and how to regenerate it. With
    ``None`` (every choice was made explicitly, the profile only refines the collectives) it is a
    warning on stderr and the built-in profile is used.
    """
    if not is_lead():  # under torchrun, rank 0 reads it for everyone
        return None
    path = profile_path()
    if not path.exists():
        return None
    try:
        return load_profile(path)
    except ValueError as exc:
        if needed_for:
            raise ValueError(f"{exc} (it is needed for {needed_for}; or delete it to use the "
                             f"built-in profile)") from None
        print(f"ops-transformer: warning: {exc}; using the built-in profile", file=sys.stderr)
        return None
