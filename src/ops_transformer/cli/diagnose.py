"""``ops-transformer diagnose``: what is wrong with a training configuration, and the fix. (Its
command line is train's, torch-free; the profiler is imported when the command runs.)"""

from __future__ import annotations

from dataclasses import replace

from ..utils.progress import format_table
from . import train_args
from ._common import launch_timeout, print_json

HELP = ("diagnose a training configuration (options as train): sizes vs tp and Tensor-Core "
        "tiles, host syncs, redundant or small collectives, exposed communication, imbalance")


def add_run_arguments(p) -> None:
    """The options of the run that diagnose checks: train's (and ``--config``)."""
    p = train_args.SectionGroups(p)  # grouped by the run's sections, as train's
    train_args.add_config_argument(p, "diagnose")
    train_args.add_training_arguments(p)
    train_args.add_model_argument(p, "diagnose")


def add_parser(p) -> None:
    add_run_arguments(p)
    p.add_argument("--static", action="store_true", help="only the checks on the model's sizes "
                   "(no step is run)")


def table(found: list[dict]) -> str:
    rows = [{"severity": d["severity"], "code": d["code"], "where": d["where"][:40],
             "saving ms/step": (round(1e3 * d["estimated_saving_s"], 3)
                                if d["estimated_saving_s"] else None),
             "message": d["message"]} for d in found]
    fixes = "\n".join(f"  {i + 1}. [{d['code']}] {d['suggestion']}" for i, d in enumerate(found))
    return format_table(rows) + "\n\nfixes:\n" + fixes


def run(args) -> int:
    from ..profiler.diagnose import SEVERITIES
    from ..profiler.run import check_measuring_only, dense_diagnostics, diagnose_worker
    from . import train as train_cli

    train_cli.model_or_preset(args)
    cfg = replace(train_cli.config_from_args(args, "diagnose", add_run_arguments), out=None)  # it writes no file
    check_measuring_only(cfg, "diagnose")
    found = dense_diagnostics(cfg, cfg.tp)
    if not args.static and not any(d["severity"] == "error" for d in found):
        found = train_cli.run_training(cfg, train_cli.launch_size(args, cfg),
                                       launch_timeout(args), diagnose_worker)
        if found is None:  # not rank 0 of a torchrun job
            return 0
    counts = {s: sum(d["severity"] == s for d in found) for s in SEVERITIES}
    if args.json:
        print_json({"diagnostics": found, "counts": counts})
    elif not found:
        print("no findings")
    else:
        print(table(found))
        print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 1 if counts["error"] else 0
