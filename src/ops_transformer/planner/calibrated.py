"""Hardware profiles measured by ``ops-transformer calibrate``: how they are written and read.

``load_profile(path)`` returns a :class:`CalibratedProfile`, a :class:`~.hardware.HardwareProfile`
whose collectives use the α and β measured for each kind at the nearest measured world size, and
whose ``overlap_efficiency`` is the measured one (1 in a profile written before it was measured).

Where the file lives is the command line's business (:mod:`ops_transformer.cli._calibrated`: the
``OPS_TRANSFORMER_PROFILE`` variable, else ``~/.cache/ops-transformer/profile.json``); the library
only reads the path it is given, and :func:`~ops_transformer.parallel.init_parallel` reads it on
rank 0 alone and broadcasts the profile, so every rank decides from the same figures.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .hardware import HardwareProfile

REGENERATE = "regenerate it with `ops-transformer calibrate`"


def save_profile(profile: dict, path) -> Path:
    """Write ``profile`` as JSON to ``path`` (atomically: a temporary file, then a rename)."""
    path = Path(path)
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
    p2p_small_messages: str = "send_recv"  # the faster method below the threshold
    # {catalogue card: bf16 matmul efficiency} measured by `calibrate` on a GPU (the planner's
    # efficiency for that card, planner/efficiency.py); empty on a CPU machine.
    gpu_efficiency: dict = field(default_factory=dict, compare=False, repr=False)
    # the fitted CPU step-time constants (planner/local.py LocalTimeModel); {} when not fitted
    local_model: dict = field(default_factory=dict, compare=False, repr=False)

    def alpha_beta(self, kind: str, group_size: int) -> tuple[float, float]:
        if not self.per_kind:
            return self.alpha_s, self.bandwidth
        p = min(self.per_kind, key=lambda q: (abs(q - group_size), -q))
        return self.per_kind[p].get(kind, (self.alpha_s, self.bandwidth))


def load_profile(path) -> CalibratedProfile:
    """Read the profile that ``ops-transformer calibrate`` wrote to ``path``.

    Every problem — no file, unreadable, not JSON, not a calibration profile — is a ``ValueError``
    of one line that names the file and says how to regenerate it. An optional ``"inter_node":
    {"alpha_s", "bandwidth"}`` entry (written by hand: one machine cannot measure it) gives the
    links between nodes; an optional ``"inter_island"`` entry of the same form the link between
    the PCIe islands of a node (its bandwidth shared by the transfers crossing it).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no hardware profile at {path}: run `ops-transformer calibrate` first")
    try:
        data = json.loads(path.read_text())
        return _from_dict(data)
    except OSError as exc:
        raise ValueError(f"the hardware profile {path} cannot be read ({exc.strerror or exc}); "
                         f"{REGENERATE}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
        raise ValueError(f"the hardware profile {path} is not a valid calibration profile "
                         f"({detail}); {REGENERATE}") from None


def _from_dict(data: dict) -> CalibratedProfile:
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    missing = [k for k in ("name", "matmul_flops_best", "collectives") if not data.get(k)]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    per_kind = {int(p): {kind: (float(v["alpha_s"]), float(v["bandwidth"]))
                         for kind, v in kinds.items()}
                for p, kinds in data["collectives"].items()}
    base = per_kind[min(per_kind)]
    if "all_reduce" not in base:
        raise ValueError(f"no all_reduce measurement at world size {min(per_kind)}")
    alpha, beta = base["all_reduce"]
    inter = data.get("inter_node") or {}
    island = data.get("inter_island") or {}
    threshold = data.get("p2p_threshold_bytes")
    return CalibratedProfile(
        str(data["name"]), float(data["matmul_flops_best"]), alpha, beta,
        inter_node_alpha_s=_optional_float(inter.get("alpha_s")),
        inter_node_bandwidth=_optional_float(inter.get("bandwidth")),
        inter_island_alpha_s=_optional_float(island.get("alpha_s")),
        inter_island_bandwidth=_optional_float(island.get("bandwidth")),
        per_kind=per_kind,
        matmul_by_size={int(n): float(f) for n, f in data.get("matmul_flops", {}).items()},
        p2p_threshold_bytes=None if threshold is None else int(threshold),
        p2p_small_messages=str((data.get("p2p") or {}).get("small_messages", "send_recv")),
        gpu_efficiency=_gpu_efficiency(data.get("gpu")),
        overlap_efficiency=float((data.get("overlap") or {}).get("efficiency", 1.0)),
        local_model=_local_model(data.get("local_model")))


def _local_model(entry) -> dict:
    """The ``"local_model"`` entry as written (checked to have its keys), or ``{}``."""
    if not entry:
        return {}
    keys = ("matmul_flops", "per_layer_s", "fixed_s", "alpha_step_s", "bandwidth", "cores")
    missing = [k for k in keys if k not in entry]
    if missing:
        raise ValueError(f"local_model lacks {', '.join(missing)}")
    return dict(entry)


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def _gpu_efficiency(entry) -> dict:
    """``{card: efficiency}`` from a profile's ``"gpu"`` entry (:func:`ops_transformer.profiler.calibrate.gpu_efficiency`)
    when the device is a catalogue card."""
    if not isinstance(entry, dict) or not entry.get("catalogue"):
        return {}
    value = entry.get("matmul_efficiency")
    return {entry["catalogue"]: float(value)} if isinstance(value, (int, float)) and value > 0 \
        else {}
