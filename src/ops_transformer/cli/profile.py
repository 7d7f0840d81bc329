"""``ops-transformer profile``: a few training steps under ``torch.profiler`` on every rank. (Its
command line is train's, torch-free; the profiler is imported when the command runs.)"""

from __future__ import annotations

from dataclasses import replace

from . import train_args
from ._common import launch_timeout, print_json

HELP = ("profile a few training steps (options as train): compute vs communication per rank, "
        "collectives, top operators, critical path; Chrome traces, profile.json and pictures")


def add_run_arguments(p) -> None:
    """The options of the run that profile measures: train's (and ``--config``)."""
    p = train_args.SectionGroups(p)  # grouped by the run's sections, as train's
    train_args.add_config_argument(p, "profile", note="; its [run] steps are not profile's "
                                   "--steps")
    train_args.add_training_arguments(p)
    train_args.add_model_argument(p, "profile")


def add_parser(p) -> None:
    add_run_arguments(p)
    p.add_argument("--warmup", type=int, default=2, help="unprofiled steps first (default 2)")
    p.set_defaults(steps=5)  # the profiled steps


def check_args(args) -> None:
    """train's checks that need no rank (:func:`~ops_transformer.cli.train_args.check_args`),
    before the profiler (and torch) is imported."""
    train_args.model_or_preset(args)
    train_args.check_args(args, add_run_arguments)


def run(args) -> int:
    from ..profiler.report import summary_text
    from ..profiler.run import check_measuring_only, profile_worker
    from . import train as train_cli

    train_cli.model_or_preset(args)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    cfg = replace(train_cli.config_from_args(args, "profile", add_run_arguments),
                  steps=args.steps)  # the profiled steps (a --config file's are its run's)
    check_measuring_only(cfg, "profile")
    summary = train_cli.run_training(cfg, train_cli.launch_size(args, cfg), launch_timeout(args),
                                     profile_worker, (args.steps, args.warmup))
    if summary is None:  # not rank 0 of a torchrun job
        return 0
    if args.json:
        print_json(summary)
        return 0
    print(summary_text(summary))
    print("\nwrote " + ", ".join(summary["files"].values()))
    return 0
