"""``ops-transformer demo``: the main job in one command (what ``make demo`` runs).

Trains the ``tiny`` GPT preset with ``tp=2`` on 2 local ranks, runs its first steps again at
``tp=1`` on one process and reports the largest relative loss difference, the communication per
step against the theoretical minimum, tokens/s and a generated sample. Writes
``runs/demo-<timestamp>/metrics.json`` and ``loss.png``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from ..launch import launch
from ..training.loop import TrainConfig, train_worker, validate, write_outputs
from ._common import (add_launch_timeout, check_out_dir, launch_timeout, print_json,
                      refuse_torchrun, status)
from ._calibrated import command_profile
from .train import summary

HELP = "train the tiny GPT at tp=2 on 2 local ranks and check it against tp=1"
CHECK_STEPS = 10  # steps re-run at tp=1 for the exactness check


def add_parser(p) -> None:
    p.add_argument("--steps", type=int, default=600, help="training steps at tp=2 (default 600)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument("--out", help="output directory (default runs/demo-<timestamp>)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    add_launch_timeout(p)


def _comm_lines(measured: dict, expected: dict) -> list[str]:
    lines = []
    for kind in sorted(set(measured) | set(expected)):
        m, e = measured.get(kind, {}), expected.get(kind, {})
        ok = m.get("calls") == e.get("calls") and m.get("elements") == e.get("elements")
        lines.append(f"  {kind:<14} {m.get('calls', 0):>3} calls {m.get('elements', 0):>9,} "
                     f"elements   minimum {e.get('calls', 0):>3} calls {e.get('elements', 0):>9,}"
                     f"   {'= minimum' if ok else 'DIFFERS'}")
    return lines


def run(args) -> int:
    refuse_torchrun("demo", "launches its own local ranks (and a tp=1 reference)")
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = TrainConfig(preset="tiny", tp=args.tp, steps=args.steps, batch=16, seq=64, lr=3e-3)
    validate(cfg, args.tp)
    timeout = launch_timeout(args)
    profile = command_profile("the demo's automatic attention choice")
    check_out_dir(out)
    check = dataclasses.replace(cfg, tp=1, steps=min(CHECK_STEPS, cfg.steps), sample_tokens=0,
                                progress=False)
    status(f"demo: GPT preset 'tiny' on {args.tp} local ranks (tp={args.tp}), {cfg.steps} steps "
           f"of {cfg.batch}×{cfg.seq} bytes of the Python standard library")
    metrics = launch(train_worker, args.tp, cfg, profile, timeout=timeout)[0]
    status(f"demo: re-running the first {check.steps} steps at tp=1 on one process ...")
    reference = launch(train_worker, 1, check, profile, timeout=timeout)[0]
    pairs = list(zip(metrics["losses"], reference["losses"]))
    metrics["max_rel_loss_diff_vs_tp1"] = max(abs(a - b) / abs(b) for a, b in pairs)
    expected = metrics["expected_tp_comm_per_step"]
    metrics["expected_allreduce_per_step"] = expected.get("all_reduce", {}).get("calls", 0)
    write_outputs(out, metrics)
    if args.json:
        print_json(metrics)
        return 0 if metrics["max_rel_loss_diff_vs_tp1"] <= 1e-5 else 1
    print(summary(metrics))
    print(f"\nexactness: the first {len(pairs)} losses at tp={args.tp} differ from tp=1 by at most "
          f"{metrics['max_rel_loss_diff_vs_tp1']:.2e} (relative)")
    print(f"communication per step on rank 0 (plan: attention={metrics['attention']}: "
          f"{metrics['attention_reason'] or 'as requested'})")
    print("\n".join(_comm_lines(metrics["tp_comm_per_step"], expected)))
    print(f"\nsample after {cfg.steps} steps: {metrics['sample']!r}")
    print(f"\nwrote {out / 'metrics.json'} and {out / 'loss.png'}")
    return 0 if metrics["max_rel_loss_diff_vs_tp1"] <= 1e-5 else 1
