"""``ops-transformer calibrate``: measure this machine into a hardware profile for the planner."""

from __future__ import annotations

from ..profiler.calibrate import calibrate
from ..planner.calibrated import save_profile
from ._calibrated import ENV_VAR, profile_path
from ..utils.progress import format_table
from ._common import (add_launch_timeout, check_out_file, launch_timeout, print_json,
                      refuse_torchrun)

HELP = ("measure matmul FLOP/s, collective latency and bandwidth, and the point-to-point "
        "threshold of this machine into a hardware profile (JSON)")


def add_parser(p) -> None:
    p.add_argument("--out", help=f"where to write the profile (default: ${ENV_VAR} if set, else "
                   f"~/.cache/ops-transformer/profile.json)")
    p.add_argument("--world-sizes", help="comma-separated numbers of local ranks for the "
                   "collectives (default 2,4; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="few sizes and runs: seconds, rough")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_launch_timeout(p, default=900.0)  # each of its local jobs


def parse_world_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"--world-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 2:
        raise ValueError(f"--world-sizes must name world sizes of at least 2, got {text!r}")
    return sizes


def human_bytes(n: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


def summary(profile: dict) -> str:
    matmul = [{"matmul n": int(n), "GFLOP/s": f / 1e9} for n, f in profile["matmul_flops"].items()]
    rows = [{"ranks": int(p), "collective": kind, "α (µs)": v["alpha_s"] * 1e6,
             "β (GB/s)": v["bandwidth"] / 1e9, "fit": v.get("fit", ""),
             "fit error": f"{100 * v['fit_rel_error']:.1f}%",
             "sizes": f"{human_bytes(v['points'][0][0])} – {human_bytes(v['points'][-1][0])}"}
            for p, kinds in profile["collectives"].items() for kind, v in kinds.items()]
    p2p = profile["p2p"]
    sizes = [b for b, _, _ in p2p["points"]]
    votes = ["send_recv" if tp < tg else "all_gather" for _, tp, tg in p2p["points"]]
    small, threshold = p2p["small_messages"], profile["p2p_threshold_bytes"]
    cut = sizes.index(threshold) if threshold is not None else len(sizes)
    agree = sum(v == small for v in votes[:cut]) + sum(v != small for v in votes[cut:])
    names = {"send_recv": "send/recv", "all_gather": "all-gather"}
    other = names["all_gather" if small == "send_recv" else "send_recv"]
    if threshold is None:
        line = f"{names[small]} is the faster method, with no size where that changes"
    else:
        line = f"{names[small]} is faster below {human_bytes(threshold)}, {other} from there on"
    line += (f" ({agree} of {len(sizes)} sizes from {human_bytes(sizes[0])} to "
             f"{human_bytes(sizes[-1])} agree)" + ("" if threshold else "; no threshold"))
    swaps = [{"n bytes": human_bytes(b), "send/recv (µs)": tp * 1e6, "all-gather (µs)": tg * 1e6,
              "faster": "send/recv" if tp < tg else "all-gather"} for b, tp, tg in p2p["points"]]
    parts = [format_table(matmul), format_table(rows), format_table(swaps),
             f"two ranks swapping n bytes: {line}"]
    if "overlap" in profile:
        points = ", ".join(f"{human_bytes(p['bytes'])}: {p['efficiency']:.2f}"
                           for p in profile["overlap"]["points"])
        parts.append(f"an all-reduce beside matmuls hides η = "
                     f"{profile['overlap']['efficiency']:.2f} of the shorter ({points}); "
                     f"overlap='auto' weighs chunks by it")
    return "\n\n".join(parts)


def run(args) -> int:
    refuse_torchrun("calibrate", "launches its own local ranks")
    sizes = parse_world_sizes(args.world_sizes) if args.world_sizes else \
        ((2,) if args.quick else (2, 4))
    out = check_out_file(args.out or profile_path())
    profile = calibrate(sizes, quick=args.quick, progress=not args.no_progress,
                        timeout=launch_timeout(args))
    path = save_profile(profile, out)
    if args.json:
        print_json(profile)
        return 0
    print(summary(profile))
    print(f"\nwrote {path}")
    return 0
