"""Hardware profiles measured by ``ops-transformer calibrate``: where they live, how they are read.

``load_profile`` returns a :class:`CalibratedProfile`, a :class:`~.hardware.HardwareProfile` whose
collectives use the α and β measured for each kind at the nearest measured world size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .hardware import HardwareProfile


def default_profile_path() -> Path:
    """``$OPS_TRANSFORMER_PROFILE`` if set, else ``~/.cache/ops-transformer/profile.json``."""
    override = os.environ.get("OPS_TRANSFORMER_PROFILE")
    return Path(override) if override else Path.home() / ".cache" / "ops-transformer" / "profile.json"


def save_profile(profile: dict, path=None) -> Path:
    """Write ``profile`` as JSON (atomically: a temporary file, then a rename); returns the path."""
    path = Path(path) if path is not None else default_profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile, indent=2) + "\n")
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class CalibratedProfile(HardwareProfile):
    """A measured :class:`HardwareProfile`: the base ``alpha_s``/``bandwidth`` are the all-reduce's
    at the smallest measured world size (2); ``per_kind[p][kind] = (α, β)`` gives each kind its
    own, taken from the measured world size nearest the group (ties: the larger). Kinds never
    measured (broadcast, send) fall back to the base figures."""

    per_kind: dict = field(default_factory=dict, compare=False, repr=False)
    matmul_by_size: dict = field(default_factory=dict, compare=False, repr=False)
    p2p_threshold_bytes: int | None = None
    # {catalogue card: bf16 matmul efficiency} measured by `calibrate` on a GPU (the planner's
    # efficiency for that card, planner/efficiency.py); empty on a CPU machine.
    gpu_efficiency: dict = field(default_factory=dict, compare=False, repr=False)

    def alpha_beta(self, kind: str, group_size: int) -> tuple[float, float]:
        if not self.per_kind:
            return self.alpha_s, self.bandwidth
        p = min(self.per_kind, key=lambda q: (abs(q - group_size), -q))
        return self.per_kind[p].get(kind, (self.alpha_s, self.bandwidth))


def load_profile(path=None) -> CalibratedProfile:
    """Read a profile written by ``ops-transformer calibrate`` (default
    :func:`default_profile_path`)."""
    path = Path(path) if path is not None else default_profile_path()
    if not path.is_file():
        raise ValueError(f"no hardware profile at {path}: run `ops-transformer calibrate` first")
    data = json.loads(path.read_text())
    missing = [k for k in ("name", "matmul_flops_best", "collectives") if k not in data]
    if missing or not data["collectives"]:
        raise ValueError(f"{path} is not a calibration profile: missing {missing or 'collectives'}")
    per_kind = {int(p): {kind: (float(v["alpha_s"]), float(v["bandwidth"]))
                         for kind, v in kinds.items()}
                for p, kinds in data["collectives"].items()}
    base = per_kind[min(per_kind)]
    if "all_reduce" not in base:
        raise ValueError(f"{path} has no all_reduce measurement at world size {min(per_kind)}")
    alpha, beta = base["all_reduce"]
    return CalibratedProfile(data["name"], float(data["matmul_flops_best"]), alpha, beta,
                             per_kind=per_kind,
                             matmul_by_size={int(n): float(f)
                                             for n, f in data.get("matmul_flops", {}).items()},
                             p2p_threshold_bytes=data.get("p2p_threshold_bytes"),
                             gpu_efficiency=_gpu_efficiency(data.get("gpu")))


def _gpu_efficiency(entry) -> dict:
    """``{card: efficiency}`` from a profile's ``"gpu"`` entry (:func:`ops_transformer.profiler.calibrate.gpu_efficiency`)
    when the device is a catalogue card."""
    if not isinstance(entry, dict) or not entry.get("catalogue"):
        return {}
    value = entry.get("matmul_efficiency")
    return {entry["catalogue"]: float(value)} if isinstance(value, (int, float)) and value > 0 \
        else {}
